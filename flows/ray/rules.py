"""The rules a Ray fan-out must satisfy, checked before connecting (``check_settings``) and again
after connecting when the cluster turns out to span several machines.

Any Ray address: the work dir must be absolute. A remote cluster (an address whose host is not
loopback, or any cluster with a node on another machine): ``PREFECT_API_URL`` set and not loopback;
the registry neither a sqlite file (SQLite's and the registry's file locks are not reliable on
network filesystems, so even a sqlite file on the shared work dir is refused: use
``postgresql+psycopg://`` or an MLflow tracking server) nor a loopback database or server. Loopback
addresses, ``local`` and a single-node ``auto`` are local: local paths and sqlite are fine.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from pathlib import Path
from urllib.parse import urlsplit

ADDRESS_ENV = "QERL_RAY_ADDRESS"


class FanoutError(ValueError):
    """The ablation cannot run on this Ray cluster as configured; the message says what to change."""


def resolve_address(cli_value: str | None) -> str | None:
    """``--ray`` wins over ``$QERL_RAY_ADDRESS``; empty means sequential, in this process."""
    value = cli_value if cli_value is not None else os.environ.get(ADDRESS_ENV, "")
    return value.strip() or None


def _host(url: str) -> str | None:
    """The host of a Ray address (``host:port``, ``ray://host:port``) or of a URL."""
    if "://" not in url:
        url = f"tcp://{url}"
    try:
        return urlsplit(url).hostname
    except ValueError:
        return None


def is_loopback(host: str | None) -> bool:
    """``localhost``, 127.0.0.0/8 and ::1 (a missing host, a unix socket, is local too)."""
    if not host or host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def address_is_remote(address: str) -> bool | None:
    """True for an address on another machine, False for loopback and ``local``, None for ``auto``
    (known only after connecting: see ``cluster_is_remote``)."""
    if address in ("local",):
        return False
    if address == "auto":
        return None
    return not is_loopback(_host(address))


def check_reachable(address: str, timeout_s: float = 10.0) -> None:
    """A TCP connect to a ``host:port`` address before ``ray.init``, which retries a dead address for
    minutes; ``auto``, ``local`` and an address without a port are left to Ray."""
    if address in ("auto", "local"):
        return
    parts = urlsplit(address if "://" in address else f"tcp://{address}")
    try:
        port = parts.port
    except ValueError as err:
        raise FanoutError(
            f"'{address}' is not a Ray address (host:port, ray://host:port, auto, local)"
        ) from err
    if not parts.hostname or port is None:
        return
    try:
        socket.create_connection((parts.hostname, port), timeout=timeout_s).close()
    except OSError as err:
        raise FanoutError(
            f"nothing answers at the Ray address {address} ({err}): start the head with `ray start --head "
            "--port PORT` (its output names the address) or pass the address it printed"
        ) from err


def _registry_host(uri: str) -> str | None:
    from sqlalchemy.engine import make_url

    return _host(uri) if uri.split(":", 1)[0].lower() in ("http", "https") else make_url(uri).host


def check_settings(
    address: str, work_dir: str, tracking_uri: str, prefect_api_url: str | None, remote: bool
) -> None:
    """The static rules of the module docstring; raises ``FanoutError`` naming what to change."""
    if not Path(work_dir).is_absolute():
        raise FanoutError(
            f"the work dir '{work_dir}' is not an absolute path: a Ray worker does not share the driver's "
            "current directory; pass --work-dir /absolute/path (on a cluster: the same shared path on every node)"
        )
    if not remote:
        return
    from qerl.pipeline.registry.lock import backend_kind

    kind = backend_kind(tracking_uri)
    if kind == "sqlite":
        raise FanoutError(
            f"the Ray cluster at {address} spans several machines but the MLflow registry is a sqlite file "
            f"({tracking_uri}): the other nodes cannot share it safely (file locks over a network filesystem "
            "are unreliable); set registry.tracking_uri to a PostgreSQL database every node reaches "
            "(postgresql+psycopg://user:password@host:5432/mlflow) or an MLflow tracking server (http://host:5000)"
        )
    if is_loopback(_registry_host(tracking_uri)):
        raise FanoutError(
            f"the Ray cluster at {address} spans several machines but the MLflow registry ({kind}) is on "
            "this machine's loopback address, which the other nodes cannot reach: name its host by an "
            "address every node reaches in registry.tracking_uri"
        )
    if not prefect_api_url:
        raise FanoutError(
            f"the Ray cluster at {address} spans several machines: set PREFECT_API_URL to a Prefect server "
            "every node reaches (e.g. `prefect server start --host <this machine's cluster address>` and "
            "PREFECT_API_URL=http://<that address>:4200/api); Prefect's temporary server is on loopback only"
        )
    if is_loopback(_host(prefect_api_url)):
        raise FanoutError(
            f"PREFECT_API_URL ({prefect_api_url}) is a loopback address, which the other nodes of the Ray "
            f"cluster at {address} cannot reach: use an address of this machine that every node reaches"
        )
