"""Deterministic CUDA kernels for the trainer, so a rebuilt checkpoint has the bytes of the first build.

Why: a run resumed after a crash, and a checkpoint that retention pruned and a later step needs
(``qerl.flows.steps.Chain``), are rebuilt from the same inputs. The store then checks the rebuild against
the recorded digests: the same bytes put the files back under the same key, other bytes re-key the
checkpoint and every step after it. The CPU trainer is deterministic by construction. On CUDA some
backward kernels accumulate with atomics in whatever order the threads arrive (the gather behind the
token logprobs, scatter/index adds, attention backward), and cuBLAS may pick a split-K reduction
whose order depends on its workspace.

What ``deterministic_kernels`` does on CUDA, for the duration of one train step, restoring the previous
settings after (the same process may serve rollouts, which need none of it):

- ``torch.use_deterministic_algorithms(True)``, not ``warn_only``: the deterministic variant of every
  op that has one, and an error naming any op on the path that has none. ``warn_only=True`` is not a
  milder form of the same: the fused attention backwards (flash, memory-efficient, cuDNN) check it
  and keep their non-deterministic algorithm, only warning, so two identical GRPO steps give
  different bytes (the GPU kit's check, two steps at realistic lengths);
- cuDNN deterministic, no autotuning (``benchmark`` picks by timing, which can differ run to run);
- cuBLAS needs ``CUBLAS_WORKSPACE_CONFIG`` (``:4096:8``) in the environment before its first call in
  the process: ``prepare_process`` sets it unless the user set one (the CLI calls it at start-up;
  a library caller must call it before any CUDA matmul, since a late setting has no effect), and a
  step that finds another value warns that the bytes may differ.

On the CPU nothing changes (the CPU kernels are already deterministic, and their bytes are what the
tests and the caches hold). What was in force is returned, for the train manifest's ``extra``.
The cost on the GPU is measured by the kit (BENCHMARKS.md), not assumed.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

log = logging.getLogger(__name__)

CUBLAS_ENV = "CUBLAS_WORKSPACE_CONFIG"
CUBLAS_DETERMINISTIC = (":4096:8", ":16:8")  # the two settings cuBLAS documents as deterministic


def prepare_process() -> None:
    """Set the cuBLAS workspace config deterministic kernels need, unless the user set one: it is read
    once, at cuBLAS's first use in the process, so it must be in place before any CUDA matmul."""
    os.environ.setdefault(CUBLAS_ENV, CUBLAS_DETERMINISTIC[0])


@contextmanager
def deterministic_kernels(device: str, enabled: bool) -> Iterator[dict[str, Any]]:
    """Deterministic kernels on CUDA while the block runs (see the module docstring); yields the record
    of what was in force ({} on the CPU, where nothing is changed)."""
    if device != "cuda":
        yield {}
        return
    import torch

    if not enabled:
        yield {"deterministic": False}
        return
    prepare_process()  # effective only if cuBLAS has not started yet in this process
    cublas = os.environ.get(CUBLAS_ENV)
    if cublas not in CUBLAS_DETERMINISTIC:
        log.warning(
            "train.deterministic: %s=%r is not one of %s, so cuBLAS may reduce in a varying order and a "
            "rebuilt checkpoint may differ (set it in the environment before the run starts)",
            CUBLAS_ENV,
            cublas,
            list(CUBLAS_DETERMINISTIC),
        )
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    torch.use_deterministic_algorithms(True, warn_only=False)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield {"deterministic": True, CUBLAS_ENV: cublas}
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[2], saved[3]
