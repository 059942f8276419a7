"""An ablation's runs on a Ray cluster (``qerl ablate --ray ADDRESS``): what the driver checks, what a
worker gets, and how the runs come back.

What. Without an address ``qerl.flows.ablate`` runs its (arm, seed) runs one after the other in its own
process. With one (``--ray ADDRESS`` or ``$QERL_RAY_ADDRESS``; ``local`` starts a private Ray instance
on this machine) the ablation flow runs on prefect-ray's ``RayTaskRunner``: every run is one Prefect
task (``ablation-run``) submitted at once with the Ray resources it asks for (``prefect_ray``'s
``remote_options``: ``num_cpus`` per run, default 1; ``num_gpus`` per run, by default the rollout's
tensor-parallel size when the cluster has GPUs, else 0, so on a cluster with GPUs no run lands on a
CPU-only node and changes engine mode). In its Ray worker that task calls the same ``rl_flow`` as the
sequential path. The unit is unchanged: one ordinary run per (arm, seed) whose id is its config hash,
its stages cached in the shared store, so re-running a killed ablation resumes every run and rebuilds
nothing finished; two runs that need the same artifact (the NVFP4 base of two arms) serialise on the
store's lock and the second finds the first's result.

Worker processes. ``max_calls=1``: each run gets a fresh process, so the engine, the resident policy,
GPU memory and the console's redirected file descriptors go with it. ``max_retries=0``: a worker that
dies fails its run; the others go on, and the ablation fails after all have finished, naming the
failed runs (the same command again resumes them). In the worker the run's console is the quiet one
of ``qerl run`` with its log in ``<work>/runs/<run id>/run.log``; the driver's console shows one line
per finished run (arm, seed, final accuracy, duration, node and pid).

What a worker needs, and how it gets it:

- the code: the job's ``runtime_env`` ``py_modules`` ships the driver's ``qerl`` package (from a
  source checkout, a staged copy that gathers its folders), so every node runs the driver's code. Third-party packages and the
  ``qerl`` distribution itself (its version is part of every cache key) must be installed on every
  node at the driver's versions: a probe checks that before any run starts.
- the environment: workers of ``ray start`` inherit the raylet's environment, not the driver's, so
  ``env_vars`` forwards the driver's ``QERL_*``, ``HF_*``, ``VLLM_*``, ``TRITON_*``, ``TRANSFORMERS_*``,
  ``MLFLOW_*``, ``PREFECT_*`` and ``TOKENIZERS_PARALLELISM``. They travel in the job's runtime env.
- the store and registry: the work dir goes to each task as an absolute path and the MLflow tracking
  URI, resolved in the driver, is re-resolved in the worker and must be identical. Before the runs,
  a probe task on every alive node reads a token the driver wrote under the work dir; a node that
  does not see it (the work dir not mounted at the same path) stops the ablation before it starts.
- the Prefect API: prefect-ray sends the driver's Prefect settings with every task and the worker
  adopts them, so a worker talks to the API URL the driver has (an env var on the worker does not
  override it). With no ``PREFECT_API_URL`` the driver would use an in-process temporary server that no
  worker can reach, and each worker would start one of its own. So on a local cluster the driver
  starts Prefect's temporary server itself (on 127.0.0.1) and points ``PREFECT_API_URL`` at it for the
  ablation; a cluster of several machines needs ``PREFECT_API_URL`` naming a server every node reaches.

Rules (``check_settings``, before connecting; again after connecting when the cluster turns out to
span several machines). Any Ray address: the work dir must be absolute. A remote cluster (an address
whose host is not loopback, or any cluster with a node on another machine): ``PREFECT_API_URL`` set
and not loopback; the registry neither a sqlite file (SQLite's and the registry's file locks are not
reliable on network filesystems, so even a sqlite file on the shared work dir is refused: use
``postgresql+psycopg://`` or an MLflow tracking server) nor a loopback database or server. Loopback
addresses, ``local`` and a single-node ``auto`` are local: local paths and sqlite are fine.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import ipaddress
import json
import logging
import os
import socket
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from prefect import task
from prefect.cache_policies import NO_CACHE
from qerl.flows import console

log = logging.getLogger("qerl.fanout")

ADDRESS_ENV = "QERL_RAY_ADDRESS"
SUBPACKAGES = ("pipeline", "flows", "stages", "kernels")  # qerl's sub-packages: what py_modules ships
FORWARD_PREFIXES = ("QERL_", "HF_", "VLLM_", "TRITON_", "TRANSFORMERS_", "MLFLOW_", "PREFECT_")
FORWARD_NAMES = ("TOKENIZERS_PARALLELISM", "DO_NOT_TRACK")
VERSIONS = ("qerl", "prefect", "prefect-ray", "ray", "torch", "mlflow")  # must match on every node
PROBE_TIMEOUT_S = 600.0  # the first task on a node also sets up the runtime env (py_modules download)


class FanoutError(ValueError):
    """The ablation cannot run on this Ray cluster as configured; the message says what to change."""


# ---- the rules -------------------------------------------------------------------------------------
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


# ---- the driver ----------------------------------------------------------------------------------------
def forwarded_env() -> dict[str, str]:
    """The driver's environment variables a worker's run depends on (module docstring)."""
    return {k: v for k, v in os.environ.items() if k.startswith(FORWARD_PREFIXES) or k in FORWARD_NAMES}


def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in VERSIONS:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


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


@contextmanager
def _prefect_api(remote: bool | None) -> Iterator[str]:
    """The Prefect API every worker talks to: PREFECT_API_URL, or this machine's temporary server."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    url = PREFECT_API_URL.value()
    if url or remote:
        yield url
        return
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()  # the instance Prefect's own client would start; 127.0.0.1 only
    server.start()
    log.info("Prefect temporary server for the Ray workers at %s", server.api_url)
    with temporary_settings(updates={PREFECT_API_URL: server.api_url}):
        os.environ["PREFECT_API_URL"] = server.api_url  # forwarded to the workers' environment too
        try:
            yield server.api_url
        finally:
            os.environ.pop("PREFECT_API_URL", None)


def _alive_nodes(ray: Any) -> list[dict[str, Any]]:
    return [n for n in ray.nodes() if n.get("Alive") or n.get("alive")]


def cluster_is_remote(ray: Any) -> bool:
    """Whether any alive node is on another machine than this driver."""
    me = ray.util.get_node_ip_address()
    return any(n.get("NodeManagerAddress") != me for n in _alive_nodes(ray))


def _probe(token_path: str) -> dict[str, Any]:
    """Runs on one node: does it see the driver's work dir, and with which package versions?"""
    import ray

    path = Path(token_path)
    return {
        "node_id": ray.get_runtime_context().get_node_id(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "token": json.loads(path.read_text())["token"] if path.is_file() else None,
        "versions": _versions(),
    }


def probe_nodes(ray: Any, work: Path, timeout_s: float = PROBE_TIMEOUT_S) -> list[dict[str, Any]]:
    """A zero-CPU probe on every alive node with resources; raises ``FanoutError`` naming the nodes that
    do not see the work dir or run other package versions than the driver."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    token = uuid.uuid4().hex
    token_path = work / "ray-probe" / f"{token}.json"
    token_path.parent.mkdir(parents=True, exist_ok=True)
    token_path.write_text(json.dumps({"token": token, "host": socket.gethostname(), "pid": os.getpid()}))
    nodes = [n for n in _alive_nodes(ray) if n.get("Resources", {}).get("CPU", 0) > 0]
    remote_probe = ray.remote(num_cpus=0, max_retries=0)(_probe)
    refs = [
        remote_probe.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
        ).remote(str(token_path))
        for n in nodes
    ]
    try:
        answers = ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError as err:
        raise FanoutError(
            f"a node of the Ray cluster did not answer the probe within {timeout_s:.0f} s"
        ) from err
    finally:
        token_path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # the folder goes when no other driver's probe is in it
            token_path.parent.rmdir()
    mine = _versions()
    problems = []
    for node, answer in zip(nodes, answers, strict=True):
        where = f"node {answer['host']} ({node.get('NodeManagerAddress')})"
        if answer["token"] != token:
            problems.append(
                f"{where} does not see the work dir {work} (mount it at the same path on every node)"
            )
        differ = {
            k: (v, answer["versions"].get(k)) for k, v in mine.items() if answer["versions"].get(k) != v
        }
        if differ:
            text = ", ".join(f"{k} {theirs} (driver: {ours})" for k, (ours, theirs) in differ.items())
            problems.append(f"{where} runs other package versions: {text}")
    if problems:
        raise FanoutError("the Ray cluster cannot run this ablation: " + "; ".join(problems))
    return answers


def _resources(ray: Any, cpus: float, gpus: float | None, tensor_parallel: int) -> dict[str, float]:
    """Per-run Ray resources; refuses a request no alive node can ever satisfy (it would wait forever)."""
    nodes = [n.get("Resources", {}) for n in _alive_nodes(ray)]
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


CLIENT_ATTEMPTS, CLIENT_RETRY_S = 3, 5.0


def qerl_package_dir(staging: Path) -> Path:
    """The ``qerl`` package as one folder, for ``py_modules``: an installed package is one already; a
    source checkout maps the top-level folders into it (pyproject's package-dir), so they are copied
    under ``staging/qerl``."""
    import importlib
    import shutil

    import qerl

    root = Path(qerl.__file__).resolve().parent
    dirs = {
        name: Path(importlib.import_module(f"qerl.{name}").__file__).resolve().parent for name in SUBPACKAGES
    }
    if all(path == root / name for name, path in dirs.items()):
        return root
    staged = staging / "qerl"
    shutil.copytree(root, staged, ignore=shutil.ignore_patterns("__pycache__"))
    for name, path in dirs.items():
        shutil.copytree(path, staged / name, ignore=shutil.ignore_patterns("__pycache__"))
    return staged


def connect(ray: Any, address: str, runtime_env: dict[str, Any]) -> None:
    """``ray.init`` in the namespace RayTaskRunner uses by default (it finds this connection and leaves
    it to us). Through a Ray Client address (``ray://``) the head starts a server process per
    connection, and that start can fail once and then succeed (seen in CI on a loaded 2-core machine:
    "Starting Ray client server failed"): the server's refusal (``ConnectionAbortedError``) is retried
    ``CLIENT_ATTEMPTS`` times in all, each retry said on the console. Any other failure, or the last
    one, is the CLI's one-line error."""
    attempts = CLIENT_ATTEMPTS if address.startswith("ray://") else 1
    for attempt in range(1, attempts + 1):
        try:
            ray.init(address=address, namespace="prefect", runtime_env=runtime_env)
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
    address: str, work: Path, tracking_uri: str, cpus: float = 1.0, gpus: float | None = None,
    tensor_parallel: int = 1,
) -> Iterator[tuple[Any, dict[str, Any]]]:  # fmt: skip
    """Check, connect, probe; yields (the flow's ``RayTaskRunner``, the flow's ``ray`` parameter).

    Call it inside Prefect's settings for the ablation (``runner.prepare_environment`` done): it may
    start the temporary Prefect server and sets ``PREFECT_API_URL`` for the block."""
    from prefect.settings import PREFECT_API_URL

    static, user_api = address_is_remote(address), PREFECT_API_URL.value()
    check_settings(address, str(work), tracking_uri, user_api, bool(static))
    check_reachable(address)
    ray = _import_ray()
    from prefect_ray import RayTaskRunner

    with _prefect_api(static), tempfile.TemporaryDirectory(prefix="qerl-ray-code-") as staging:
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
                "address": address, "remote": remote, "tracking_uri": tracking_uri, **resources,
                "cluster": {"nodes": len(_alive_nodes(ray)), "CPU": total.get("CPU", 0), "GPU": total.get("GPU", 0)},
            }  # fmt: skip
            yield RayTaskRunner(address=address), plan
        finally:
            ray.shutdown()


# ---- the runs ------------------------------------------------------------------------------------------
def _check_worker(work: Path, aid: str, tracking_uri: str, config: dict[str, Any]) -> None:
    """In the worker, before the run: the same store and the same registry as the driver."""
    from qerl.flows.ablate import ablation_dir
    from qerl.pipeline.planning.run_config import RunConfig
    from qerl.pipeline.registry import tracking as registry

    if not (ablation_dir(work, aid) / "ablation.json").is_file():
        raise FanoutError(
            f"{socket.gethostname()} does not see the ablation under the work dir {work}: mount the "
            "work dir at the same path on every node"
        )
    mine, _ = registry.resolve_uris(RunConfig.model_validate(config).registry, work)
    if mine != tracking_uri:
        raise FanoutError(
            f"the worker resolves the MLflow tracking URI to {mine}, the driver to {tracking_uri}"
        )


@task(name="ablation-run", cache_policy=NO_CACHE, persist_result=False)
def ablation_run(
    config: dict[str, Any], work_dir: str, ablation: dict[str, Any], tracking_uri: str
) -> dict[str, Any]:
    """One (arm, seed) run in a Ray worker, its console quiet (its log in the run's run.log); returns
    where it ran and its final accuracy."""
    import ray
    from qerl.flows.rl import rl_flow, run_dir, run_id_for
    from qerl.pipeline.planning.run_config import RunConfig

    work = Path(work_dir)
    _check_worker(work, ablation["id"], tracking_uri, config)
    run_id = run_id_for(RunConfig.model_validate(config))
    where = {
        "pid": os.getpid(),
        "node_id": ray.get_runtime_context().get_node_id(),
        "host": socket.gethostname(),
    }
    t0 = time.perf_counter()
    with console.session(run_dir(work, run_id)):
        record = rl_flow(config=config, work_dir=work_dir, ablation=ablation)
    final = [e for e in record.get("evaluations", []) if e.get("adapter") is not None]
    return {
        "run_id": run_id, "status": record.get("status"), "seconds": time.perf_counter() - t0,
        "accuracy": final[-1]["accuracy"] if final else None, "stderr": final[-1].get("stderr") if final else None,
        **where,
    }  # fmt: skip


def _line(i: int, n: int, p: dict[str, Any], result: dict[str, Any] | None, err: BaseException | None) -> str:
    head = f"run {i}/{n} {'done' if err is None else 'FAILED'}: arm {p['arm']} seed {p['replicate']} ({p['run_id']})"
    if err is not None:
        return f"{head}: {type(err).__name__}: {err} (log: runs/{p['run_id']}/run.log)"
    assert result is not None
    acc = result.get("accuracy")
    text = (
        ""
        if acc is None
        else f" accuracy {acc:.3f}"
        + (f" ± {result['stderr']:.3f}" if result.get("stderr") is not None else "")
    )
    return f"{head}{text} in {console.fmt_duration(result['seconds'])} [node {result['node_id'][:8]} pid {result['pid']}]"


def run_all(
    planned: list[dict[str, Any]], work: Path, parent: str, aid: str, plan: dict[str, Any],
    on_done: Callable[[int, dict[str, Any]], None],
) -> None:  # fmt: skip
    """Submit every run at once (inside the ablation flow, whose task runner is Ray's), report each as it
    finishes (``on_done(index, worker info)``, one console line), then raise if any failed."""
    import ray
    from prefect.context import FlowRunContext
    from prefect_ray import RayTaskRunner
    from prefect_ray.context import remote_options

    ctx = FlowRunContext.get()
    if ctx is None or not isinstance(ctx.task_runner, RayTaskRunner):
        raise FanoutError("run_all needs the ablation flow on a RayTaskRunner (qerl.flows.fanout.cluster)")
    ui = console.current()
    ui.line(
        f"{len(planned)} runs on Ray at {plan['address']} ({plan['num_cpus']:g} CPU, {plan['num_gpus']:g} GPU each; "
        f"cluster: {plan['cluster']['nodes']} node(s), {plan['cluster']['CPU']:g} CPU, {plan['cluster']['GPU']:g} GPU)"
    )
    pending: dict[Any, tuple[int, Any]] = {}
    with remote_options(num_cpus=plan["num_cpus"], num_gpus=plan["num_gpus"], max_calls=1, max_retries=0):
        for i, p in enumerate(planned):
            info = {"id": aid, "arm": p["arm"], "replicate": p["replicate"], "parent_run_id": parent}
            future = ablation_run.with_options(name=f"run-{p['arm']}-s{p['replicate']}").submit(
                config=p["config"], work_dir=str(work), ablation=info, tracking_uri=plan["tracking_uri"]
            )
            pending[future.wrapped_future] = (i, future)
    failed, done = [], 0
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1)
        i, future = pending.pop(ready[0])
        done += 1
        try:
            result, err = future.result(raise_on_failure=True), None
        except Exception as exc:  # noqa: BLE001 - reported, and the ablation fails after the others
            result, err = None, exc
        ui.line(_line(done, len(planned), planned[i], result, err))
        if err is None:
            on_done(i, {k: result[k] for k in ("pid", "node_id", "host", "seconds")})
        else:
            failed.append(f"{planned[i]['run_id']} ({type(err).__name__}: {err})")
    if failed:
        from qerl.pipeline.evaluation.ablation import AblationError

        raise AblationError(
            f"{len(failed)} of {len(planned)} runs failed: {'; '.join(failed)}; the others are complete, "
            "the same command resumes the failed ones"
        )
