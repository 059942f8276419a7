"""A run attempt's deadline (``loop.deadline_h``): past it, the attempt is stopped, not waited for.

Why: the nightly deployment runs one night at a time (concurrency 1), so a night that hangs (an
engine that stops answering without dying, a collective that never returns) holds back every
night after it, silently, for as long as nobody looks. Retries cannot help: a hang raises nothing.
With ``loop.deadline_h: H`` an attempt still running H hours after it started is stopped: the run
record says ``failed`` with the reason (so ``qerl runs`` shows it, and the data cursor stays where
it was: the next night takes the slice again), its MLflow run and its Prefect flow run are ended
FAILED with the reason (10 s at most each: a fleet's janitor starts a CRASHED night again, a FAILED
one it leaves to the operator), its slot of a fleet's GPU limit is released (10 s at most), the
attempt's child processes (the engine's, the reward workers) are killed so that the GPU and memory
they hold come free, and the process exits with status 124 (``timeout``'s). Under ``qerl schedule``
each night is its own process (Prefect's runner starts one per flow run), so only that night ends
and the schedule goes on. Under ``qerl ablate`` without Ray the arms share one process, and the
whole ablation stops. ``qerl resume RUN`` continues the run from its last finished stage, with a
fresh deadline (``--set loop.deadline_h=H`` gives it another).

How: a daemon timer thread armed when the attempt holds its lock and cancelled when the attempt
ends. It does not raise into the flow: a thread blocked in a C call or a socket cannot be
interrupted from Python, which is the very case this is for. ``loop.deadline_h`` is a resource
setting: out of the run id and every cache key. Unset (the default), nothing is armed.
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("qerl.flow")

EXIT_STATUS = 124
MLFLOW_END_S = 10.0
PREFECT_END_S = 10.0
SLOT_RELEASE_S = 10.0


def _kill_children() -> int:
    """SIGKILL every descendant of this process, without waiting for them (they die on their own,
    and this process exits next); returns how many were signalled."""
    import psutil

    children = psutil.Process().children(recursive=True)
    for child in children:
        try:
            child.kill()
        except psutil.Error:
            pass
    return len(children)


def _stop(run: Any, hours: float, started: _dt.datetime) -> None:
    """The deadline passed: record it, end the MLflow run, kill the children, exit (module
    docstring). ``run.stopped`` parks the flow's thread at its next record save, registration or
    cursor move (``Run.park_if_stopped``), so the record keeps the reason and nothing is registered
    after the deadline; the children die last, right before the exit."""
    from qerl.flows import gpu_slot
    from qerl.pipeline.registry import live
    from qerl.pipeline.store.run_record import save_record

    run.stopped = True
    error = (
        f"DeadlineExceeded: the attempt passed loop.deadline_h = {hours:g} h (started "
        f"{started.isoformat(timespec='seconds')}) and was stopped with its processes; resume it "
        f"with qerl resume {run.run_id} (--set loop.deadline_h=H for longer)"
    )
    log.error("run %s: %s", run.run_id, error)  # on the console, and in run.log
    for _ in range(3):  # the flow's thread may be adding to the record as it is copied
        try:
            save_record(
                run.work, run.record.model_copy(update={"status": "failed", "error": error}, deep=True)
            )
            break
        except RuntimeError:
            continue
        except Exception as err:  # noqa: BLE001  (the exit below must happen whatever this does)
            log.error("run %s: the record could not be saved (%s)", run.run_id, err)
            break
    if run.live is not None:
        ender = threading.Thread(target=live.end_run, args=(run.live, True), daemon=True)
        ender.start()
        ender.join(MLFLOW_END_S)  # a registry that hangs too must not keep the attempt alive
    failer = threading.Thread(target=_fail_flow_run, args=(run.record.flow_run_id, error), daemon=True)
    failer.start()
    failer.join(PREFECT_END_S)
    released = gpu_slot.release_held(SLOT_RELEASE_S)  # the fleet's slot: os._exit runs no finally
    killed = _kill_children()
    log.error(
        "run %s: stopped (%d child processes killed%s), exit status %d",
        run.run_id, killed, f", {released} GPU slot(s) released" if released else "", EXIT_STATUS,
    )  # fmt: skip
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    # no logging.shutdown: it takes every handler's lock, which the flow's thread may hold for good
    os._exit(EXIT_STATUS)


def _fail_flow_run(flow_run_id: str | None, error: str) -> None:
    """The attempt's flow run set FAILED with the reason: Prefect shows why, and a fleet's janitor
    leaves the night to its operator (a CRASHED one it would start again, deadline and all)."""
    if not flow_run_id:
        return
    from prefect import get_client
    from prefect.states import Failed

    try:
        with get_client(sync_client=True) as client:
            client.set_flow_run_state(flow_run_id, Failed(message=error))
    except Exception as err:  # noqa: BLE001  (the worker reports the exit as a crash instead)
        log.error("the flow run %s was not set FAILED (%s)", flow_run_id, err)


def arm(run: Any, hours: float | None) -> Callable[[], None]:
    """Start the attempt's deadline (none when ``hours`` is None); returns the function that
    cancels it, called when the attempt ends."""
    if hours is None:
        return lambda: None
    started = _dt.datetime.now(_dt.UTC)
    timer = threading.Timer(hours * 3600.0, _stop, args=(run, hours, started))
    timer.daemon = True
    timer.name = f"qerl-deadline-{run.run_id}"
    timer.start()
    run.logger.info(
        "run %s: deadline %g h (loop.deadline_h), until %s",
        run.run_id,
        hours,
        (started + _dt.timedelta(hours=hours)).isoformat(timespec="seconds"),
    )
    return timer.cancel
