"""A team's fleet on Prefect's own parts: a process work pool, one worker per GPU, PostgreSQL.

- ``deploy_to_pool``: the nightly deployment on a work pool (``qerl schedule --pool``). It returns;
  no machine has to keep serving it. Its flow runs carry no work directory: each runs in the one of
  the worker that takes it (``QERL_WORK_DIR``, that machine's cache of the shared store).
- ``run_worker`` (``qerl worker``): Prefect's process worker for one GPU (``--limit 1``; its runs
  inherit ``CUDA_VISIBLE_DEVICES`` and ``QERL_GPU_ID``), started as a child that dies with it, while
  this process keeps the worker's row in the coordination database fresh (host, GPU, qerl's and the
  dependencies' versions, each stage's code version, free cache) and sweeps the pool with the
  janitor (``qerl.flows.janitor``).
- ``init`` (``qerl fleet init``): the pool, the fleet-wide GPU limit (a Prefect global concurrency
  limit that nights and ablations share), the database schema, and a check of every service.
- ``doctor`` (``qerl fleet doctor``): per worker, whatever differs from this machine and so what a
  night resumed there would rebuild (a stage whose code differs has other keys: it and everything
  after it run again).

Departure from FLEET.md: the janitor runs inside every worker, under a try-lock, not as a deployment
on a CPU pool, so a fleet has no extra service to keep alive; and liveness is the run's lease (a
PostgreSQL advisory lock), not Prefect's heartbeat events, so a CPU-bound run whose heartbeat thread
starves is not crashed by mistake (#18653).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from qerl.pipeline.fleet import coordination, gpu_lock, settings
from qerl.pipeline.planning.run_config import RunConfig
from qerl.pipeline.store.code_version import code_version, dependency_versions, package_version

log = logging.getLogger("qerl.fleet")

# what a worker's runs get unless the environment says otherwise: a restart of the Prefect or MLflow
# server (about a minute at worst) is ridden out by the clients' own retries, not failed on
RIDE_OUT = {
    "PREFECT_CLIENT_MAX_RETRIES": "6",
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "6",
    "QERL_API_GRACE_S": "90",
}
GPU_LIMIT = "qerl-gpus"  # the fleet-wide global concurrency limit: one slot per GPU
# a dead run's slot comes back when its lease runs out (Prefect renews a live one): 2 minutes, not
# Prefect's default 5, so a killed night's slot does not hold a GPU of the fleet back for long
SLOT_LEASE_S = 120.0
WORKERS_TABLE = """CREATE TABLE IF NOT EXISTS qerl_workers (
    name text PRIMARY KEY, host text NOT NULL, gpu text, pool text NOT NULL, info jsonb NOT NULL,
    seen_at timestamptz NOT NULL DEFAULT now())"""
STALE_WORKER_S = 600.0


def nightly_name(cfg: RunConfig) -> str:
    """A pool deployment's name: one per nightly line (``loop.name``)."""
    return f"nightly-{cfg.loop.name}"


def deploy_to_pool(cfg: RunConfig, cron: str, pool: str) -> str:
    """Create or update the nightly deployment of ``cfg`` on work pool ``pool``; its id."""
    from prefect import get_client
    from prefect.exceptions import ObjectNotFound
    from qerl.flows.orchestration import nightly_deployment

    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(pool)
        except ObjectNotFound:
            raise RuntimeError(
                f"work pool '{pool}' does not exist on {os.environ.get('PREFECT_API_URL')}: create it "
                f"with `qerl fleet init --pool {pool} --gpus N`"
            ) from None
    deployment = nightly_deployment(cfg, None, cron)
    deployment.name = nightly_name(cfg)
    return str(deployment.apply(work_pool_name=pool))


@contextlib.contextmanager
def run_resources(run_id: str) -> Iterator[None]:
    """What an attempt holds besides its run's lease: its GPUs' host-local locks and, for a
    deployment's run on a fleet's worker (a night, an ablation's arm), one slot of the fleet-wide GPU
    limit (``qerl.flows.gpu_slot``; a run started by hand takes its GPU's lock only)."""
    from prefect.runtime import deployment, flow_run
    from qerl.flows import gpu_slot, orchestration

    with contextlib.ExitStack() as stack:
        on_pool = deployment.get_id() is not None  # a night's or an arm's flow run, not a run by hand
        if on_pool and settings.gpu_id() and settings.database_url() and orchestration.answers():
            stack.enter_context(gpu_slot.hold_slot(GPU_LIMIT, SLOT_LEASE_S, flow_run.get_id()))
        stack.enter_context(gpu_lock.hold_gpus(run_id))
        yield


ARMS_DEPLOYMENT = "ablation-arms"
TERMINAL = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")


def run_arms_on_pool(planned: list[dict[str, Any]], work: Path, info: dict[str, Any], pool: str) -> None:
    """Each (arm, seed) of an ablation as a flow run of ``qerl-rl/ablation-arms`` on ``pool`` (the
    nights' GPUs and limits); waits for all, then copies their records here from the shared store.
    ``info``: the ablation's id and MLflow parent run, given to every arm."""
    from prefect import get_client
    from qerl.flows.run import rl_flow

    cfg = RunConfig.model_validate(planned[0]["config"])
    if not cfg.store.uri:
        raise RuntimeError("qerl ablate --pool needs store.uri: the arms' records come back through it")
    dep_id = rl_flow.to_deployment(name=ARMS_DEPLOYMENT, tags=["qerl", "ablation"]).apply(work_pool_name=pool)
    with get_client(sync_client=True) as client:
        ids = []
        for p in planned:
            arm = {**info, "arm": p["arm"], "replicate": p["replicate"]}
            params = {"config": p["config"], "work_dir": None, "ablation": arm}
            ids.append(
                client.create_flow_run_from_deployment(
                    dep_id, parameters=params, tags=["qerl", info["id"]]
                ).id
            )
        log.info("ablation %s: %d runs submitted to pool %s", info["id"], len(ids), pool)
        while True:
            states = [client.read_flow_run(i).state for i in ids]
            if all(st is not None and st.type.value in TERMINAL for st in states):
                break
            time.sleep(5)
    failed = [
        f"{p['run_id']} {st.type.value}"
        for p, st in zip(planned, states, strict=True)
        if st.type.value != "COMPLETED"
    ]
    pull_records(work, cfg.store.uri)
    if failed:
        raise RuntimeError(
            f"ablation {info['id']}: runs that did not complete on pool {pool}: {', '.join(failed)}"
        )


STORE_URI_ENV = "QERL_STORE_URI"  # the shared store of the commands without a config: runs, resume


def pull_records(work: Path, uri: str | None) -> int:
    """Copy into ``work`` the run records of the shared store at ``uri`` (else ``QERL_STORE_URI``)
    that are newer than this machine's copy, so ``qerl runs`` and ``qerl resume`` see every machine's
    runs; returns how many were copied (0 without a shared store)."""
    from qerl.pipeline.store.files import atomic_write_bytes
    from qerl.pipeline.store.layout import RUN_RECORD
    from qerl.pipeline.store.run_record import run_dir
    from qerl.pipeline.store.shared import fetch_record, list_records, open_shared

    shared = open_shared(uri or os.environ.get(STORE_URI_ENV) or None)
    if shared is None:
        return 0
    copied = 0
    for run_id in list_records(shared):
        data = fetch_record(shared, run_id)
        if data is None:
            continue
        path = run_dir(work, run_id) / RUN_RECORD
        try:
            theirs = json.loads(data).get("updated_at") or ""
            ours = json.loads(path.read_text()).get("updated_at") or "" if path.is_file() else None
        except ValueError as err:
            log.warning("run record %s in %s is unreadable: %s", run_id, shared.describe(), err)
            continue
        if ours is None or str(theirs) > str(ours):
            atomic_write_bytes(path, data)
            copied += 1
    return copied


# ---- what a worker is -------------------------------------------------------------------------
def stage_code_versions() -> dict[str, str]:
    """Each stage module's code version as installed here (parsed, not imported)."""
    import qerl.stages

    names = sorted(p.stem for p in Path(qerl.stages.__file__).parent.glob("*.py") if p.stem != "__init__")
    return {name: code_version(f"qerl.stages.{name}") for name in names}


def machine_info(work: Path) -> dict[str, Any]:
    """What ``qerl fleet doctor`` compares between machines."""
    work.mkdir(parents=True, exist_ok=True)
    return {
        "qerl": package_version(),
        "python": sys.version.split()[0],
        "versions": dependency_versions(),
        "stages": stage_code_versions(),
        "work_dir": str(work),
        "free_cache_bytes": shutil.disk_usage(work).free,
    }


def _register(conn: Any, name: str, gpu: str | None, pool: str, info: dict[str, Any]) -> None:
    conn.execute(WORKERS_TABLE)
    conn.execute(
        "INSERT INTO qerl_workers (name, host, gpu, pool, info, seen_at) VALUES (%s, %s, %s, %s, %s, now()) "
        "ON CONFLICT (name) DO UPDATE SET host = EXCLUDED.host, gpu = EXCLUDED.gpu, pool = EXCLUDED.pool, "
        "info = EXCLUDED.info, seen_at = now()",
        (name, socket.gethostname(), gpu, pool, json.dumps(info)),
    )


def workers(pool: str | None = None) -> list[dict[str, Any]]:
    """The registered workers (of ``pool``), with the seconds since each was last seen."""
    with coordination.connect() as conn:
        conn.execute(WORKERS_TABLE)
        rows = conn.execute(
            "SELECT name, host, gpu, pool, info, extract(epoch FROM now() - seen_at) FROM qerl_workers "
            "WHERE %s::text IS NULL OR pool = %s ORDER BY name",
            (pool, pool),
        ).fetchall()
    return [
        {"name": r[0], "host": r[1], "gpu": r[2], "pool": r[3], "info": r[4], "age_s": float(r[5])}
        for r in rows
    ]


def run_worker(
    pool: str,
    gpu: str,
    work: Path,
    name: str | None = None,
    janitor_every_s: float = 30.0,
    retries: int = 3,
    grace_s: float = 60.0,
) -> int:
    """Prefect's process worker for ``gpu`` on ``pool`` plus this machine's registration and janitor
    (module docstring); returns the worker's exit status."""
    from qerl.flows import janitor
    from qerl.flows.orchestration import _stop, _stop_with_this_process

    if settings.database_url() is None:
        raise RuntimeError(f"qerl worker needs the coordination database: set {settings.FLEET_DB_ENV}")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a request line per janitor query otherwise
    name = name or f"{socket.gethostname()}-gpu{gpu}"
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": gpu,
        settings.GPU_ID_ENV: gpu,
        "QERL_WORK_DIR": str(work),
        "PREFECT_HOME": os.environ.get("PREFECT_HOME") or str(work / "prefect"),
    }
    for variable, value in RIDE_OUT.items():  # a night rides out a restart of a fleet's server
        env.setdefault(variable, value)
    cmd = [sys.executable, "-m", "prefect", "worker", "start", "--pool", pool, "--name", name]
    cmd += ["--limit", "1", "--type", "process"]
    child = subprocess.Popen(cmd, env=env, preexec_fn=_stop_with_this_process())
    info = machine_info(work)  # the code versions once: they change only with a restart
    print(
        f"qerl worker {name}: GPU {gpu}, pool {pool}, work dir {work} (Prefect worker pid {child.pid})",
        flush=True,
    )
    try:
        while child.poll() is None:
            try:
                with coordination.connect() as conn:
                    info["free_cache_bytes"] = shutil.disk_usage(work).free
                    _register(conn, name, gpu, pool, info)
                janitor.sweep(pool, retries=retries, grace_s=grace_s)
            except Exception as err:  # a restarting server: the worker goes on, the next pass retries
                log.warning("worker %s: registration or janitor pass failed: %s", name, err)
            deadline = time.monotonic() + janitor_every_s
            while child.poll() is None and time.monotonic() < deadline:
                time.sleep(0.5)
    finally:
        _stop(child)
    return child.returncode or 0


# ---- operator commands ------------------------------------------------------------------------
def _check(label: str, fn: Any) -> tuple[str, bool, str]:
    try:
        return label, True, str(fn() or "ok")
    except Exception as err:
        return label, False, f"{type(err).__name__}: {err}"


def _prefect_version() -> str:
    import httpx
    import prefect

    url = os.environ.get("PREFECT_API_URL")
    if not url:
        raise RuntimeError("PREFECT_API_URL is not set (the fleet's Prefect server)")
    server = httpx.get(f"{url.rstrip('/')}/admin/version", timeout=5).json()
    if server != prefect.__version__:
        raise RuntimeError(f"server {server}, this client {prefect.__version__}: pin one Prefect on all")
    return f"{server} at {url}"


def _ensure_pool(pool: str, gpus: int) -> str:
    from prefect import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate, WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(pool)
            made = "exists"
        except ObjectNotFound:
            try:
                client.create_work_pool(WorkPoolCreate(name=pool, type="process"))
            except ObjectAlreadyExists:
                pass
            made = "created"
        try:
            limit = client.read_global_concurrency_limit_by_name(GPU_LIMIT)
            from prefect.client.schemas.actions import GlobalConcurrencyLimitUpdate

            client.update_global_concurrency_limit(GPU_LIMIT, GlobalConcurrencyLimitUpdate(limit=gpus))
            was = f" (was {limit.limit})" if limit.limit != gpus else ""
        except ObjectNotFound:
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=GPU_LIMIT, limit=gpus))
            was = " (created)"
    return f"work pool '{pool}' {made}; global concurrency limit '{GPU_LIMIT}' = {gpus}{was}"


def _database() -> str:
    url = settings.database_url()
    if url is None:
        raise RuntimeError(f"{settings.FLEET_DB_ENV} is not set (the coordination database)")
    coordination.ensure_schema()
    with coordination.connect() as conn:
        conn.execute(WORKERS_TABLE)
        version = conn.execute("SHOW server_version").fetchone()[0]
    return f"PostgreSQL {version} at {settings.redact(url)}"


def _store(cfg: RunConfig | None) -> str:
    from qerl.pipeline.store.shared import open_shared

    if cfg is None or not cfg.store.uri:
        return "no store.uri in the config: each machine builds what it needs (pass --config)"
    shared = open_shared(cfg.store.uri)
    probe = f"fleet-check/{socket.gethostname()}-{os.getpid()}"
    shared.write(probe, b"qerl")
    if shared.read(probe) != b"qerl":
        raise RuntimeError(f"{shared.describe()}: what was written did not read back")
    return f"{shared.describe()} reads and writes"


def _mlflow(cfg: RunConfig | None) -> str:
    from mlflow.tracking import MlflowClient

    uri = (cfg.registry.tracking_uri if cfg else None) or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        return "no registry.tracking_uri: each machine would use its own sqlite file (set it for a fleet)"
    MlflowClient(tracking_uri=uri).search_experiments(max_results=1)
    return f"MLflow answers at {settings.redact(uri)}"


def init(pool: str, gpus: int, cfg: RunConfig | None) -> list[tuple[str, bool, str]]:
    """Create what a fleet needs on its services and check each; one (label, ok, what) per check."""
    checks = [_check("prefect", _prefect_version), _check("database", _database)]
    if checks[0][1]:
        checks.append(_check("pool", lambda: _ensure_pool(pool, gpus)))
    checks += [_check("store", lambda: _store(cfg)), _check("mlflow", lambda: _mlflow(cfg))]
    return checks


def doctor(pool: str | None, work: Path) -> list[str]:
    """One paragraph per registered worker: what differs from this machine, and what a resume there
    would rebuild; workers not seen for ``STALE_WORKER_S`` are said to be silent."""
    here = machine_info(work)
    lines = []
    for w in workers(pool):
        info, diffs = w["info"], []
        if info.get("qerl") != here["qerl"]:
            diffs.append(f"qerl {info.get('qerl')} (here {here['qerl']})")
        for dep, version in sorted(here["versions"].items()):
            if info.get("versions", {}).get(dep) != version:
                diffs.append(f"{dep} {info.get('versions', {}).get(dep)} (here {version})")
        rebuild = sorted(s for s, v in here["stages"].items() if info.get("stages", {}).get(s) != v)
        seen = f"seen {w['age_s']:.0f} s ago" + (" (silent)" if w["age_s"] > STALE_WORKER_S else "")
        free = info.get("free_cache_bytes", 0) / 2**30
        lines.append(
            f"{w['name']}  host {w['host']}, GPU {w['gpu']}, pool {w['pool']}, {seen}, {free:.1f} GiB free"
        )
        lines.append("  versions: " + ("; ".join(diffs) if diffs else "same as here"))
        lines.append(
            "  a resume there rebuilds: "
            + (
                f"stages {', '.join(rebuild)} and what follows them (their code differs)"
                if rebuild
                else "nothing"
            )
        )
    if not lines:
        lines.append("no worker has registered" + (f" on pool '{pool}'" if pool else ""))
    return lines
