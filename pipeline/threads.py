"""The trainer's CPU threads next to a rollout engine: one core per intra-op thread, and nothing of vLLM's
thread settings left behind in the trainer's process.

What was found (issue 12; 2-vCPU Firecracker VM, torch's libgomp, vLLM 0.32 on CPU):

- The slow train steps are the two intra-op OpenMP threads running on the *same* vCPU. Sampling
  ``/proc/self/task/*/stat`` (state, last CPU) during a 2-thread step: a 16.7 s step had both threads
  runnable on one CPU in 3046 of 3391 samples, a 1.1 s step never. libgomp's threads spin-wait at
  every barrier, so two of them sharing a core take turns spinning for the other: 10-50x, and one
  thread (0.7 s) is faster than two. Nothing pins them apart, so the scheduler co-locates them
  whenever another runnable thread makes a core look busy. A live vLLM engine supplies such threads
  for the whole run: its multiprocess worker is pinned to core 0 (``VLLM_CPU_OMP_THREADS_BIND=auto``
  binds it there and reserves core 1), with 13 gloo ``tcp_loop`` threads that wake ~100 times a
  second each; in-process, the same 26 gloo threads live in the trainer's own process and stay
  after ``close()``. Other load on the machine does the same (a process that never imported vLLM
  showed the identical 19-48 s vs 4.5-5.9 s at 2 vs 1 threads while other jobs ran).
- What vLLM's start leaves in the caller's process, compared before/after (``snapshot``):
  process and per-thread affinity, ``torch.get_num_threads()`` and the OpenMP runtimes loaded are
  unchanged; it writes environment variables that every later child process inherits (``LD_PRELOAD``
  with torch's libgomp, ``NUMEXPR_MAX_THREADS``, ``TORCHINDUCTOR_*``) and, in-process, replaces
  ``torch.set_num_threads`` with a function that ignores every later call (``CPUWorker.init_device``),
  so the trainer (or the demo's one-thread SFT) could no longer choose its thread count.

What this module does:

- ``pinned_intra_op_threads()``: for the duration of a train step, intra-op thread i runs on the
  i-th allowed CPU (what OpenMP's ``OMP_PROC_BIND`` does, and what vLLM does for its own worker), and
  every thread's affinity is restored afterwards, so nothing created later inherits a pin. The
  thread ids come from running a parallel region of torch's own libgomp (``GOMP_parallel`` through
  ctypes, the pool torch uses from this thread). With more threads than CPUs, on CUDA, or with no
  libgomp in the process, it pins nothing and says why.
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
