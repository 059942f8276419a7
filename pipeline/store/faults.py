"""Crash testing: ``QERL_FAULT=stage:n`` kills the process inside the n-th build of ``stage``.

The kill comes after the stage's outputs are written and before its manifest is, which is where a
power cut or an OOM kill does the most damage; the crash tests use it to show that the store then
holds no half-finished artifact and that a rerun rebuilds exactly the killed stage.
"""

from __future__ import annotations

import logging
import os
import signal

log = logging.getLogger("qerl.artifacts")

_FAULT_COUNTS: dict[str, int] = {}


def fault_point(stage: str) -> None:
    """Crash-test hook: ``QERL_FAULT=stage:n`` SIGKILLs this process inside the n-th build of
    ``stage`` (its outputs written, its manifest not yet), as a power cut or OOM kill would."""
    spec = os.environ.get("QERL_FAULT")
    if not spec:
        return
    target, _, nth = spec.partition(":")
    if target != stage:
        return
    _FAULT_COUNTS[stage] = _FAULT_COUNTS.get(stage, 0) + 1
    if _FAULT_COUNTS[stage] == int(nth or 1):
        log.error("QERL_FAULT=%s: killing this process inside stage %s", spec, stage)
        os.kill(os.getpid(), signal.SIGKILL)
