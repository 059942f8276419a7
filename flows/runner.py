"""Running, resuming and scheduling the RL flow: Prefect settings and the nightly deployment.

Prefect keeps its state under ``<work>/prefect`` (PREFECT_HOME), so one work directory holds the
artifact store, the run records, the MLflow database and Prefect's own database. With no
PREFECT_API_URL the flow runs in Prefect's ephemeral mode (no server). The flow heartbeat is off
for ephemeral runs: it only serves crash detection by a server, and costs a second per flow.

Scheduling needs a real server (cron schedules are evaluated by its scheduler): ``qerl schedule``
refuses to run without PREFECT_API_URL and says how to start one on loopback. The deployment has
a concurrency limit of one, so a nightly run that overruns delays the next instead of overlapping.
Its flow runs are nightly runs (``nightly=True``): each takes its night from the flow run's
scheduled start, so every night is a new run (see ``flows.rl``); ``run(cfg, work, night)`` runs a
given night by hand (``qerl run --night DATE``), and ``resume`` re-runs a recorded run with its own
config and night.
"""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path
from typing import Any

from pipeline.runconfig import RunConfig

DEPLOYMENT_NAME = "nightly"


def prepare_environment(work: Path) -> None:
    """Point Prefect at the work directory; must run before ``prefect`` is imported."""
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PREFECT_HOME", str(work / "prefect"))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_TO_API_BATCH_INTERVAL", "0.5")
    # The temporary server's default 20 s start-up budget is too tight on a loaded 2-core box.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    # else the temporary server writes its memo under ~/.prefect, which need not exist (a warning each run)
    os.environ.setdefault("PREFECT_SERVER_MEMO_STORE_PATH", str(work / "prefect" / "memo_store.toml"))
    # vLLM's CPU backend reads this at import; small keeps two cores' worth of RAM free.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def run(cfg: RunConfig, work: Path, night: dt.date | None = None) -> dict[str, Any]:
    """Run (or continue: stages are cached) the flow for ``cfg`` in ``work``; returns the run record.

    ``night``: run that night's nightly run (warm start, the data cursor's next slice) instead of
    the plain run of ``cfg``."""
    prepare_environment(work)
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    from flows.rl import rl_flow

    with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        return rl_flow(
            config=cfg.model_dump(mode="json"), work_dir=str(work), night=night.isoformat() if night else None
        )


def recorded_run(run_id: str, work: Path) -> tuple[RunConfig, dt.date | None]:
    """The config and night of a recorded run (what ``resume`` re-runs)."""
    from flows.rl import load_run_record

    record = load_run_record(work, run_id)
    night = record.get("night")
    return RunConfig.model_validate(record["config"]), dt.date.fromisoformat(night) if night else None


def resume(run_id: str, work: Path) -> dict[str, Any]:
    """Re-run a recorded run with its own config (and night): completed stages come from the store."""
    cfg, night = recorded_run(run_id, work)
    return run(cfg, work, night)


def schedule(cfg: RunConfig, work: Path, cron: str) -> None:
    """Serve the nightly deployment on a Prefect server (blocks, like ``prefect ... serve``)."""
    if not os.environ.get("PREFECT_API_URL"):
        raise RuntimeError(
            "qerl schedule needs a Prefect server (cron schedules run in its scheduler). Start one on "
            "loopback with `prefect server start --host 127.0.0.1 --port 4200` and set "
            "PREFECT_API_URL=http://127.0.0.1:4200/api"
        )
    prepare_environment(work)
    from croniter import croniter

    if not croniter.is_valid(cron):
        raise ValueError(f"invalid cron expression '{cron}' (five fields, e.g. '0 2 * * *')")
    deployment = nightly_deployment(cfg, work, cron)
    from prefect import serve

    serve(deployment, limit=1)


def nightly_deployment(cfg: RunConfig, work: Path, cron: str) -> Any:
    """The deployment object (cron schedule, concurrency 1, parameters = config + work dir + nightly):
    each scheduled flow run is the nightly run of its scheduled date (see ``flows.rl``)."""
    from prefect.deployments.runner import EntrypointType

    from flows.rl import rl_flow

    return rl_flow.to_deployment(
        name=DEPLOYMENT_NAME,
        cron=cron,
        concurrency_limit=1,
        parameters={"config": cfg.model_dump(mode="json"), "work_dir": str(work), "nightly": True},
        description=f"nightly QeRL run '{cfg.loop.name}'",
        tags=["qerl", cfg.loop.name],
        entrypoint_type=EntrypointType.MODULE_PATH,
    )
