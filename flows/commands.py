"""The commands that run flows, and ``qerl runs``: ``qerl run``, ``resume``, ``schedule``, ``ablate``.

The command line (``qerl.flows.cli``) has set Prefect's environment for the work directory before
this module is imported. ``run_flow`` is how a command runs the RL flow: on this process's Prefect
API (``qerl.flows.orchestration.use_api``), under the console (lines for people, the libraries'
chatter in ``run.log``); a second attempt at a run whose attempt is alive is refused before the
console touches that attempt's log. The outcome of a run is the run's, not its orchestrator's: a run
that completed while its Prefect server was lost returns its record all the same.

``qerl runs`` answers an operator's first question after a night: which runs finished, which failed
and why, which died mid-step and so which to resume. A record still saying ``running`` is a live
attempt when a process holds the run's lock, and an *interrupted* one (killed, the machine lost)
when none does; an attempt on another machine sharing the work dir is shown as such.
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import os
import sys
from pathlib import Path

from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
from qerl.flows import console, orchestration, report
from qerl.flows.ablate import ablate_flow, ablation_dir
from qerl.flows.run import rl_flow
from qerl.pipeline.config import key_payload
from qerl.pipeline.evaluation.arms import ablation_id, parse_arms
from qerl.pipeline.planning.prompt_stream import parse_night
from qerl.pipeline.planning.run_config import RunConfig, load_run_config
from qerl.pipeline.planning.runs import recorded_config, run_id_for, with_resources
from qerl.pipeline.registry import tracking
from qerl.pipeline.store import run_lock
from qerl.pipeline.store.layout import default_work_dir
from qerl.pipeline.store.run_record import RunRecord, load_record, previous_record, read_records, run_dir
from qerl.pipeline.store.upgrade import since_last_attempt

log = logging.getLogger("qerl.flow")


def work_dir(args: argparse.Namespace) -> Path:
    """``--work-dir``, else ``$QERL_WORK_DIR``, else ``./qerl-work``."""
    return default_work_dir(args.work_dir)


def run_flow(cfg: RunConfig, work: Path, night: dt.date | None = None) -> RunRecord:
    """Run (or continue: stages are cached) the run of ``cfg`` [on ``night``] and return its record."""
    orchestration.use_api()
    # the flow heartbeat only serves crash detection by a server's services: a second per flow for nothing
    with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        try:
            return rl_flow(
                config=cfg.model_dump(mode="json"),
                work_dir=str(work),
                night=night.isoformat() if night else None,
            )
        except Exception as err:
            if not orchestration.lost_connection(err):
                raise
            record = previous_record(work, run_id_for(cfg, night))
            if record is None or record.status != "completed":
                raise
            log.warning(
                "run %s completed; the Prefect server at %s was lost, so Prefect's record of flow run %s is "
                "stale (run.json and the registry hold the outcome)",
                record.run_id,
                orchestration.api_url(),
                record.flow_run_id,
            )
            return record


def _run(args: argparse.Namespace, cfg: RunConfig, work: Path, night: dt.date | None) -> int:
    rid = run_id_for(cfg, night)
    held = run_lock.holder(run_dir(work, rid))
    if held is not None:  # refused before the console appends to that attempt's run.log
        raise run_lock.busy(rid, held)
    with console.session(run_dir(work, rid) / console.LOG_NAME, args.verbose, keep_fds=True) as ui:
        ui.line(f"run {rid}: starting (details in {run_dir(work, rid) / console.LOG_NAME})")
        record = run_flow(cfg, work, night)
    for line in report.result_lines(record, work):
        print(line, flush=True)
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    cfg = load_run_config(args.config, args.set)
    return _run(args, cfg, work_dir(args), parse_night(args.night) if args.night else None)


def cmd_resume(args: argparse.Namespace) -> int:
    """Re-run a recorded run with its own config and night: completed stages come from the store."""
    work = work_dir(args)
    record = load_record(work, args.run_id)  # a mistyped id or --work-dir: an error, nothing made there
    cfg = recorded_config(record)
    for line in since_last_attempt(work, record):
        print(f"resume {args.run_id}: {line}", file=sys.stderr)
    if args.set:  # resource settings only: the same run, its finished steps reused
        cfg = with_resources(cfg, record.night, args.set)
    return _run(args, cfg, work, record.night)


def cmd_schedule(args: argparse.Namespace) -> int:
    """Serve the nightly deployment (the CLI pointed PREFECT_API_URL at ``--api-url`` already)."""
    cfg = load_run_config(args.config, args.set)
    work = work_dir(args)
    orchestration.schedule(cfg, work, args.cron, longest_attempt(work, cfg.loop.name), args.pool)
    return 0


def cmd_ablate(args: argparse.Namespace) -> int:
    """Run (or continue) an ablation with the console; the log is <work>/ablations/<id>/run.log."""
    cfg = load_run_config(args.config, args.set)
    work = work_dir(args)
    arms = parse_arms(args.arms)  # a bad --arms fails before Prefect starts
    aid = ablation_id(key_payload(cfg), arms, args.seeds)  # as ablate_flow computes it
    address, tracking_uri = _ablate_ray_checks(args, cfg, work)  # a bad cluster setup fails first
    if args.pool and (address or not os.environ.get("PREFECT_API_URL") or not cfg.store.uri):
        raise ValueError(
            "qerl ablate --pool submits to a fleet: it needs PREFECT_API_URL (the fleet's server) and "
            "store.uri, and no --ray"
        )
    params = {
        "config": cfg.model_dump(mode="json"),
        "work_dir": str(work),
        "arms": arms,
        "seeds": args.seeds,
        "n_boot": args.bootstrap,
        **({"pool": args.pool} if args.pool else {}),
    }
    out = ablation_dir(work, aid)
    with console.session(out / console.LOG_NAME, args.verbose, keep_fds=True) as ui:
        ui.line(f"ablation {aid}: {len(arms)} arms x {args.seeds} seeds (details in {out})")
        orchestration.use_api()
        with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
            if address is None:
                record = ablate_flow(**params)
            else:
                from qerl.flows.ray.connection import cluster

                with cluster(
                    address,
                    work,
                    tracking_uri,
                    args.cpus_per_run,
                    args.gpus_per_run,
                    cfg.rollout.tensor_parallel_size,
                ) as (task_runner, plan):
                    record = ablate_flow.with_options(task_runner=task_runner)(**params, ray=plan)
    print(f"ablation {aid}: {record['status']}", flush=True)
    for verdict in record.get("verdicts", []):
        print(f"  {verdict}", flush=True)
    print(f"  report: {record.get('report')}", flush=True)
    return 0


def _ablate_ray_checks(args: argparse.Namespace, cfg: RunConfig, work: Path) -> tuple[str | None, str]:
    """The Ray address (--ray, else $QERL_RAY_ADDRESS) and the resolved MLflow URI, with the static
    rules of qerl.flows.ray.rules checked before the flow starts."""
    from qerl.flows.ray import rules

    address = rules.resolve_address(args.ray)
    if address is None:
        return None, ""
    tracking_uri, _ = tracking.resolve_uris(cfg.registry, work)
    remote = bool(rules.address_is_remote(address))
    rules.check_settings(address, str(work), tracking_uri, os.environ.get("PREFECT_API_URL"), remote)
    rules.check_reachable(address)
    return address, tracking_uri


def run_state(work: Path, record: RunRecord) -> str:
    """``completed``, ``failed``, ``running (pid N on HOST, since T)``, ``running on HOST?`` (another
    machine's attempt, unseen) or ``interrupted`` (a running record with no attempt alive)."""
    if record.status != "running":
        return record.status
    folder = run_dir(work, record.run_id)
    held = run_lock.holder(folder)
    if held is not None:
        return f"running ({run_lock.describe(held)})"
    host = run_lock.other_host(folder)
    return f"running on {host}?" if host else "interrupted"


def _row(work: Path, record: RunRecord) -> list[str]:
    """The run's line and the lines under it (the error, the command that resumes it)."""
    state, accuracy, reg = run_state(work, record), record.final_accuracy, record.registration
    registered = f"v{reg.version}" + (" champion" if reg.promoted else "") if reg and reg.version else "-"
    updated = str(record.updated_at or record.started_at or "-")[:19]
    lines = [
        f"  {record.run_id:<34} {state:<12} night {str(record.night or '-'):<10}  "
        f"step {len(record.steps)}/{record.loop.get('steps', '?')}  "
        f"accuracy {'-' if accuracy is None else f'{accuracy:.3f}'}  {registered}  updated {updated}"
    ]
    if record.error and state == "failed":
        lines.append(f"      error: {record.error.splitlines()[0][:300]}")
    if state in ("failed", "interrupted"):
        lines.append(f"      resume: qerl resume {record.run_id}")
    return lines


def longest_attempt(work: Path, loop_name: str) -> tuple[float, str] | None:
    """(hours, run id) of the longest completed attempt of ``loop_name``'s runs in ``work``, from its
    record's start and last update (what ``loop.deadline_h`` bounds: one attempt); None when none."""
    longest = None
    for record in read_records(work)[0]:
        if record.status != "completed" or record.loop.get("name") != loop_name:
            continue
        try:
            start = dt.datetime.fromisoformat(str(record.started_at))
            end = dt.datetime.fromisoformat(str(record.updated_at))
        except ValueError:
            continue
        hours = (end - start).total_seconds() / 3600.0
        if longest is None or hours > longest[0]:
            longest = (hours, record.run_id)
    return longest


def cmd_runs(args: argparse.Namespace) -> int:
    """``qerl runs``: the work dir's runs, newest first (module docstring); it writes nothing but the
    records of a fleet's other machines it copies from the shared store (``pull_records``)."""
    if args.limit < 1:
        raise ValueError(f"--limit {args.limit}: must be at least 1 (--all shows every run)")
    work = work_dir(args)
    from qerl.flows.fleet import pull_records

    pull_records(work, args.store_uri)  # a fleet's runs, from every machine
    records, unreadable = read_records(work)
    if not records and not unreadable:
        print(f"{work}: no runs")
        return 0
    records.sort(key=lambda r: str(r.started_at or ""), reverse=True)
    shown = records if args.all else records[: args.limit]
    more = f", the newest {len(shown)} shown (--all for every one)" if len(shown) < len(records) else ""
    s = "" if len(unreadable) == 1 else "s"
    bad = f" and {len(unreadable)} unreadable record{s}" if unreadable else ""
    print(f"{work}: {len(records)} run{'' if len(records) == 1 else 's'}{bad}, newest first{more}")
    for record in shown:
        print(*_row(work, record), sep="\n")
    for path, why in unreadable:
        print(f"  {path.parent.name:<34} unreadable record ({why})")
    return 0
