"""PostgreSQL coordination for a fleet: advisory locks, run leases and the data cursor, seen by every machine.

What: the fleet's one coordinator is the PostgreSQL database named by ``QERL_FLEET_DB``. A lock is a
session-level advisory lock on a key derived from its name (``lock_key``: the first 8 bytes of the
name's sha256, signed), held by its own connection: ``advisory_lock`` waits for it (``lock_timeout``
bounds the wait), ``try_advisory_lock`` asks once, ``lock_is_held`` reads ``pg_locks`` (a bigint
key shows there as ``classid`` = its high 32 bits and ``objid`` = its low 32 bits, ``objsubid`` 1).
``build_lock`` is the store's build exclusion on a fleet and a no-op on one machine.

Why advisory locks: ``flock`` on a network filesystem silently succeeds for everyone on many of them,
and a session lock dies with its session, so a crashed holder never wedges anyone: the server drops
the lock when the client's connection closes (a SIGKILLed process) or when its TCP keepalives fail (a
dead machine). Every connection sets low keepalives and a TCP user timeout so the client side notices
a dead network in seconds too; the server should set ``tcp_keepalives_*`` low as well.

A lease (``hold_lease``) is an advisory lock that a run holds for a whole attempt. The holder writes
who it is (pid, host, start time, backend pid) into ``qerl_leases`` so a refused attempt can name it
(``LeaseHeldError``); the row counts only while its backend pid still holds the lock, else the holder
is described from ``pg_stat_activity``. A watchdog thread runs ``SELECT 1`` on the lease's connection
every ``check_every_s``: an error (connection lost, server restarted, backend terminated) means the
lock went with the session, so the watchdog takes it again on a new session within ``REGAIN_S``
(a database restart, which a night rides out); when it cannot, or another session holds it by then,
the lease is *lost*. A lease whose last good check
is older than ``2 * check_every_s + 5`` s counts as lost as well (a query stuck on a dead network);
``Lease.check`` first asks the watchdog for a fresh check, so a watchdog that was only starved of
the GIL does not stop a run. ``ensure_leases()`` checks every lease this process holds and raises
``LeaseLostError``: code calls it before it publishes anything, so a machine cut off from the
database stops publishing once another may have taken over (in a forked child, which has no
watchdog, it asks the server whether the lease's session still holds the lock). It is a check at one
moment: the server keeps the lock of a silent client for its keepalive time (about 11 s with
``tcp_keepalives_idle=5``, ``interval=2``, ``count=3``), a little longer than a default lease takes
to count as lost.

The data cursor (``cursor_position``, ``cursor_advance``) is a row of ``qerl_cursors`` per nightly
line and stream, moved by one ``INSERT ... ON CONFLICT DO UPDATE`` with ``GREATEST``: it never moves
back, and a night completed again is a no-op (its run id is appended only when the cursor moved; the
last 50 are kept), as in the file cursor of ``qerl.pipeline.planning.prompt_stream``.

Tables are created on first use (``ensure_schema``: under the advisory lock ``qerl-schema``, once
per URL in this process, again if a table was dropped behind its back).

Departures: every connection also sets ``tcp_user_timeout`` (10 s), which the keepalives alone do not
give while a query waits for an answer. Messages show URLs with the password as ``***``, and a
password in a driver's message is replaced too; the driver's error is not chained (its traceback).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import logging
import os
import re
import socket
import threading
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
from psycopg.types.json import Jsonb
from qerl.pipeline.fleet import settings

log = logging.getLogger("qerl.fleet")

CONNECT_OPTIONS: dict[str, Any] = {
    "connect_timeout": 5,
    "application_name": "qerl",
    "keepalives": 1,
    "keepalives_idle": 5,
    "keepalives_interval": 2,
    "keepalives_count": 3,
    "tcp_user_timeout": 10_000,  # ms: a query unanswered this long on a dead network fails
}
SCHEMA_LOCK = "qerl-schema"
CONNECT_RETRY_S = 30.0  # a restarting server refuses connections for a few seconds
# how long a lease whose connection broke tries to take its lock again (QERL_LEASE_REGAIN_S)
REGAIN_S = float(os.environ.get("QERL_LEASE_REGAIN_S") or 30.0)
CURSOR_RUNS_KEPT = 50
SCHEMA = (
    "CREATE TABLE IF NOT EXISTS qerl_leases (name text PRIMARY KEY, holder jsonb, since timestamptz)",
    "CREATE TABLE IF NOT EXISTS qerl_cursors (line text, stream text, next_slot bigint NOT NULL, "
    "runs jsonb NOT NULL DEFAULT '[]', updated_at timestamptz, PRIMARY KEY (line, stream))",
)
_HOLDING = """
SELECT l.pid, a.application_name, host(a.client_addr), a.backend_start
FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND l.classid::bigint = %s AND l.objid::bigint = %s
"""
_ADVANCE = f"""
INSERT INTO qerl_cursors AS c (line, stream, next_slot, runs, updated_at)
VALUES (%(line)s, %(stream)s, GREATEST(%(end)s::bigint, 0),
        CASE WHEN %(end)s::bigint > 0 THEN jsonb_build_array(%(run)s::text) ELSE '[]'::jsonb END,
        CASE WHEN %(end)s::bigint > 0 THEN now() END)
ON CONFLICT (line, stream) DO UPDATE SET
  next_slot = GREATEST(c.next_slot, EXCLUDED.next_slot),
  runs = CASE WHEN EXCLUDED.next_slot > c.next_slot THEN (
      SELECT jsonb_agg(r.e ORDER BY r.i) FROM jsonb_array_elements(c.runs || EXCLUDED.runs)
        WITH ORDINALITY AS r(e, i)
      WHERE r.i > jsonb_array_length(c.runs || EXCLUDED.runs) - {CURSOR_RUNS_KEPT})
    ELSE c.runs END,
  updated_at = CASE WHEN EXCLUDED.next_slot > c.next_slot THEN now() ELSE c.updated_at END
RETURNING next_slot
"""
_DELETE_OWN_ROW = "DELETE FROM qerl_leases WHERE name = %s AND holder->>'token' = %s"

_SCHEMA_READY: set[str] = set()
_ACTIVE: set[Lease] = set()
_ACTIVE_LOCK = threading.Lock()


class CoordinationError(RuntimeError):
    """The coordination database cannot do what was asked; the message names the lock, lease or URL."""


class LeaseLostError(CoordinationError):
    """A lease this process held is gone (its connection broke): stop before publishing anything more."""


class LeaseHeldError(CoordinationError):
    """Another session holds the lease; ``holder`` is what is known of it (pid, host, since...)."""

    def __init__(self, name: str, holder: dict[str, Any] | None = None):
        self.name, self.holder = name, dict(holder or {})
        super().__init__(f"lease {name} is held by {describe_holder(self.holder)}")

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.name, self.holder)


def describe_holder(info: dict[str, Any]) -> str:
    """``pid 12 on host-a, since ... (backend 345 from 10.0.0.2)``: what is known of a holder."""
    if not info:
        return "a session that has released it since"
    backend = f"backend {info.get('backend_pid', '?')} from {info.get('client_addr') or 'a local socket'}"
    if "pid" not in info:  # a holder that published nothing (yet): what the server knows of it
        return f"{backend}, application {info.get('application_name')!r}, since {info.get('backend_start')}"
    return f"pid {info['pid']} on {info.get('host', '?')}, since {info.get('started_at', '?')} ({backend})"


def lock_key(name: str) -> int:
    """The advisory-lock key of ``name``: the first 8 bytes of its sha256, a signed 64-bit integer."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big", signed=True)


def _halves(key: int) -> tuple[int, int]:
    """``pg_locks``' (classid, objid) of a bigint advisory key: its high and low 32 bits, unsigned."""
    unsigned = key & 0xFFFF_FFFF_FFFF_FFFF
    return unsigned >> 32, unsigned & 0xFFFF_FFFF


def _url(url: str | None) -> str:
    url = url or settings.database_url()
    if not url:
        raise CoordinationError(f"no coordination database: {settings.FLEET_DB_ENV} is not set")
    return url


def _scrub(text: str, url: str) -> str:
    """``text`` without the password of ``url`` (or of PGPASSWORD), URLs in it redacted."""
    match = re.search(r"://[^:/@]+:([^@/]*)@", url)
    secrets = {match.group(1), urllib.parse.unquote(match.group(1))} if match else set()
    secrets.add(os.environ.get("PGPASSWORD", ""))
    for secret in sorted(filter(None, secrets), key=len, reverse=True):
        text = text.replace(secret, "***")
    return re.sub(r"postgres\S*://\S+", lambda m: settings.redact(m.group(0)), text)


def _failure(what: str, err: BaseException, url: str) -> CoordinationError:
    return CoordinationError(f"{what} on {settings.redact(url)}: {_scrub(str(err).strip(), url)}")


def connect(url: str | None = None, retry_s: float | None = None) -> psycopg.Connection:
    """An autocommit connection to ``url`` (else ``QERL_FLEET_DB``) with low TCP keepalives; a server
    that refuses connections is asked again for ``retry_s`` (default ``CONNECT_RETRY_S``: a restart)."""
    url = _url(url)
    libpq_url = re.sub(r"^postgres(ql)?\+\w+://", "postgresql://", url)  # SQLAlchemy's driver suffix
    deadline = time.monotonic() + (CONNECT_RETRY_S if retry_s is None else retry_s)
    while True:
        try:
            return psycopg.connect(libpq_url, autocommit=True, **CONNECT_OPTIONS)
        except psycopg.OperationalError as err:
            if time.monotonic() >= deadline or "password authentication" in str(err):
                raise _failure("cannot connect to the coordination database", err, url) from None
            time.sleep(0.5)
        except psycopg.Error as err:
            raise _failure("cannot connect to the coordination database", err, url) from None


def _run(conn: psycopg.Connection, url: str, what: str, sql: str, params: Any = None) -> Any:
    """The first row of ``sql`` (None when none); a missing table is created once and retried."""
    for attempt in (1, 2):
        try:
            cur = conn.execute(sql, params)
            return cur.fetchone() if cur.description else None
        except psycopg.errors.UndefinedTable as err:
            if attempt == 2:
                raise _failure(what, err, url) from None
            _SCHEMA_READY.discard(url)
            ensure_schema(url)
        except psycopg.Error as err:
            raise _failure(what, err, url) from None


def ensure_schema(url: str | None = None) -> None:
    """Create the coordination tables if they do not exist (once per URL in this process)."""
    url = _url(url)
    if url in _SCHEMA_READY:
        return
    with contextlib.closing(connect(url)) as conn:
        _run(conn, url, "creating the schema", "SET lock_timeout = 60000")
        _run(conn, url, "locking the schema", "SELECT pg_advisory_lock(%s)", (lock_key(SCHEMA_LOCK),))
        for statement in SCHEMA:
            _run(conn, url, "creating the schema", statement)
    _SCHEMA_READY.add(url)  # closing the connection released the lock


@contextlib.contextmanager
def advisory_lock(name: str, timeout_s: float | None = None, url: str | None = None) -> Iterator[None]:
    """Hold the advisory lock ``name`` for the block, waiting up to ``timeout_s`` (None: for ever)."""
    url, key = _url(url), lock_key(name)
    with contextlib.closing(connect(url)) as conn:
        if timeout_s is not None:
            _run(conn, url, f"advisory lock {name}", f"SET lock_timeout = {max(1, int(timeout_s * 1000))}")
        try:
            conn.execute("SELECT pg_advisory_lock(%s)", (key,))
        except psycopg.errors.LockNotAvailable:
            raise CoordinationError(
                f"timed out after {timeout_s}s waiting for the advisory lock {name} on {settings.redact(url)}"
            ) from None
        except psycopg.Error as err:
            raise _failure(f"waiting for the advisory lock {name}", err, url) from None
        try:
            yield
        except BaseException:
            with contextlib.suppress(psycopg.Error):
                conn.execute("SELECT pg_advisory_unlock(%s)", (key,))
            raise
        try:
            released = conn.execute("SELECT pg_advisory_unlock(%s)", (key,)).fetchone()[0]
        except psycopg.Error as err:  # the session ended (a server restart): the lock went with it
            released = False
            log.warning("advisory lock %s: %s", name, _scrub(str(err).strip(), url))
        if not released:
            log.warning("the advisory lock %s was lost while held (its session ended)", name)


@contextlib.contextmanager
def try_advisory_lock(name: str, url: str | None = None) -> Iterator[bool]:
    """Take the advisory lock ``name`` if it is free; yields whether it was taken (held for the block)."""
    url, key = _url(url), lock_key(name)
    with contextlib.closing(connect(url)) as conn:
        got = bool(_run(conn, url, f"advisory lock {name}", "SELECT pg_try_advisory_lock(%s)", (key,))[0])
        try:
            yield got
        finally:
            if got:
                with contextlib.suppress(psycopg.Error):
                    conn.execute("SELECT pg_advisory_unlock(%s)", (key,))


def _holding(conn: psycopg.Connection, url: str, name: str) -> Any:
    return _run(conn, url, f"looking up the holder of {name}", _HOLDING, _halves(lock_key(name)))


def lock_is_held(name: str, url: str | None = None) -> bool:
    """Whether any session of the database holds the advisory lock ``name``."""
    url = _url(url)
    with contextlib.closing(connect(url)) as conn:
        return _holding(conn, url, name) is not None


def _holder_info(conn: psycopg.Connection, url: str, name: str) -> dict[str, Any] | None:
    row = _holding(conn, url, name)
    if row is None:
        return None
    pid, app, addr, backend_start = row
    info = {"backend_pid": pid, "application_name": app, "client_addr": addr}
    info["backend_start"] = backend_start.isoformat(timespec="seconds") if backend_start else None
    try:
        published = conn.execute("SELECT holder FROM qerl_leases WHERE name = %s", (name,)).fetchone()
    except psycopg.errors.UndefinedTable:
        published = None
    except psycopg.Error as err:
        raise _failure(f"looking up the holder of {name}", err, url) from None
    if published and isinstance(published[0], dict) and published[0].get("backend_pid") == pid:
        info.update({k: v for k, v in published[0].items() if k != "token"})  # the live holder's own row
    return info


def lease_holder(name: str, url: str | None = None) -> dict[str, Any] | None:
    """What is known of the session holding lease ``name`` (its published pid, host, start time, else
    its backend's client address and start), or None when no session holds it."""
    url = _url(url)
    with contextlib.closing(connect(url)) as conn:
        return _holder_info(conn, url, name)


class Lease:
    """A held lease: ``lost`` turns True when its connection breaks; ``check`` raises then."""

    def __init__(
        self, name: str, conn: psycopg.Connection, url: str, holder: dict[str, Any], check_every_s: float
    ):
        self.name, self.holder, self.check_every_s = name, holder, check_every_s
        self.backend_pid: int = holder["backend_pid"]
        self.stale_after_s = 2 * check_every_s + 5
        self.error: BaseException | None = None
        self._conn, self._url, self._pid = conn, url, os.getpid()
        self._cond = threading.Condition()
        self._ok_at, self._poked, self._stopping, self._tidied = time.monotonic(), False, False, False
        self._regaining = False
        self._thread = threading.Thread(target=self._watch, name=f"qerl-lease-{name}", daemon=True)
        self._thread.start()

    @property
    def lost(self) -> bool:
        return self.error is not None or time.monotonic() - self._ok_at > self.stale_after_s

    def check(self) -> None:
        """Raise ``LeaseLostError`` naming the lease when it is lost."""
        if os.getpid() != self._pid:  # a forked child: the watchdog runs in the parent, so ask the server
            if (lease_holder(self.name, self._url) or {}).get("backend_pid") != self.backend_pid:
                raise self._lost("its session no longer holds it")
            return
        if self.error is None and (self.lost or self._regaining):  # ask the watchdog once more
            with self._cond:
                self._poked = True
                self._cond.notify_all()
                self._cond.wait_for(
                    lambda: not self._regaining and (not self.lost or self.error is not None),
                    REGAIN_S + self.check_every_s + 5,
                )
        if self.lost:
            raise self._lost(self.error or f"no answer from the database for over {self.stale_after_s:g}s")

    def _lost(self, reason: object) -> LeaseLostError:
        return LeaseLostError(
            f"lost the lease {self.name} ({_scrub(str(reason).strip(), self._url)}): another machine "
            "may hold it now, so this process must not publish anything more"
        )

    def _watch(self) -> None:
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._stopping or self._poked, self.check_every_s)
                    if self._stopping:
                        break
                    self._poked = False
                started = time.monotonic()
                try:
                    self._conn.execute("SELECT 1")
                except Exception as err:  # whatever broke, the lock went with the session
                    if not self._regain(err):
                        log.error("lease %s lost: %s", self.name, _scrub(str(err).strip(), self._url))
                        with self._cond:
                            self.error = err
                            self._cond.notify_all()
                        return
                with self._cond:
                    self._ok_at = started
                    self._cond.notify_all()
            with contextlib.suppress(psycopg.Error):
                self._conn.execute(_DELETE_OWN_ROW, (self.name, self.holder["token"]))
                self._conn.execute("SELECT pg_advisory_unlock(%s)", (lock_key(self.name),))
                self._tidied = True
        finally:
            self._conn.close()

    def _regain(self, err: BaseException) -> bool:
        """Take the lock again on a new session after the old one ended (a database restart),
        within ``REGAIN_S``: True when this process holds it again. While it tries, ``check``
        waits. Safe because nothing takes a night over sooner: the janitor's grace is longer, and
        a lock another session took meanwhile is not taken back (the lease is lost then)."""
        log.warning(
            "lease %s: its session ended (%s): taking the lock again", self.name, _scrub(str(err), self._url)
        )
        with self._cond:
            self._regaining = True
        try:
            with contextlib.suppress(Exception):
                self._conn.close()
            try:
                conn = connect(self._url, retry_s=REGAIN_S)
            except CoordinationError:
                return False
            key = lock_key(self.name)
            try:
                if not conn.execute("SELECT pg_try_advisory_lock(%s)", (key,)).fetchone()[0]:
                    conn.close()
                    return False
                self.backend_pid = self.holder["backend_pid"] = conn.info.backend_pid
                conn.execute(
                    "INSERT INTO qerl_leases (name, holder, since) VALUES (%s, %s, now()) ON CONFLICT (name) "
                    "DO UPDATE SET holder = EXCLUDED.holder, since = EXCLUDED.since",
                    (self.name, Jsonb(self.holder)),
                )
            except psycopg.Error:
                conn.close()
                return False
            self._conn = conn
            log.warning("lease %s: taken again on a new session", self.name)
            with self._cond:
                self._ok_at = time.monotonic()
            return True
        finally:
            with self._cond:
                self._regaining = False
                self._cond.notify_all()

    def _release(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=5)  # a watchdog stuck on a dead network closes the connection later
        if not self._tidied:  # our row may be left: delete it if it is still ours
            with (
                contextlib.suppress(CoordinationError, psycopg.Error),
                contextlib.closing(connect(self._url)) as c,
            ):
                c.execute(_DELETE_OWN_ROW, (self.name, self.holder["token"]))


@contextlib.contextmanager
def hold_lease(name: str, url: str | None = None, check_every_s: float = 2.0) -> Iterator[Lease]:
    """Hold lease ``name`` for the block (``LeaseHeldError`` naming its holder when another session
    holds it); a watchdog checks its connection every ``check_every_s`` (see the module docstring)."""
    url = _url(url)
    ensure_schema(url)
    conn = connect(url)
    try:
        if not _run(conn, url, f"lease {name}", "SELECT pg_try_advisory_lock(%s)", (lock_key(name),))[0]:
            raise LeaseHeldError(name, _holder_info(conn, url, name))
        now = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "started_at": now,
                  "backend_pid": conn.info.backend_pid, "token": uuid.uuid4().hex}  # fmt: skip
        _run(conn, url, f"publishing the holder of lease {name}",
             "INSERT INTO qerl_leases (name, holder, since) VALUES (%s, %s, now()) ON CONFLICT (name) "
             "DO UPDATE SET holder = EXCLUDED.holder, since = EXCLUDED.since", (name, Jsonb(holder)))  # fmt: skip
    except BaseException:
        conn.close()
        raise
    lease = Lease(name, conn, url, holder, check_every_s)
    with _ACTIVE_LOCK:
        _ACTIVE.add(lease)
    try:
        yield lease
    finally:
        with _ACTIVE_LOCK:
            _ACTIVE.discard(lease)
        lease._release()


def ensure_leases() -> None:
    """Raise ``LeaseLostError`` if any lease this process holds is lost (call before publishing)."""
    with _ACTIVE_LOCK:
        leases = list(_ACTIVE)
    for lease in leases:
        lease.check()


def cursor_position(line: str, stream: str, url: str | None = None) -> int:
    """The next unused slot of ``stream`` in nightly line ``line`` (0 for a new stream)."""
    url = _url(url)
    ensure_schema(url)
    with contextlib.closing(connect(url)) as conn:
        row = _run(conn, url, f"reading the cursor {line}/{stream}",
                   "SELECT next_slot FROM qerl_cursors WHERE line = %s AND stream = %s", (line, stream))  # fmt: skip
    return int(row[0]) if row else 0


def cursor_advance(line: str, stream: str, end_slot: int, run_id: str, url: str | None = None) -> int:
    """Move the cursor to ``end_slot`` (never back: a night completed again is a no-op); the next slot."""
    url = _url(url)
    ensure_schema(url)
    params = {"line": line, "stream": stream, "end": int(end_slot), "run": run_id}
    with contextlib.closing(connect(url)) as conn:
        row = _run(conn, url, f"advancing the cursor {line}/{stream}", _ADVANCE, params)
    return int(row[0])


@contextlib.contextmanager
def build_lock(name: str) -> Iterator[None]:
    """The fleet-wide build exclusion of store key ``name`` (``qerl-build:<name>``); a no-op without
    a coordination database (the store's local ``flock`` still applies)."""
    if settings.database_url() is None:
        yield
        return
    with advisory_lock(f"qerl-build:{name}"):
        yield
