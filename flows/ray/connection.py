"""Connecting the driver to a Ray cluster (``cluster``): check the rules, connect with the workers'
``runtime_env``, size each run's resources and probe every node; yields the flow's
``RayTaskRunner`` and the plan the ablation records.

The Prefect API: prefect-ray sends the driver's Prefect settings with every task and the worker
adopts them, so a worker talks to the API URL the driver has (an env var on the worker does not
override it). The driver always has one (``qerl.flows.orchestration.use_api``): the user's
``PREFECT_API_URL``, or the run's own server on 127.0.0.1, which the workers of a local cluster
reach; a cluster of several machines needs ``PREFECT_API_URL`` naming a server every node reaches.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from qerl.flows import console
from qerl.flows.ray.probe import alive_nodes, probe_nodes
from qerl.flows.ray.rules import FanoutError, address_is_remote, check_reachable, check_settings
from qerl.flows.ray.runtime_env import forwarded_env, qerl_package_dir

log = logging.getLogger("qerl.fanout")

CLIENT_ATTEMPTS, CLIENT_RETRY_S = 3, 5.0


def _import_ray() -> Any:
    try:
        import prefect_ray  # noqa: F401
        import ray
    except ImportError as err:
        raise FanoutError(
            f"qerl ablate --ray needs ray[default] and prefect-ray ({err}); they are pinned in "
            "requirements/*.txt: re-run `make venv` or pip install -r requirements/cpu.txt"
        ) from err
    return ray


def cluster_is_remote(ray: Any) -> bool:
    """Whether any alive node is on another machine than this driver."""
    me = ray.util.get_node_ip_address()
    return any(n.get("NodeManagerAddress") != me for n in alive_nodes(ray))


def _resources(ray: Any, cpus: float, gpus: float | None, tensor_parallel: int) -> dict[str, float]:
    """Per-run Ray resources; refuses a request no alive node can ever satisfy (it would wait forever)."""
    nodes = [n.get("Resources", {}) for n in alive_nodes(ray)]
    has_gpu = any(r.get("GPU", 0) > 0 for r in nodes)
    gpus = float(tensor_parallel if has_gpu else 0) if gpus is None else float(gpus)
    if cpus <= 0 or gpus < 0:
        raise FanoutError(f"--cpus-per-run must be > 0 and --gpus-per-run >= 0, got {cpus}, {gpus}")
    if not any(r.get("CPU", 0) >= cpus and r.get("GPU", 0) >= gpus for r in nodes):
        biggest = max(((r.get("CPU", 0), r.get("GPU", 0)) for r in nodes), default=(0, 0))
        raise FanoutError(
            f"no node of the Ray cluster has {cpus:g} CPUs and {gpus:g} GPUs for one run (the largest node "
            f"has {biggest[0]:g} CPUs, {biggest[1]:g} GPUs): lower --cpus-per-run / --gpus-per-run"
        )
    return {"num_cpus": float(cpus), "num_gpus": gpus}


def connect(ray: Any, address: str, runtime_env: dict[str, Any]) -> None:
    """``ray.init`` in the namespace RayTaskRunner uses by default (it finds this connection and leaves
    it to us). Through a Ray Client address (``ray://``) the head starts a server process per
    connection, and that start can fail once and then succeed ("Starting Ray client server failed"):
    the server's refusal (``ConnectionAbortedError``) is retried
    ``CLIENT_ATTEMPTS`` times in all, each retry said on the console. Any other failure, or the last
    one, is the CLI's one-line error."""
    attempts = CLIENT_ATTEMPTS if address.startswith("ray://") else 1
    for attempt in range(1, attempts + 1):
        try:
            # log_to_driver off: each run writes its own run.log in the shared work dir, and Ray's
            # driver-side log printer, still printing a worker's last lines after ray.shutdown, can
            # reach the shut core worker, on which Ray ends the driver with status 1 before the CLI
            # prints the ablation's error or result
            ray.init(address=address, namespace="prefect", runtime_env=runtime_env, log_to_driver=False)
            return
        except ConnectionAbortedError as err:
            reason = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
            if attempt == attempts:
                raise FanoutError(
                    f"cannot connect to the Ray cluster at {address}: the head refused the connection "
                    f"{attempts} times, last: {reason} (the reason is in ray_client_server*.err under the "
                    "head's Ray log directory, by default /tmp/ray/session_latest/logs)"
                ) from err
            with contextlib.suppress(Exception):
                ray.shutdown()
            console.current().line(
                f"Ray Client at {address} refused the connection ({reason}); "
                f"retrying in {CLIENT_RETRY_S:g} s (attempt {attempt + 1} of {attempts})"
            )
            time.sleep(CLIENT_RETRY_S)
        except Exception as err:  # ConnectionError and friends: the CLI's one-line error, not a traceback
            raise FanoutError(
                f"cannot connect to the Ray cluster at {address}: {type(err).__name__}: {err}"
            ) from err


@contextmanager
def cluster(
    address: str,
    work: Path,
    tracking_uri: str,
    cpus: float = 1.0,
    gpus: float | None = None,
    tensor_parallel: int = 1,
) -> Iterator[tuple[Any, dict[str, Any]]]:
    """Check, connect, probe; yields (the flow's ``RayTaskRunner``, the flow's ``ray`` parameter).

    Call it on the ablation's Prefect API (``qerl.flows.orchestration.use_api`` done): the workers get
    its ``PREFECT_API_URL`` with the driver's environment."""
    from prefect.settings import PREFECT_API_URL

    static, user_api = address_is_remote(address), PREFECT_API_URL.value()
    check_settings(address, str(work), tracking_uri, user_api, bool(static))
    check_reachable(address)
    ray = _import_ray()
    from prefect_ray import RayTaskRunner

    with tempfile.TemporaryDirectory(prefix="qerl-ray-code-") as staging:
        runtime_env = {"py_modules": [str(qerl_package_dir(Path(staging)))], "env_vars": forwarded_env()}
        connect(ray, address, runtime_env)
        try:
            remote = bool(static) or cluster_is_remote(ray)
            if remote and not static:
                check_settings(address, str(work), tracking_uri, user_api, True)
            resources = _resources(ray, cpus, gpus, tensor_parallel)
            probe_nodes(ray, work)
            total = ray.cluster_resources()
            plan = {
                "address": address,
                "remote": remote,
                "tracking_uri": tracking_uri,
                **resources,
                "cluster": {
                    "nodes": len(alive_nodes(ray)),
                    "CPU": total.get("CPU", 0),
                    "GPU": total.get("GPU", 0),
                },
            }
            yield RayTaskRunner(address=address), plan
        finally:
            ray.shutdown()
