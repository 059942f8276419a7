"""Prefect around a run: its environment, the API it reports to, and the nightly deployment.

Environment. Prefect reads its settings once, at import, so ``prepare_environment(work)`` sets them
before the first import, once, at the entry point of a command that runs a flow (``qerl.flows.cli``):
Prefect's state under ``<work>/prefect`` (PREFECT_HOME), so one work directory holds the store, the
run records, the MLflow database and Prefect's database; no telemetry; few client retries.

The API. A run reports to one Prefect API (``use_api``): the server of PREFECT_API_URL, asked once
before the run starts (a server that is down fails the run in seconds, naming its URL), else a server
of the run's own: Prefect's ``prefect server start`` on a free loopback port, started once per
process in a process session of its own. So Ctrl-C, or a supervisor's SIGTERM to the terminal's
process group, reaches qerl, which records the run's outcome, and not the server, which still takes
the crash report; qerl's exit stops it (atexit), and on Linux so does qerl's death by SIGKILL or the
OOM killer (the parent-death signal). Its output goes where qerl's descriptors point: the run's log.

A lost API. Prefect treats its API as part of the run: when it stops answering, every call of the
flow engine retries with back-off, and at exit its event and log workers retry each queued item. A
run's outcome does not depend on it (``run.json`` and the store hold everything), so ``answers()``
asks the API once, briefly, where a call is about to be made, and remembers a silent one as lost for
the process: the run skips what only the orchestrator would have received, ends with its own
outcome, and the command exits without Prefect's exit handlers (``qerl.flows.cli.entry``).

Scheduling needs a real server (cron schedules run in its scheduler): ``schedule`` serves the
nightly deployment on the server at ``--api-url``, else PREFECT_API_URL, else ``LOOPBACK_API_URL``,
or, given a work pool, deploys it there and returns: the pool's workers run the nights
(``qerl.flows.fleet``).
The deployment has a concurrency limit of one, so a night that overruns delays the next instead of
overlapping it; each of its flow runs is the nightly run of its scheduled date (``qerl.flows.run``).
"""

from __future__ import annotations

import asyncio
import atexit
import ctypes
import datetime as dt
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qerl.pipeline.planning.run_config import RunConfig
from qerl.pipeline.runtime.errors import cause_chain

log = logging.getLogger("qerl.flow")

DEPLOYMENT_NAME = "nightly"
LOOPBACK_API_URL = "http://127.0.0.1:4200/api"
SERVER_START_S = 180.0  # a loaded 2-core machine migrates a fresh database in about a minute
_api: dict[str, Any] = {"url": None, "lost": False, "server": None}


def prepare_environment(work: Path) -> None:
    """Point Prefect at the work directory; before ``prefect`` is imported (module docstring). Nothing
    is created yet: a command that fails its checks leaves no work directory behind."""
    os.environ.setdefault("PREFECT_HOME", str(work / "prefect"))
    # a nightly tool that runs offline sends no usage data and so prints no telemetry notice
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("PREFECT_LOGGING_TO_API_BATCH_INTERVAL", "0.5")
    # Prefect's 5 retries with exponential back-off make each call to a lost server cost about a
    # minute; 2 (about 6 s) still ride out a restart of the server
    os.environ.setdefault("PREFECT_CLIENT_MAX_RETRIES", "2")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
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


def _stop(server: subprocess.Popen) -> None:
    if server.poll() is None:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()


def _start_server() -> str:
    """Prefect's own server on a free loopback port (module docstring); its API URL once it answers."""
    import httpx

    for _ in range(3):  # the port chosen can be taken before the server binds it: try another
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        cmd = [
            sys.executable,
            "-m",
            "prefect",
            "server",
            "start",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--no-ui",
            "--no-scheduler",
            "--no-late-runs",
            "--log-level",
            "WARNING",
        ]
        server = subprocess.Popen(cmd, start_new_session=True, preexec_fn=_stop_with_this_process())
        url, deadline = f"http://127.0.0.1:{port}/api", time.monotonic() + SERVER_START_S
        while server.poll() is None and time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                    atexit.register(_stop, server)
                    _api["server"] = server
                    log.info("Prefect server for this process on %s (pid %d)", url, server.pid)
                    return url
            except httpx.HTTPError:
                time.sleep(0.2)
        _stop(server)
    raise RuntimeError(
        f"the run's Prefect server did not start ({' '.join(cmd[1:6])} ...): see the run's log"
    )


def use_api(needed_for: str = "qerl run reports to the Prefect server of PREFECT_API_URL") -> str:
    """The Prefect API this process's runs report to (module docstring), made the one Prefect uses."""
    url = os.environ.get("PREFECT_API_URL")
    if url:
        check_api(url, needed_for=needed_for)
    else:
        Path(os.environ.get("PREFECT_HOME") or Path.home() / ".prefect").mkdir(parents=True, exist_ok=True)
        running = _api["server"] is not None and _api["server"].poll() is None
        url = _api["url"] if running else _start_server()
        os.environ["PREFECT_API_URL"] = url
        if "prefect.context" in sys.modules:  # imported already (an in-process caller): read it again
            from prefect.context import refresh_global_settings_context

            refresh_global_settings_context()
    _api.update(url=url, lost=False)
    return url


def answers(timeout_s: float = 2.0) -> bool:
    """Whether the API answers its health check within ``timeout_s`` (or, on a fleet's worker, within
    ``QERL_API_GRACE_S``: a server restart); a silent one is remembered as lost for the rest of the
    process (not asked again). True when no API is in use."""
    if _api["url"] is None:
        return True
    if _api["lost"]:
        return False
    import httpx

    grace = time.monotonic() + float(os.environ.get("QERL_API_GRACE_S") or 0)
    while True:
        try:
            httpx.get(f"{str(_api['url']).rstrip('/')}/health", timeout=timeout_s).raise_for_status()
            return True
        except httpx.HTTPError as err:
            if time.monotonic() < grace:
                time.sleep(1.0)
                continue
            _api["lost"] = True
            log.warning(
                "the Prefect server at %s stopped answering (%s): the run goes on without it",
                _api["url"],
                err,
            )
            _stop_api_logging()
            return False


def _stop_api_logging() -> None:
    """Detach Prefect's API log handlers: each record would otherwise be retried against the lost
    server and end as a report on the terminal. The records still reach the run's log."""
    from prefect.logging.handlers import APILogHandler

    for logger in [
        logging.getLogger(),
        *(logging.getLogger(n) for n in list(logging.root.manager.loggerDict)),
    ]:
        for handler in list(logger.handlers):
            if isinstance(handler, APILogHandler):
                logger.removeHandler(handler)


def lost() -> bool:
    """Whether the API was found silent (``answers``) in this process."""
    return bool(_api["lost"])


def api_url() -> str | None:
    return _api["url"]


def lost_connection(err: BaseException) -> bool:
    """Whether ``err`` comes from a transport error of a lost API (no answer at all)."""
    import httpx

    return any(isinstance(e, httpx.TransportError) for e in cause_chain(err)) and not answers()


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
            f"{needed_for}; none answers at {url} ({err}). Start one on loopback with `prefect server "
            "start --host 127.0.0.1 --port 4200`, or pass --api-url (or set PREFECT_API_URL) for another"
        ) from None


def schedule(
    cfg: RunConfig, work: Path, cron: str, longest: tuple[float, str] | None, pool: str | None = None
) -> None:
    """Serve the nightly deployment on the API of PREFECT_API_URL (set by the caller); blocks, like
    ``prefect ... serve``. ``longest``: the longest completed night here (hours, run id). With
    ``pool``, deploy it to that work pool instead and return (``qerl.flows.fleet``)."""
    from prefect import serve
    from prefect.client.schemas.schedules import CronSchedule

    try:
        CronSchedule(cron=cron)  # Prefect's own cron rules (its scheduler evaluates the schedule)
    except ValueError:
        raise ValueError(f"invalid cron expression '{cron}' (five fields, e.g. '0 2 * * *')") from None
    warning = deadline_warning(cfg.loop.deadline_h, cron, longest)
    if warning:
        print(f"qerl schedule: warning: {warning}", file=sys.stderr, flush=True)
    check_api(os.environ["PREFECT_API_URL"])
    if pool is not None:
        from qerl.flows.fleet import deploy_to_pool, nightly_name

        deployment_id = deploy_to_pool(cfg, cron, pool)
        print(
            f"qerl schedule: deployment qerl-rl/{nightly_name(cfg)} ({deployment_id}) on pool '{pool}', "
            f"'{cron}': `qerl worker --pool {pool} --gpu ID` on each GPU machine runs its nights",
            flush=True,
        )
        return
    serve(nightly_deployment(cfg, work, cron), limit=1)


def nights_gap_h(cron: str, nights: int = 16) -> float:
    """The shortest time between two consecutive nights of ``cron`` (UTC, hours) over the next
    ``nights``, by the rules of Prefect's scheduler, which fires them."""
    from prefect.server.schemas.schedules import CronSchedule as ServerCron

    dates = asyncio.run(ServerCron(cron=cron).get_dates(n=nights, start=dt.datetime.now(dt.UTC)))
    return min((b - a).total_seconds() for a, b in zip(dates, dates[1:], strict=False)) / 3600.0


def deadline_warning(
    deadline_h: float | None, cron: str, longest: tuple[float, str] | None = None
) -> str | None:
    """What ``qerl schedule`` warns about a night's deadline, each finding in turn: nights as long as
    the gap between two (``longest``: hours and run id of the longest completed attempt of these
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


def nightly_deployment(cfg: RunConfig, work: Path | None, cron: str) -> Any:
    """The deployment object (cron schedule, concurrency 1, parameters = config + work dir + nightly):
    each scheduled flow run is the nightly run of its scheduled date. ``work`` None: each flow run
    uses the work directory of the worker that runs it (a pool deployment, ``qerl.flows.fleet``)."""
    from prefect.deployments.runner import EntrypointType
    from qerl.flows.run import rl_flow

    return rl_flow.to_deployment(
        name=DEPLOYMENT_NAME,
        cron=cron,
        concurrency_limit=1,
        parameters={
            "config": cfg.model_dump(mode="json"),
            "work_dir": str(work) if work else None,
            "nightly": True,
        },
        description=f"nightly QeRL run '{cfg.loop.name}'",
        tags=["qerl", cfg.loop.name],
        entrypoint_type=EntrypointType.MODULE_PATH,
    )
