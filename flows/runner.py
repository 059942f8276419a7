"""Running, resuming and scheduling the RL flow: Prefect settings and the nightly deployment.

Prefect keeps its state under ``<work>/prefect`` (PREFECT_HOME), so one work directory holds the
artifact store, the run records, the MLflow database and Prefect's own database. With no
PREFECT_API_URL the flow runs in Prefect's ephemeral mode (no server). Before a run starts, the MLflow
registry and a configured Prefect API are asked once (bounded), so a server that is down fails the
run in seconds, naming its URI, instead of after training. The flow heartbeat is off
for ephemeral runs: it only serves crash detection by a server, and costs a second per flow.

Without PREFECT_API_URL, Prefect's clients start a temporary server (a uvicorn child) the first time
they need one. ``start_temporary_server`` starts that same instance first, in a session of its own.
Started by Prefect it would share the terminal's process group, so Ctrl-C (or a supervisor's SIGTERM
to the group) would stop it together with qerl, and Prefect's crash handling would then retry
reporting the crash to the dead server for minutes before printing pages of connection tracebacks.
In its own session the server outlives the signal and takes the crash report; Prefect's atexit stops
it, and on Linux the parent-death signal stops it when qerl is killed outright (SIGKILL, the OOM
killer), which no atexit can.

Scheduling needs a real server (cron schedules are evaluated by its scheduler): ``qerl schedule``
serves on the server at ``--api-url``, else PREFECT_API_URL, else the loopback one that
``prefect server start --host 127.0.0.1 --port 4200`` starts (``LOOPBACK_API_URL``); it checks that
the server answers before it serves, and refuses with the URL and how to start one. The deployment has
a concurrency limit of one, so a nightly run that overruns delays the next instead of overlapping.
Its flow runs are nightly runs (``nightly=True``): each takes its night from the flow run's
scheduled start, so every night is a new run (see ``qerl.flows.rl``); ``run(cfg, work, night)`` runs a
given night by hand (``qerl run --night DATE``), and ``resume`` re-runs a recorded run with its own
config and night.
"""

from __future__ import annotations

import ctypes
import datetime as dt
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qerl.pipeline.planning.run_config import RunConfig

DEPLOYMENT_NAME = "nightly"
LOOPBACK_API_URL = "http://127.0.0.1:4200/api"


def prepare_environment(work: Path) -> None:
    """Point Prefect at the work directory; must run before ``prefect`` is imported."""
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PREFECT_HOME", str(work / "prefect"))
    # A nightly tool that runs offline sends no usage data (server and client side) and so prints no
    # telemetry notice; a user who wants Prefect's telemetry sets these variables.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("PREFECT_LOGGING_TO_API_BATCH_INTERVAL", "0.5")
    # Prefect's 5 retries with exponential back-off make each call to a lost server cost about a
    # minute; 2 (about 6 s) still ride out a restart of the server (qerl.flows.orchestrator).
    os.environ.setdefault("PREFECT_CLIENT_MAX_RETRIES", "2")
    # The temporary server's default 20 s start-up budget is too tight on a loaded 2-core box.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    # else the temporary server writes its memo under ~/.prefect, which need not exist (a warning each run)
    os.environ.setdefault("PREFECT_SERVER_MEMO_STORE_PATH", str(work / "prefect" / "memo_store.toml"))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _stop_with_this_process() -> Callable[[], None] | None:
    """A preexec_fn that has the child get SIGTERM when this process dies (Linux; else None)."""
    if not sys.platform.startswith("linux"):
        return None
    prctl, parent = ctypes.CDLL(None, use_errno=True).prctl, os.getpid()  # resolved before the fork
    pr_set_pdeathsig, sigterm = 1, int(signal.SIGTERM)

    def preexec() -> None:
        prctl(pr_set_pdeathsig, sigterm)
        if os.getppid() != parent:  # this process died before prctl took effect
            os._exit(1)

    return preexec


class _OwnSessionSubprocess:
    """``subprocess`` as prefect.server.api.server sees it while it starts the server: Popen in a
    session of its own, stopped with this process."""

    def __getattr__(self, name: str) -> Any:
        return getattr(subprocess, name)

    @staticmethod
    def Popen(*args: Any, **kwargs: Any) -> subprocess.Popen:  # noqa: N802 - subprocess's name
        return subprocess.Popen(*args, start_new_session=True, preexec_fn=_stop_with_this_process(), **kwargs)


def start_temporary_server() -> str | None:
    """Start Prefect's temporary server now, detached from the terminal's signals (module docstring);
    its API URL, or None when PREFECT_API_URL names a server. Call from the thread that lives until
    exit (the main thread): the parent-death signal follows the thread that started the child."""
    from unittest import mock

    from prefect.server.api import server as prefect_server
    from prefect.settings import PREFECT_API_URL

    if PREFECT_API_URL.value():
        return None
    server = prefect_server.SubprocessASGIServer()  # the instance every Prefect client would start
    if not server.running:
        with mock.patch.object(prefect_server, "subprocess", _OwnSessionSubprocess()):
            server.start()
    return server.api_url


def run(cfg: RunConfig, work: Path, night: dt.date | None = None) -> dict[str, Any]:
    """Run (or continue: stages are cached) the flow for ``cfg`` in ``work``; returns the run record.

    ``night``: run that night's nightly run (warm start, the data cursor's next slice) instead of
    the plain run of ``cfg``."""
    prepare_environment(work)
    from prefect.settings import PREFECT_API_URL, PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
    from qerl.flows import orchestrator
    from qerl.flows.rl import rl_flow
    from qerl.pipeline.registry import tracking

    # before anything starts: a dead registry or Prefect server fails now, naming its URI
    tracking.check_reachable(cfg.registry, work)
    if PREFECT_API_URL.value():
        check_api(
            PREFECT_API_URL.value(), needed_for="qerl run reports to the Prefect server of PREFECT_API_URL"
        )
    orchestrator.use(PREFECT_API_URL.value() or start_temporary_server())
    with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        try:
            return rl_flow(
                config=cfg.model_dump(mode="json"),
                work_dir=str(work),
                night=night.isoformat() if night else None,
            )
        except Exception as err:
            record = _completed_without_orchestrator(cfg, work, night, err)
            if record is None:
                raise
            return record


def _completed_without_orchestrator(
    cfg: RunConfig, work: Path, night: dt.date | None, err: Exception
) -> dict[str, Any] | None:
    """The run's record when ``err`` is only Prefect failing to reach a lost server about a run that
    completed (its record says so); None otherwise. The outcome of a run is the run's, not its
    orchestrator's (``qerl.flows.orchestrator``)."""
    from qerl.flows import orchestrator
    from qerl.flows.run_record import load_run_record, run_id_for

    if not orchestrator.caused_by_connection(err) or orchestrator.answers():
        return None
    try:
        record = load_run_record(work, run_id_for(cfg, night))
    except (OSError, ValueError, KeyError):
        return None
    if record.get("status") != "completed":
        return None
    orchestrator.log.warning(
        "run %s completed; the Prefect server at %s was lost, so Prefect's record of flow run %s is stale "
        "(run.json and the registry hold the outcome)", record["run_id"], orchestrator.url(), record.get("flow_run_id"),
    )  # fmt: skip
    return record


def recorded_run(run_id: str, work: Path) -> tuple[RunConfig, dt.date | None]:
    """The config and night of a recorded run (what ``resume`` re-runs)."""
    from qerl.flows.run_record import load_run_record

    record = load_run_record(work, run_id)
    night = record.get("night")
    return RunConfig.model_validate(record["config"]), dt.date.fromisoformat(night) if night else None


def resume(run_id: str, work: Path) -> dict[str, Any]:
    """Re-run a recorded run with its own config (and night): completed stages come from the store."""
    cfg, night = recorded_run(run_id, work)
    return run(cfg, work, night)


def schedule(cfg: RunConfig, work: Path, cron: str, api_url: str | None = None) -> None:
    """Serve the nightly deployment on the Prefect server at ``api_url`` (default: PREFECT_API_URL,
    else ``LOOPBACK_API_URL``); blocks, like ``prefect ... serve``."""
    url = api_url or os.environ.get("PREFECT_API_URL") or LOOPBACK_API_URL
    os.environ["PREFECT_API_URL"] = url  # before Prefect is imported: it reads its settings once
    prepare_environment(work)
    from prefect.client.schemas.schedules import CronSchedule

    try:
        CronSchedule(cron=cron)  # Prefect's own cron rules (its scheduler evaluates the schedule)
    except ValueError:
        raise ValueError(f"invalid cron expression '{cron}' (five fields, e.g. '0 2 * * *')") from None
    from qerl.flows.run_commands import longest_attempt

    warning = deadline_warning(cfg.loop.deadline_h, cron, longest_attempt(work, cfg.loop.name))
    if warning:
        print(f"qerl schedule: warning: {warning}", file=sys.stderr, flush=True)
    check_api(url)
    deployment = nightly_deployment(cfg, work, cron)
    from prefect import serve

    serve(deployment, limit=1)


def nights_gap_h(cron: str, nights: int = 16) -> float:
    """The shortest time between two consecutive nights of ``cron`` (UTC, hours) over the next
    ``nights``, by the rules of Prefect's scheduler, which fires them."""
    import asyncio

    from prefect.server.schemas.schedules import CronSchedule as ServerCron

    dates = asyncio.run(ServerCron(cron=cron).get_dates(n=nights, start=dt.datetime.now(dt.UTC)))
    return min((b - a).total_seconds() for a, b in zip(dates, dates[1:], strict=False)) / 3600.0


def deadline_warning(
    deadline_h: float | None, cron: str, longest: tuple[float, str] | None = None
) -> str | None:
    """What ``qerl schedule`` warns about a night's deadline, each finding in turn: nights as long
    as the gap between two (``longest``: hours and run id of the longest completed attempt of these
    nights in the work dir), no deadline, a deadline that lets a night run into the next (the
    deployment runs one night at a time, so both hold the next night back), or one that would have
    stopped ``longest``; None when none holds."""
    gap = nights_gap_h(cron)
    hint = f"--set loop.deadline_h={max(int(gap * 0.9), 1) if gap >= 2 else round(gap * 0.9, 2):g}"
    took = f"the longest completed night here ({longest[1]}) took {longest[0]:.2f} h" if longest else ""
    found = []
    if longest is not None and longest[0] >= gap:
        found.append(
            f"{took}, not less than the {gap:g} h between two nights of '{cron}': each such night delays the next"
        )
    if deadline_h is None:
        found.append(
            f"loop.deadline_h is unset: a night that hangs holds back every later night (one night runs "
            f"at a time; '{cron}' starts one every {gap:g} h at the closest). Set a deadline below that, "
            f"e.g. {hint}" + (f" ({took})" if took and not found else "")
        )
    elif deadline_h >= gap:
        found.append(
            f"loop.deadline_h = {deadline_h:g} h is not below the {gap:g} h between two nights of "
            f"'{cron}': a night that runs to its deadline delays the next one (e.g. {hint})"
        )
    elif longest is not None and deadline_h <= longest[0]:
        found.append(
            f"loop.deadline_h = {deadline_h:g} h would have stopped a night like the longest here: {took}"
        )
    return "; ".join(found) or None


def check_api(
    url: str,
    timeout_s: float = 5.0,
    needed_for: str = "qerl schedule needs a Prefect server (cron schedules run in its scheduler)",
) -> None:
    """A RuntimeError naming ``url`` and how to start a server, unless a Prefect API answers there."""
    import httpx

    try:
        httpx.get(f"{url.rstrip('/')}/health", timeout=timeout_s).raise_for_status()
    except httpx.HTTPError as err:
        raise RuntimeError(
            f"{needed_for}; none answers at "
            f"{url} ({err}). Start one on loopback with `prefect server start --host 127.0.0.1 --port 4200`, "
            f"or pass --api-url (or set PREFECT_API_URL) for another"
        ) from None


def nightly_deployment(cfg: RunConfig, work: Path, cron: str) -> Any:
    """The deployment object (cron schedule, concurrency 1, parameters = config + work dir + nightly):
    each scheduled flow run is the nightly run of its scheduled date (see ``qerl.flows.rl``)."""
    from prefect.deployments.runner import EntrypointType
    from qerl.flows.rl import rl_flow

    return rl_flow.to_deployment(
        name=DEPLOYMENT_NAME,
        cron=cron,
        concurrency_limit=1,
        parameters={"config": cfg.model_dump(mode="json"), "work_dir": str(work), "nightly": True},
        description=f"nightly QeRL run '{cfg.loop.name}'",
        tags=["qerl", cfg.loop.name],
        entrypoint_type=EntrypointType.MODULE_PATH,
    )
