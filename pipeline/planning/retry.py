"""What is worth retrying: the errors after which running the same task again could succeed.

Transient: a dead rollout engine (``LazyEngine`` has dropped it, so the retry builds a fresh one), a
refused or dropped connection, a network timeout of httpx (Prefect's and MLflow's client), a locked
SQLite database (another writer under MLflow or Prefect). The whole cause chain counts: a transient
error wrapped in a library's own exception is still transient. Config errors, engine
misconfiguration and bad data fail at once: a retry would only repeat them.
"""

from __future__ import annotations

import errno

from qerl.pipeline.rollout.lazy import engine_died
from qerl.pipeline.runtime.errors import cause_chain

_TRANSIENT_ERRNOS = {errno.EAGAIN, errno.EBUSY, errno.EINTR, errno.ETIMEDOUT, errno.ECONNRESET, errno.EPIPE}
# httpx's (Prefect's and MLflow's client) network failures, matched by name: no import needed
_TRANSIENT_NAMES = {"TransportError", "TimeoutException"}


def is_transient(err: BaseException) -> bool:
    """Whether retrying the same task could succeed (see the module docstring); the cause chain counts."""
    if engine_died(err):  # LazyEngine has dropped it: the retry builds a fresh engine
        return True
    for exc in cause_chain(err):
        names = {cls.__name__ for cls in type(exc).__mro__}
        if names & _TRANSIENT_NAMES or isinstance(exc, ConnectionError | TimeoutError):
            return True
        if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
            return True
        if "database is locked" in str(exc).lower():  # sqlite under MLflow/Prefect: another writer
            return True
    return False
