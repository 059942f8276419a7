"""The trainer's CPU threads next to a rollout engine: MKL and OpenMP as in a fresh process, one core per
intra-op thread, and nothing of vLLM's thread settings left behind in the trainer's process.

Why. ``torch.set_num_threads(n)`` also turns MKL's dynamic mode off and sets a thread-local MKL count.
A fresh process never calls it; after a vLLM engine start (which calls it in the caller's process), a
one-thread SFT or any other caller, MKL nests an OpenMP team inside every block of torch's own
``parallel_for``. libgomp keeps no pool for nested teams, so every GEMM block starts and ends a thread,
and under load MKL keeps both threads in every GEMM while one of them shares its core. vLLM's start
also writes thread environment variables that later children inherit (``LD_PRELOAD`` with torch's
libgomp, ``NUMEXPR_MAX_THREADS``) and replaces ``torch.set_num_threads`` in-process with a function
that ignores later calls. The measurements behind this are in docs/decisions.md and BENCHMARKS.md.

What this module does:

- ``fresh_process_threading()``: for the duration of a train step, torch's threading as a fresh
  process has it: OpenMP max-active-levels 1 (a parallel region inside one runs on the thread that
  meets it, as torch's own ``parallel_for`` already does), MKL dynamic on, no thread-local MKL count;
  the old values are restored after. The GEMMs are then the ones a fresh process runs.
- ``pinned_intra_op_threads()``: intra-op thread i on the i-th allowed CPU for the block (what
  OpenMP's ``OMP_PROC_BIND`` does, and what vLLM does for its own worker), every affinity restored
  afterwards, so nothing created later inherits a pin. The thread ids come from running a parallel
  region of torch's own libgomp (``GOMP_parallel`` through ctypes, the pool torch uses from this
  thread). With more threads than CPUs, on CUDA, or with no libgomp in the process, it pins nothing
  and says why. Pinning matters under load: an unpinned thread that shares a core with another job
  holds up every barrier of the step. ``trainer_threads()`` is both, what the train stage uses.
- ``preserved_thread_state(reason)``: around an engine start, restores what vLLM changed in this
  process (the thread-related environment, ``torch.set_num_threads`` and the thread count) and logs
  each restored item at INFO with its old and new value.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger("qerl.threads")

# Environment variables that steer OpenMP/BLAS threads or what a child process preloads: what vLLM's
# CPU platform sets for its own processes and must not hand to the trainer's later children.
# (TORCHINDUCTOR_* are left as vLLM sets them: its own compile settings, unused by eager training.)
THREAD_ENV = re.compile(r"^(LD_PRELOAD|OMP_.*|GOMP_.*|KMP_.*|MKL_.*|NUMEXPR_.*)$")

_pin_lock = threading.Lock()


@dataclass
class ThreadState:
    """The thread-related state of this process (what an engine start must leave as it found it)."""

    affinity: list[int]
    task_affinity: dict[int, list[int]]  # thread id -> CPUs, for the threads alive at the snapshot
    torch_threads: int
    set_num_threads: Any
    env: dict[str, str] = field(default_factory=dict)


def _task_affinity() -> dict[int, list[int]]:
    out = {}
    for name in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            out[int(name)] = sorted(os.sched_getaffinity(int(name)))
    return out


def snapshot() -> ThreadState:
    return ThreadState(
        affinity=sorted(os.sched_getaffinity(0)),
        task_affinity=_task_affinity(),
        torch_threads=torch.get_num_threads(),
        set_num_threads=torch.set_num_threads,
        env={k: v for k, v in os.environ.items() if THREAD_ENV.match(k)},
    )


def restore(before: ThreadState, reason: str) -> list[str]:
    """Put back what changed since ``before``; returns (and logs) one line per restored item."""
    changes = []
    if torch.set_num_threads is not before.set_num_threads:
        changes.append(f"torch.set_num_threads was replaced by {torch.set_num_threads!r}: original restored")
        torch.set_num_threads = before.set_num_threads
    now = {k: v for k, v in os.environ.items() if THREAD_ENV.match(k)}
    for key in sorted(set(now) | set(before.env)):
        if now.get(key) != before.env.get(key):
            changes.append(f"env {key}={now.get(key)!r} -> {before.env.get(key)!r}")
            if key in before.env:
                os.environ[key] = before.env[key]
            else:
                del os.environ[key]
    if torch.get_num_threads() != before.torch_threads:
        changes.append(f"torch intra-op threads {torch.get_num_threads()} -> {before.torch_threads}")
        torch.set_num_threads(before.torch_threads)
    for tid, cpus in before.task_affinity.items():
        with contextlib.suppress(OSError):  # a thread that has ended since
            if sorted(os.sched_getaffinity(tid)) != cpus:
                changes.append(f"thread {tid} affinity {sorted(os.sched_getaffinity(tid))} -> {cpus}")
                os.sched_setaffinity(tid, cpus)
    for line in changes:
        log.info("after %s: %s", reason, line)
    if not changes:
        log.info("after %s: this process's thread settings are as before", reason)
    return changes


@contextlib.contextmanager
def preserved_thread_state(reason: str) -> Iterator[ThreadState]:
    """Run the block (an engine start), then restore this process's thread settings (``restore``)."""
    before = snapshot()
    try:
        yield before
    finally:
        restore(before, reason)


# -- one core per intra-op thread ------------------------------------------------------------------


def _torch_libgomp() -> ctypes.CDLL | None:
    """torch's OpenMP runtime as loaded in this process (its pool is the one torch's ops use)."""
    with open("/proc/self/maps") as fh:
        paths = {line.split()[-1] for line in fh if "/libgomp" in line and "/torch/" in line}
    if len(paths) != 1:
        return None
    return ctypes.CDLL(paths.pop())


_PARALLEL_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


def intra_op_thread_ids(n: int) -> dict[int, int] | None:
    """{OpenMP thread number: Linux thread id} of this thread's ``n``-thread torch pool, or None."""
    gomp = _torch_libgomp()
    if gomp is None:
        return None
    gomp.omp_get_thread_num.restype = ctypes.c_int
    found: dict[int, int] = {}
    lock = threading.Lock()

    def body(_data: int | None) -> None:
        with lock:
            found[gomp.omp_get_thread_num()] = threading.get_native_id()

    callback = _PARALLEL_FN(body)
    # GOMP_parallel(fn, data, num_threads, flags): the entry point of `#pragma omp parallel`
    gomp.GOMP_parallel(callback, None, ctypes.c_uint(n), ctypes.c_uint(0))
    return found if sorted(found) == list(range(n)) else None


@contextlib.contextmanager
def pinned_intra_op_threads(device: str = "cpu") -> Iterator[dict[int, int]]:
    """Intra-op thread i on the i-th allowed CPU for the block; every affinity restored after it.

    Yields {thread id: CPU} of what was pinned (empty when nothing was, with the reason logged).
    """
    n = torch.get_num_threads()
    allowed = sorted(os.sched_getaffinity(0))
    why = None
    if not device.startswith("cpu"):
        why = f"device {device}: the GPU does the math"
    elif n < 2:
        why = "one intra-op thread"
    elif n > len(allowed):
        why = f"{n} intra-op threads for {len(allowed)} allowed CPUs"
    ids = None if why else intra_op_thread_ids(n)
    if why is None and ids is None:
        why = "torch's libgomp pool not found in this process"
    if why is not None:
        log.debug("intra-op threads not pinned: %s", why)
        yield {}
        return
    with _pin_lock:
        before = {tid: sorted(os.sched_getaffinity(tid)) for tid in ids.values()}
        pins = {tid: allowed[k] for k, tid in ids.items()}
        for tid, cpu in pins.items():
            os.sched_setaffinity(tid, [cpu])
        log.debug("intra-op threads pinned one per CPU: %s", pins)
        try:
            yield pins
        finally:
            for tid, cpus in before.items():
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(tid, cpus)


def _torch_mkl() -> ctypes.CDLL | None:
    """The MKL linked into torch's CPU library, or None (a build without MKL).

    ``MKL_Set_Dynamic`` is the C entry (an int by value); ``mkl_set_dynamic`` is the Fortran one (by
    reference) and crashes when called with a value.
    """
    with open("/proc/self/maps") as fh:
        paths = {line.split()[-1] for line in fh if line.rstrip().endswith("/libtorch_cpu.so")}
    if len(paths) != 1:
        return None
    lib = ctypes.CDLL(paths.pop())
    return (
        lib
        if all(
            hasattr(lib, f) for f in ("MKL_Set_Dynamic", "mkl_serv_get_dynamic", "MKL_Set_Num_Threads_Local")
        )
        else None
    )


@contextlib.contextmanager
def fresh_process_threading() -> Iterator[dict[str, int]]:
    """For the block: torch's OpenMP and MKL threading as a process that never set a thread count.

    No nested OpenMP teams (max-active-levels 1), MKL's dynamic threads on, and no thread-local MKL
    thread count (0: follow the global one). Yields the old values (``max_active_levels``,
    ``mkl_dynamic``, ``mkl_local_threads``; the MKL ones only where torch links MKL); all are
    restored after the block.
    """
    gomp, mkl = _torch_libgomp(), _torch_mkl()
    old: dict[str, int] = {}
    if gomp is not None:
        old["max_active_levels"] = int(gomp.omp_get_max_active_levels())
        gomp.omp_set_max_active_levels(ctypes.c_int(1))
    if mkl is not None:
        old["mkl_dynamic"] = int(mkl.mkl_serv_get_dynamic())
        mkl.MKL_Set_Dynamic(ctypes.c_int(1))
        old["mkl_local_threads"] = int(mkl.MKL_Set_Num_Threads_Local(ctypes.c_int(0)))  # returns the old
    if not old:
        log.debug("OpenMP nesting and MKL threads left as they are: neither library found in torch")
    try:
        yield old
    finally:
        if "max_active_levels" in old:
            gomp.omp_set_max_active_levels(ctypes.c_int(old["max_active_levels"]))
        if "mkl_dynamic" in old:
            mkl.MKL_Set_Dynamic(ctypes.c_int(old["mkl_dynamic"]))
            mkl.MKL_Set_Num_Threads_Local(ctypes.c_int(old["mkl_local_threads"]))


@contextlib.contextmanager
def trainer_threads(device: str = "cpu") -> Iterator[dict[int, int]]:
    """A train step's threads: no nested OpenMP teams, and (on CPU) one core per intra-op thread.

    Yields the pins of ``pinned_intra_op_threads``.
    """
    with fresh_process_threading(), pinned_intra_op_threads(device) as pins:
        yield pins
