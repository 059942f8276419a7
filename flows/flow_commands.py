"""The commands that run a Prefect flow: ``qerl run``, ``resume``, ``schedule`` and ``ablate``.

Each sets Prefect's environment for the work directory (``runner.prepare_environment``) before
anything imports Prefect, runs the flow under the console (``flows/console.py``: lines for people,
the libraries' chatter in ``run.log``) and prints the result. Static checks that need no Prefect (the
config, ``--arms``, the Ray cluster's settings, and for ``run``/``resume`` the rows of the run's local
data files, ``_check_data``) run first, so a mistake fails before a server starts or a model is built,
in one line (a malformed file is named by path and line).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from qerl.flows.tool_commands import work_dir


def cmd_ablate(args: argparse.Namespace) -> int:
    """Run (or continue) an ablation with the console; the log is <work>/ablations/<id>/run.log."""
    from pathlib import Path

    from qerl.flows import console, runner
    from qerl.pipeline.config import key_payload
    from qerl.pipeline.evaluation.arms import ablation_id, parse_arms
    from qerl.pipeline.planning.run_config import load_run_config

    cfg = load_run_config(args.config, args.set)
    work = Path(work_dir(args)).resolve()
    arms = parse_arms(args.arms)  # a bad --arms fails before Prefect starts
    aid = ablation_id(key_payload(cfg), arms, args.seeds)  # as ablate_flow computes it
    runner.prepare_environment(work)
    address, tracking_uri = _ablate_ray_checks(args, cfg, work)  # a bad cluster setup fails before the flow
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
    from qerl.flows.ablate import ablate_flow, ablation_dir

    params = {
        "config": cfg.model_dump(mode="json"), "work_dir": str(work), "arms": arms, "seeds": args.seeds,
        "n_boot": args.bootstrap,
    }  # fmt: skip
    with console.session(ablation_dir(work, aid), verbose=args.verbose) as ui:
        ui.line(
            f"ablation {aid}: {len(arms)} arms x {args.seeds} seeds (details in {ablation_dir(work, aid)})"
        )
        runner.start_temporary_server()
        with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
            if address is None:
                record = ablate_flow(**params)
            else:
                from qerl.flows.ray.connection import cluster

                with cluster(
                    address, work, tracking_uri, args.cpus_per_run, args.gpus_per_run,
                    cfg.rollout.tensor_parallel_size,
                ) as (task_runner, plan):  # fmt: skip
                    record = ablate_flow.with_options(task_runner=task_runner)(**params, ray=plan)
    print(f"ablation {aid}: {record['status']}", flush=True)
    for verdict in record.get("verdicts", []):
        print(f"  {verdict}", flush=True)
    print(f"  report: {record.get('report')}", flush=True)
    return 0


def _ablate_ray_checks(args: argparse.Namespace, cfg: Any, work: Any) -> tuple[str | None, str]:
    """The Ray address (--ray, else $QERL_RAY_ADDRESS) and the resolved MLflow URI, with the static rules
    of qerl.flows.ray.rules checked before the flow starts."""
    from qerl.flows.ray import rules

    address = rules.resolve_address(args.ray)
    if address is None:
        return None, ""
    from qerl.pipeline.registry import tracking as registry

    tracking_uri, _ = registry.resolve_uris(cfg.registry, work)
    remote = bool(rules.address_is_remote(address))
    rules.check_settings(address, str(work), tracking_uri, os.environ.get("PREFECT_API_URL"), remote)
    rules.check_reachable(address)
    return address, tracking_uri


def _print_run(record: dict, work: str) -> None:
    """The run's result for people: the last thing ``qerl run``/``qerl resume`` prints."""
    from pathlib import Path

    from qerl.flows.run_record import earlier_registration, eval_text, lift_line, registered_line
    from qerl.pipeline.store.layout import MLFLOW_DB, RUN_RECORD, RUNS_DIR

    def say(text: str) -> None:
        print(text, flush=True)

    reg = record.get("registration") or {}
    night = f", night {record['night']}" if record.get("night") else ""
    say(f"run {record['run_id']}: {record['status']} (engine mode {record.get('engine_mode')}{night})")
    data = record.get("data") or {}
    if data.get("dropped_too_long"):
        say(f"  data: {data['kept']} problems, {data['dropped_too_long']} dropped (prompt > {data['prompt_token_limit']} tokens)")  # fmt: skip
    warm = (record.get("plan") or {}).get("warm_start") or {}
    if warm.get("version"):
        say(f"  warm start: {reg.get('model_name') or 'adapter'} v{warm['version']}")
    for e in record.get("evaluations", []):
        who = "base (no adapter)" if e["adapter"] is None else f"adapter after step {e['step']}"
        say(f"  {eval_text(e)}  {who}")
    if record.get("lift"):
        say(f"  {lift_line(record['lift'])}")
    if reg:
        by = earlier_registration(record)
        say(f"  {registered_line(reg, by)}")
        if reg.get("promotion"):
            say(f"  promotion{'' if by is None else f' (run {by})'}: {reg['promotion']}")
    run_path = Path(work) / RUNS_DIR / record["run_id"]
    say(f"  run record: {run_path / RUN_RECORD}")
    say(f"  log:        {run_path / 'run.log'}")
    say(f"  adapter:    {record.get('final_adapter')}")
    uri = ((record.get("config") or {}).get("registry") or {}).get("tracking_uri") or ""
    if uri.startswith(("http://", "https://")):  # a tracking server serves its own UI
        say(f"  MLflow UI:  {uri}")
    else:  # a database URI may hold a password: name the setting, not its value
        store = "<registry.tracking_uri>" if uri else f"sqlite:///{Path(work) / MLFLOW_DB}"
        say(f"  MLflow UI:  mlflow ui --backend-store-uri {store}")


def _check_data(cfg: Any) -> None:
    """Read the rows of the run's local data files (training data, evaluation benchmarks): a malformed
    one is a ValueError naming it (``path:line`` for a line that is no JSON object) before anything
    starts. Generated (arithmetic) and hub datasets are left to the flow, which reads its training
    data before it builds anything too."""
    from qerl.pipeline.data.datasets import NAMED, data_root, load_problems

    for data, split in [(cfg.data, "train"), (cfg.eval.benchmark, None), *((b, None) for b in cfg.eval.also)]:
        if data.dataset != "arithmetic" and not (data.dataset in NAMED and data_root(data) is None):
            load_problems(data, split)


def _run_with_console(args: argparse.Namespace, cfg: Any, work: Any, night: Any) -> int:
    """Run the flow with the console (flows/console.py): lines for people, chatter in run.log."""
    from qerl.flows import console, runner

    _check_data(cfg)
    # before qerl.flows.run_record imports Prefect, which reads its settings once
    runner.prepare_environment(work)
    from qerl.flows.run_record import run_dir, run_id_for
    from qerl.pipeline.store import run_lock

    rid = run_id_for(cfg, night)
    held = run_lock.holder(run_dir(work, rid))
    if held is not None:  # refused before the console appends to that attempt's run.log
        raise run_lock.busy(rid, held)
    with console.session(run_dir(work, rid), verbose=args.verbose) as ui:
        ui.line(f"run {rid}: starting (details in {run_dir(work, rid) / console.LOG_NAME})")
        record = runner.run(cfg, work, night)
    _print_run(record, str(work))
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from qerl.pipeline.planning.prompt_stream import parse_night
    from qerl.pipeline.planning.run_config import load_run_config

    cfg = load_run_config(args.config, args.set)
    work = Path(work_dir(args)).resolve()
    return _run_with_console(args, cfg, work, parse_night(args.night) if args.night else None)


def cmd_resume(args: argparse.Namespace) -> int:
    from pathlib import Path

    from qerl.flows import runner
    from qerl.pipeline.store.layout import recorded_run

    work = Path(work_dir(args)).resolve()
    recorded_run(work, args.run_id)  # a mistyped id or --work-dir: an error, and nothing made there
    runner.prepare_environment(work)  # runner.recorded_run imports Prefect
    cfg, night = runner.recorded_run(args.run_id, work)
    from qerl.flows.run_record import load_run_record
    from qerl.flows.upgrade_check import since_last_attempt

    for line in since_last_attempt(work, load_run_record(work, args.run_id)):
        print(f"resume {args.run_id}: {line}", file=sys.stderr)
    if args.set:  # resource settings only: the same run, its finished steps reused
        from qerl.flows.run_record import with_resources

        cfg = with_resources(cfg, night, args.set)
    return _run_with_console(args, cfg, work, night)


def cmd_schedule(args: argparse.Namespace) -> int:
    from pathlib import Path

    from qerl.flows import runner
    from qerl.pipeline.planning.run_config import load_run_config

    cfg = load_run_config(args.config, args.set)
    runner.schedule(cfg, Path(work_dir(args)).resolve(), args.cron, args.api_url)
    return 0
