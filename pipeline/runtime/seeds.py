"""Derived seeds: one sha256 construction for every seed the pipeline derives from another.

What. ``derive_seed(namespace, *parts)`` hashes ``"namespace:part1:part2:..."`` with sha256 and keeps
the low 63 bits of the first 8 bytes (little endian), so the result fits every generator's seed
(torch, vLLM's per-request seed) and nearby inputs give unrelated seeds. The namespace keeps the
streams of different purposes apart: ``qerl-sample`` (one request of the rollout engines),
``qerl-rollout`` (an RL step's sampling and noise seeds), ``qerl-aqn`` (one layer's AQN draw),
``qerl-eval-chunk`` (a large evaluation's chunks after the first).

Why one helper: a drift in any copy of this construction would silently change sampled tokens and
invalidate cached rollouts. The strings are fixed (integers as ``str(int(x))``); ``tests/stages/test_rollout.py``
pins known values.
"""

from __future__ import annotations

import hashlib

__all__ = ["derive_seed"]

_MASK_63 = (1 << 63) - 1


def derive_seed(namespace: str, *parts: int | str) -> int:
    """A 63-bit seed from ``namespace`` and integer or string ``parts`` (see the module docstring)."""
    fields = [p if isinstance(p, str) else str(int(p)) for p in parts]
    raw = hashlib.sha256(":".join([namespace, *fields]).encode()).digest()
    return int.from_bytes(raw[:8], "little") & _MASK_63
