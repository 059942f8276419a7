"""One GPU, one run: a host-local lock the run itself takes on each GPU it uses.

Prefect places a night on a worker (one worker per GPU, ``--limit 1``), but placement is not
exclusion: a worker restarted while its run went on leaves an orphan on the GPU that the new worker
does not see, and a ``qerl run`` started by hand on the machine is no worker's run at all. So the run
takes an ``flock`` on ``<QERL_GPU_LOCK_DIR>/gpu-<id>.lock`` for each GPU it will use, before it
touches one, and keeps it for the attempt. The kernel drops an ``flock`` when its process dies, so a
crashed run never wedges a GPU. The directory must be local to the machine (``/tmp/qerl-gpu-locks``
by default): on a shared filesystem the lock would be either global or, on many network
filesystems, silently granted to everyone.

Which GPUs: ``QERL_GPU_ID`` (what ``qerl worker --gpu`` sets), else the ids of
``CUDA_VISIBLE_DEVICES``; none of either (a CPU machine, or a machine whose GPUs are all the run's):
no lock. A run that finds its GPU held waits for it (``wait_s``), saying whose it is, then fails
naming the holder: two runs on one GPU would both fail for memory, or worse, both crawl.

Each hold appends one line to ``gpu-<id>.jsonl`` beside the lock when it ends (run, pid, host,
acquired, released: wall-clock seconds), the record the fleet suite checks for overlaps.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from qerl.pipeline.fleet import settings

log = logging.getLogger("qerl.fleet")


class GpuBusyError(RuntimeError):
    """The run's GPU stayed held by another process; the message names it."""


def run_gpus() -> list[str]:
    """The GPU ids this process will use (module docstring), possibly none."""
    if gid := settings.gpu_id():
        return [gid]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    return [g.strip() for g in visible.split(",") if g.strip() and g.strip() != "-1"]


def _safe(gpu: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in gpu)


def _holder(path: Path) -> dict[str, Any]:
    try:
        info = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


@contextlib.contextmanager
def _hold_one(gpu: str, run_id: str, directory: Path, wait_s: float) -> Iterator[None]:
    lock = directory / f"gpu-{_safe(gpu)}.lock"
    deadline, said = time.monotonic() + wait_s, False
    with open(lock, "a+") as fh:
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                info = _holder(lock)
                whose = (
                    f"run {info.get('run_id', '?')} (pid {info.get('pid', '?')} on {info.get('host', '?')})"
                )
                if time.monotonic() >= deadline:
                    raise GpuBusyError(
                        f"GPU {gpu} is held by {whose} ({lock}): waited {wait_s:g} s; stop that process "
                        "or let it finish"
                    ) from None
                if not said:
                    log.warning("GPU %s is held by %s: waiting for it", gpu, whose)
                    said = True
                time.sleep(0.5)
        acquired = time.time()
        fh.seek(0)
        fh.truncate()
        me = {"run_id": run_id, "pid": os.getpid(), "host": socket.gethostname(), "since": acquired}
        fh.write(json.dumps(me))
        fh.flush()
        try:
            yield
        finally:
            with open(directory / f"gpu-{_safe(gpu)}.jsonl", "a") as journal:
                journal.write(
                    json.dumps({**me, "gpu": gpu, "acquired": acquired, "released": time.time()}) + "\n"
                )
            fcntl.flock(fh, fcntl.LOCK_UN)


@contextlib.contextmanager
def hold_gpus(run_id: str, wait_s: float = 600.0, gpus: list[str] | None = None) -> Iterator[list[str]]:
    """Hold the lock of each GPU of this run (``run_gpus()`` unless ``gpus``) for the block; yields
    the ids. A ``GpuBusyError`` when one stays held for ``wait_s``."""
    gpus = run_gpus() if gpus is None else gpus
    if not gpus:
        yield []
        return
    directory = settings.gpu_lock_dir()
    directory.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        for gpu in sorted(gpus):  # one order for every run: two runs never wait on each other's
            stack.enter_context(_hold_one(gpu, run_id, directory, wait_s))
        log.info("holding GPU %s for run %s", ", ".join(gpus), run_id)
        yield gpus


def intervals(gpu: str, directory: Path | None = None) -> list[dict[str, Any]]:
    """Every recorded hold of ``gpu`` on this machine (oldest first)."""
    path = (directory or settings.gpu_lock_dir()) / f"gpu-{_safe(gpu)}.jsonl"
    if not path.is_file():
        return []
    return sorted(
        (json.loads(line) for line in path.read_text().splitlines() if line), key=lambda e: e["acquired"]
    )
