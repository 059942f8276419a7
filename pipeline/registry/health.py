"""Whether the registry answers, asked once before a run, and MLflow's HTTP retries kept short.

A run registers its adapter last, after hours of training: a tracking server or database that is
down must be found before the first stage, not then. ``check_reachable`` makes one bounded attempt
(``timeout_s``): a tracking server must answer ``GET <uri>/health``, a PostgreSQL server must accept
a TCP connection on its port, a sqlite file's folder must be creatable. Failing, it raises a
``RegistryError`` naming the URI (a database URI with its password hidden) and what to do.

MLflow's client retries a refused connection 7 times with a back-off factor of 2 (about 4 minutes,
silently). ``bound_http_retries`` sets its environment defaults lower (3 retries, back-off factor 1,
60 s per request: about 10 s against a dead server); a value the user exported wins. Each retry is
logged as a qerl warning naming the server and what it waits for, so it reaches the console. The
adapter is in the store by then, so a re-run after the server is back only registers.
"""

from __future__ import annotations

import logging
import os
import socket
import urllib.error
import urllib.request
from pathlib import Path

from qerl.pipeline.registry.lock import RegistryError, backend_kind

log = logging.getLogger("qerl.registry")

HTTP_RETRY_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "60",
}


def shown_uri(uri: str) -> str:
    """``uri`` as it can be printed: a database URI's password hidden."""
    if backend_kind(uri) == "server":
        return uri
    from sqlalchemy.engine import make_url

    return make_url(uri).render_as_string(hide_password=True)


def check_reachable(uri: str, timeout_s: float = 10.0) -> None:
    """One bounded attempt to reach the registry at ``uri`` (module docstring); a ``RegistryError``
    naming it when nothing answers."""
    kind = backend_kind(uri)
    try:
        if kind == "server":
            with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=timeout_s):
                return
        from sqlalchemy.engine import make_url

        url = make_url(uri)
        if kind == "sqlite":
            Path(url.database or ".").resolve().parent.mkdir(parents=True, exist_ok=True)
            return
        socket.create_connection((url.host or "localhost", url.port or 5432), timeout=timeout_s).close()
    except urllib.error.HTTPError:
        return  # something answers: MLflow's own errors come later, with their messages
    except (OSError, ValueError) as err:
        reason = getattr(err, "reason", None) or err
        raise RegistryError(
            f"the MLflow registry at {shown_uri(uri)} does not answer ({reason}); nothing was run. Start "
            "it, or set registry.tracking_uri to one that runs (null: a sqlite file in the work dir)"
        ) from err


class _RetryNotice(logging.Filter):
    """Turns urllib3's retry lines (in run.log only) into a qerl warning the console shows."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith("Retrying"):
            log.warning(
                "the MLflow server does not answer, retrying (at most %s retries with back-off, "
                "MLFLOW_HTTP_REQUEST_MAX_RETRIES): %s",
                os.environ.get("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "?"),
                message[:300],
            )
        return True


_NOTICE = _RetryNotice()


def bound_http_retries() -> None:
    """MLflow's HTTP retry settings lowered unless set (module docstring), and its retries shown."""
    for name, value in HTTP_RETRY_DEFAULTS.items():
        os.environ.setdefault(name, value)
    pool = logging.getLogger("urllib3.connectionpool")
    if _NOTICE not in pool.filters:
        pool.addFilter(_NOTICE)
