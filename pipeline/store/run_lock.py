"""One attempt at a time per run: an ``flock`` on ``<work>/runs/<run_id>/run.lock``.

Why: two attempts at the same run (``qerl resume`` beside the scheduled night still running, or a
second ``qerl run`` of the same config) would both rewrite the run record, log into one MLflow run
and race to advance the data cursor. The store would stay consistent (each build is atomic under its
key's lock); the record and the run's outcome would not. So the RL flow holds an exclusive lock on
the run's lock file for the whole attempt (``hold``), and a second attempt is refused at once with a
``RunLockedError`` naming the holder. ``qerl run`` and ``qerl resume`` ask first (``holder``), before
their console opens the run's log.

The kernel drops an ``flock`` when its process dies, however it dies (SIGKILL, the OOM killer), so
the lock never goes stale and nothing has to clean it up. The file stays; the holder writes its pid,
host and start time into it, for the refusal's message and for ``qerl runs``, which tells a running
attempt from one that died (status ``running`` in its record, lock free).

Limits: ``flock`` is per machine on most network filesystems. Without a coordination database
(``QERL_FLEET_DB`` unset), an attempt on another machine sharing the work dir is not seen; ``holder``
cannot tell it from a dead one, and its recorded host says so (``other_host``). That is why retention
(``store.live_window_h``) still treats a recently updated ``running`` record as live whatever the
lock says; the lock only adds the attempts it can see.

On a fleet (``QERL_FLEET_DB`` set) the attempt also holds the lease ``qerl-run:<run_id>``, a
PostgreSQL advisory lock (``qerl.pipeline.fleet.coordination.hold_lease``), after the local ``flock``:
every machine sees it, whatever work dir each uses, and the server drops it when the holder's process
or machine dies. A second attempt anywhere is refused with the holder's pid, host and start time, and
``holder`` reports the lease's holder when no local process holds the file lock. A run whose lease is
lost (``ensure_leases``) stops before it publishes anything more.
"""

from __future__ import annotations

import datetime as _dt
import fcntl
import json
import os
import socket
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from qerl.pipeline.fleet import settings

RUN_LOCK = "run.lock"


class RunLockedError(RuntimeError):
    """Another attempt at this run is running: its pid, host and start time are in the message."""


def _read(path: Path) -> dict[str, Any]:
    try:
        info = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def describe(info: dict[str, Any]) -> str:
    """``pid 123 on host, since 2026-11-27T07:00:00+00:00`` (what is known of it)."""
    since = f", since {info['started_at']}" if info.get("started_at") else ""
    return f"pid {info.get('pid', '?')} on {info.get('host', '?')}{since}"


def busy(run_id: str, info: dict[str, Any]) -> RunLockedError:
    """The refusal of a second attempt at ``run_id``, naming the attempt that holds it."""
    return RunLockedError(
        f"run {run_id} is already running ({describe(info)}): wait for it to end, or stop that "
        "process first; a second attempt would rewrite its record"
    )


def holder(run_dir: Path) -> dict[str, Any] | None:
    """The live attempt holding ``run_dir``'s lock (its pid, host, start time), or None when no
    process holds it: on this machine, and on a fleet on any machine (the lease ``qerl-run:<run id>``,
    the run id being ``run_dir``'s name)."""
    path = run_dir / RUN_LOCK
    if path.is_file():
        with open(path, "rb") as fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return _read(path)
            fcntl.flock(fh, fcntl.LOCK_UN)
    if settings.database_url() is None:
        return None
    from qerl.pipeline.fleet import coordination

    return coordination.lease_holder(f"qerl-run:{run_dir.name}")


def other_host(run_dir: Path) -> str | None:
    """The host of the last attempt recorded in the lock file when it is not this machine (its
    lock cannot be seen from here), else None."""
    host = _read(run_dir / RUN_LOCK).get("host")
    return host if host and host != socket.gethostname() else None


@contextmanager
def hold(run_dir: Path, run_id: str) -> Iterator[None]:
    """Hold the run's lock for the block (on a fleet, its lease too); a ``RunLockedError`` when
    another attempt holds it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / RUN_LOCK
    with open(path, "a+") as fh, ExitStack() as lease:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise busy(run_id, _read(path)) from None
        try:
            if settings.database_url() is not None:
                from qerl.pipeline.fleet import coordination

                try:
                    lease.enter_context(coordination.hold_lease(f"qerl-run:{run_id}"))
                except coordination.LeaseHeldError as err:
                    raise busy(run_id, err.holder) from None
            now = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
            fh.seek(0)
            fh.truncate()
            fh.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started_at": now}))
            fh.flush()
            yield
        finally:
            lease.close()  # the lease goes before the file lock
            fcntl.flock(fh, fcntl.LOCK_UN)
