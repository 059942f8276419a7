"""Locks for registry writes: one exclusive lock per registered model, whatever the MLflow backend.

Why: promotion is a read-modify-write ("read the champion, compare, set the alias") and version
creation checks "is this adapter digest registered already?" first; two runs finishing together
must not interleave them (see ``qerl.pipeline.registry.promotion``). On a fleet (``QERL_FLEET_DB``
set) the lock is a session-level ``pg_advisory_lock`` on the coordination database
(``qerl.pipeline.fleet.coordination.advisory_lock``, the key ``qerl-registry:<name>``), whatever the
MLflow backend: every machine shares that database, the server drops the lock when its holder dies,
and the lock never calls MLflow (no ticket model is created). Otherwise the lock lives with the backend:

- sqlite: an ``flock`` on ``<db>.lock`` next to the database file;
- PostgreSQL: a session-level ``pg_advisory_lock`` on the same database;
- an MLflow tracking server (``http[s]://``): a ticket lock on the server, ``server_lock``.

The first two are released by the kernel/server when the holder dies, so a crashed run never
wedges the registry.

Through a tracking server the client cannot reach the database, and the REST API has no
conditional update, so neither lock above exists and "set the alias, re-read, verify" would still
let the worse of two simultaneous candidates write last. The one atomic operation the API offers is
version numbering: ``create_model_version`` numbers versions in the server's database under a
unique key and never reuses a number (deleted versions are kept as tombstones). ``server_lock``
builds a ticket lock on it: each writer creates a version of the hidden registered model
``<name>.qerl-lock``, the smallest live ticket holds the lock (first come, first served), and the
holder deletes its ticket when done. A holder that dies cannot release it, so tickets carry a lease:
a background thread renews its own ticket every ``lease/3`` (``update_model_version`` stamps the
server's time), and a waiter deletes a ticket ahead of it whose stamp is more than the lease behind
its own (both are server times, so client clocks do not matter). Breaking a stale ticket is safe
because a number is never handed out twice: it cannot delete a newer holder's ticket. The residual
risk is a live holder that cannot reach the server for a whole lease; it is told so (RegistryError
when it leaves the critical section) and the register stage's retry re-decides the promotion.

Departure: the tickets are visible in the MLflow UI as the registered model ``<name>.qerl-lock``
(empty when no one holds or waits for the lock); deleting it by hand while a run registers breaks
the mutual exclusion.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

log = logging.getLogger("qerl.registry")

SERVER_LOCK_LEASE_S = 30.0  # a tracking-server lock ticket not renewed for this long is stale
LOCK_SUFFIX = ".qerl-lock"  # registered model holding the tickets of a model's server lock


class RegistryError(RuntimeError):
    """A registry operation cannot proceed; the message names the model, version or URI."""


def backend_kind(uri: str) -> str:
    """``sqlite``, ``postgresql`` or ``server`` (an MLflow tracking server); anything else raises."""
    scheme = uri.split(":", 1)[0].split("+", 1)[0].lower()
    if scheme in ("sqlite", "postgresql", "postgres"):
        return "postgresql" if scheme.startswith("postgres") else "sqlite"
    if scheme in ("http", "https"):
        return "server"
    raise RegistryError(
        f"tracking URI '{uri}' is not a sqlite or postgresql database nor an MLflow tracking server "
        "(http[s]://host:port): the registry needs one of those to keep promotions race-free"
    )


@contextlib.contextmanager
def registry_lock(
    uri: str, name: str, timeout_s: float = 120.0, lease_s: float = SERVER_LOCK_LEASE_S
) -> Iterator[None]:
    """Exclusive lock for registry writes of model ``name``: on a fleet the coordination database's
    advisory lock, else one on the backend behind ``uri`` (``lease_s``: how long a tracking-server
    lock outlives a holder that stopped renewing it)."""
    kind = backend_kind(uri)
    from qerl.pipeline.fleet import settings

    if settings.database_url() is not None:
        from qerl.pipeline.fleet import coordination

        lock = coordination.advisory_lock(f"qerl-registry:{name}", timeout_s)
        try:  # only the lock's own errors become RegistryError, not the block's (a LeaseLostError stays one)
            lock.__enter__()
        except coordination.CoordinationError as err:
            raise RegistryError(f"the registry lock on {name}: {err}") from None
        try:
            yield
        except BaseException as exc:
            lock.__exit__(type(exc), exc, exc.__traceback__)
            raise
        try:
            lock.__exit__(None, None, None)
        except coordination.CoordinationError as err:
            raise RegistryError(f"the registry lock on {name}: {err}") from None
        return
    if kind == "server":
        with server_lock(name, timeout_s, lease_s):
            yield
        return
    from sqlalchemy.engine import make_url

    url = make_url(uri)
    if backend_kind(uri) == "sqlite":
        if not url.database or url.database == ":memory:":
            raise RegistryError(f"sqlite tracking URI '{uri}' has no database file to lock next to")
        lock_path = Path(url.database).with_name(Path(url.database).name + ".lock")
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        with open(lock_path, "a+") as fh:
            deadline = time.monotonic() + timeout_s
            while True:  # poll, so a stuck holder gives an error naming the lock, not a hang
                try:
                    fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise RegistryError(f"timed out after {timeout_s}s waiting for {lock_path}") from None
                    time.sleep(0.05)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)
        return
    import psycopg

    conninfo = url.set(drivername="postgresql").render_as_string(hide_password=False)
    key = int.from_bytes(hashlib.sha256(f"qerl-registry:{name}".encode()).digest()[:8], "big", signed=True)
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute(f"SET lock_timeout = '{int(timeout_s * 1000)}ms'")
        try:
            conn.execute("SELECT pg_advisory_lock(%s)", (key,))
        except psycopg.errors.LockNotAvailable:
            raise RegistryError(
                f"timed out after {timeout_s}s waiting for the advisory lock on {name}"
            ) from None
        try:
            yield
        finally:
            conn.execute("SELECT pg_advisory_unlock(%s)", (key,))


class _Heartbeat(threading.Thread):
    """Renews a lock ticket (``update_model_version`` stamps the server's clock on it) until stopped."""

    def __init__(self, model: str, version: str, every_s: float):
        super().__init__(name=f"qerl-lock-{model}-v{version}", daemon=True)
        self.model, self.version, self.every_s = model, version, every_s
        self.done, self.error = threading.Event(), None
        self.client = MlflowClient()

    def run(self) -> None:
        beats = 0
        while not self.done.wait(self.every_s):
            beats += 1
            try:
                self.client.update_model_version(self.model, self.version, description=f"alive, beat {beats}")
            except MlflowException as err:  # our ticket was broken as stale, or the server is gone
                self.error = err
                return


def _tickets(client: MlflowClient, model: str) -> list[ModelVersion]:
    return sorted(client.search_model_versions(f"name = '{model}'"), key=lambda v: int(v.version))


@contextlib.contextmanager
def server_lock(name: str, timeout_s: float = 120.0, lease_s: float = SERVER_LOCK_LEASE_S) -> Iterator[None]:
    """A ticket lock for model ``name`` on an MLflow tracking server (see the module docstring).

    The tickets are versions of the registered model ``<name>.qerl-lock``: the server numbers
    versions atomically and never reuses a number, the smallest live ticket holds the lock, and
    a ticket whose server-side timestamp is more than ``lease_s`` behind the waiter's own is stale
    (its holder died) and is deleted by the waiter. A holder whose own ticket was broken (it could
    not renew for ``lease_s``) gets a RegistryError when it leaves the critical section.
    """
    client = MlflowClient()
    model = f"{name}{LOCK_SUFFIX}"
    try:
        client.create_registered_model(model, description=f"qerl's promotion lock for '{name}' (tickets)")
    except MlflowException as err:
        if err.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    holder = f"{socket.gethostname()}:{os.getpid()}"
    # a ticket has no files: it is READY at once (await_creation_for=0 skips a poll and its log line)
    ticket = client.create_model_version(
        model,
        source=f"qerl-lock:/{name}",
        tags={"holder": holder},
        description="waiting",
        await_creation_for=0,
    )
    mine = str(ticket.version)
    beat = _Heartbeat(model, mine, lease_s / 3)
    beat.start()
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            tickets = _tickets(client, model)
            own = next((t for t in tickets if str(t.version) == mine), None)
            if own is None:
                raise RegistryError(f"lock ticket {model} v{mine} was broken as stale while waiting")
            ahead = [t for t in tickets if int(t.version) < int(mine)]
            # both timestamps are the server's clock: clock skew between client machines does not matter
            stale = [
                t for t in ahead if own.last_updated_timestamp - t.last_updated_timestamp > lease_s * 1000
            ]
            for t in stale:
                log.warning("breaking stale lock ticket %s v%s of %s", model, t.version, t.tags.get("holder"))
                with contextlib.suppress(MlflowException):  # another waiter broke it first
                    client.delete_model_version(model, str(t.version))
            ahead = [t for t in ahead if t not in stale]
            if not ahead:
                break
            if time.monotonic() > deadline:
                raise RegistryError(
                    f"timed out after {timeout_s}s waiting for the lock on {name} (held by ticket "
                    f"{model} v{ahead[0].version} of {ahead[0].tags.get('holder')})"
                )
            time.sleep(0.1)
        yield
    finally:
        beat.done.set()
        beat.join()
        with contextlib.suppress(MlflowException):
            client.delete_model_version(model, mine)
    if beat.error is not None:
        raise RegistryError(f"lost the lock on {name}: could not renew ticket {model} v{mine} ({beat.error})")
