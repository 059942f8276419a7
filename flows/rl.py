"""The RL flow: quantize once, then N steps of rollout -> score -> train, evaluate, register.

Prefect lives only in ``qerl.flows``. Every task wraps one stage (``qerl.flows.rl_tasks``); the stages
cache themselves in the content-addressed store, so resumption is exact: a re-run of the same config
(``qerl run`` again or ``qerl resume RUN``) finds every finished stage under its key and executes only
what is missing, down to the half-done step. The phases of a run are ``qerl.flows.rl_phases``; its
record (``<work>/runs/<run_id>/run.json``) and id are ``qerl.flows.run_record``. An attempt at a run
holds its lock (``qerl.pipeline.store.run_lock``) from start to end: a second attempt at the same
run is refused while the first lives; one that passes ``loop.deadline_h`` is stopped
(``qerl.flows.deadline``).

The run's data is read first, so a malformed file fails the run before the base model is fetched or
quantized. The rollout engine is built once per run (vLLM startup is the expensive part) and handed
to the rollout and evaluate tasks; it takes each step's adapter version and AQN sigma; its start-up
time is counted apart (``TimedEngine``) so that the console's ETA leaves it out. Every run writes its
``run.log``: under ``qerl run`` the console session does, a deployment run (no session) attaches the
file itself (``qerl.flows.console.attach_run_log``). Only transient failures retry; a config error,
a misconfigured engine or bad data fails the run at once, and the run record says where. A run that
dies is continued by ``qerl resume RUN``.

Two kinds of run:

- a plain run (``qerl run``): its id is ``<loop.name>-<config hash>``, so the same config is the same
  run; it trains from a fresh LoRA on the first ``loop.steps`` slots of the data stream;
- a nightly run (the ``qerl schedule`` deployment, or ``qerl run --night DATE``): its id adds the
  night (``-YYYYMMDD``, from Prefect's scheduled start time), so every night is a new run and a re-run
  of the same night is that night's run. It warm-starts from the champion (``loop.warm_start``),
  trains on the next slice of the data cursor, evaluates, registers and promotes only on a win; the
  cursor advances when the night completes (``qerl.pipeline.planning.prompt_stream`` has the rules).

A run of an ablation (``qerl.flows.ablate``, ``qerl ablate``) is a plain run with an ``ablation`` argument
(its id, the arm, the MLflow parent run): these become lineage tags (``ablation_id``, ``arm``) and the
registered version takes no alias, so an ablation never moves the champion.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from prefect import flow
from prefect.runtime import flow_run
from qerl.flows import console, deadline
from qerl.flows.rl_phases import (
    Run,
    TimedEngine,
    evaluate_adapter,
    load_data,
    measure_quality,
    open_live,
    plan_data,
    prepare_base,
    read_data,
    train_loop,
)
from qerl.flows.rl_register import register_final
from qerl.flows.run_record import lift_entry, publish, run_dir
from qerl.pipeline.planning.disk_plan import check_disk
from qerl.pipeline.planning.errors import RunPlanError
from qerl.pipeline.planning.prompt_stream import DataCursor, parse_night
from qerl.pipeline.planning.run_config import RunConfig
from qerl.pipeline.registry import live, release, tracking
from qerl.pipeline.store import retention, run_lock
from qerl.pipeline.store.layout import default_work_dir
from qerl.stages import train


@flow(name="qerl-rl", log_prints=True)
def rl_flow(
    config: dict[str, Any], work_dir: str, nightly: bool = False, night: str | None = None,
    ablation: dict[str, Any] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """One QeRL run (see the module docstring); returns the run record.

    ``nightly``: a nightly run for the night Prefect scheduled this flow run for; ``night``
    (``YYYY-MM-DD``) names the night explicitly (and implies ``nightly``). ``ablation``: ``{"id",
    "arm", "parent_run_id"}`` of the ablation this run belongs to (never promoted)."""
    cfg = RunConfig.model_validate(config)
    if ablation is not None and (nightly or night):
        raise RunPlanError("an ablation run is a plain run, not a nightly one")
    run = Run(cfg, default_work_dir(work_dir), _resolve_night(nightly, night), ablation)
    with run_lock.hold(run_dir(run.work, run.run_id), run.run_id):  # one attempt at a time
        cancel = deadline.arm(run, cfg.loop.deadline_h)  # a hung attempt is stopped, not waited for
        try:
            return _attempt(run)
        finally:
            cancel()


def _attempt(run: Run) -> dict[str, Any]:
    """One attempt at ``run``, under its lock: the phases, the record, the retention passes."""
    cfg, rec = run.cfg, run.record
    detach_log = console.attach_run_log(run_dir(run.work, run.run_id))  # a scheduled night's run.log
    run.logger.info("run %s: started (flow run %s)", run.run_id, rec["flow_run_id"])
    run.save()
    engine, failure = None, None
    try:
        tracking.check_reachable(cfg.registry, run.work)  # a dead registry fails now, not after training
        rec["disk_estimate"] = check_disk(cfg, run.work)  # refuses a run that cannot fit, with the numbers
        rows = read_data(run)  # before anything is built: bad data fails the run here
        quantized, twin = prepare_base(run)
        # started by the first stage that generates; a run with AQN gets an engine that holds it exactly
        engine = TimedEngine(cfg.rollout, quantized, twin, aqn=cfg.aqn.active)
        rec["engine_mode"] = engine.mode
        run.logger.info("run %s: engine mode %s, work dir %s", run.run_id, engine.mode, run.work)
        problems = load_data(run, quantized, twin, rows)
        measure_quality(run, quantized)  # on the validation texts, before the engine takes its memory
        warm = plan_data(run, quantized, problems)
        open_live(run)  # the MLflow run gets each step as it ends
        run.save()  # its id on disk now: an attempt killed before its first step resumes in that run
        final = train_loop(run, quantized, engine, problems, warm)
        final_eval = evaluate_adapter(run, quantized, final, engine, cfg.loop.steps, run.validation)
        baseline = (
            evaluate_adapter(run, quantized, None, engine, 0, run.validation) if cfg.loop.eval_base else None
        )
        register_final(run, quantized, final, final_eval, engine)
        rec["final_adapter"] = str(final.dir / "adapter")
        rec["baseline_accuracy"] = baseline.metrics.get("accuracy") if baseline else None
        rec["lift"] = lift_entry(final_eval, baseline) if baseline else None
        rec["final_accuracy"] = final_eval.metrics.get("accuracy")
        rec["status"] = "completed"
        run.park_if_stopped()
        if run.night is not None:  # only a completed night consumes its slice
            cursor = DataCursor(run.work, cfg.loop.name)
            rec["plan"]["cursor_after"] = cursor.advance(
                rec["plan"]["stream"], rec["plan"]["end_slot"], run.run_id
            )
    except BaseException as err:
        failure = err
        rec["status"] = "failed"
        rec["error"] = f"{type(err).__name__}: {err}"
        raise
    finally:
        run.save()
        if run.live is not None:
            live.end_run(run.live, failed=failure is not None)
        if engine is not None:
            engine.close()
        train.drop_resident_policy()  # a serving process (qerl schedule) must not keep it across nights
        publish(rec)
        detach_log(failure)
    retention.prune_run(run.work, run.run_id, cfg.store)  # completed: no optimizer state stays
    freed, released = release.release_old_versions(run.work)  # store.keep_versions: older nights go
    if released:
        run.ui.line(
            f"{'retention':<11} released {', '.join(released)} (store.keep_versions), {retention.human_bytes(freed)} freed"
        )
    return rec


def _resolve_night(nightly: bool, night: str | None) -> _dt.date | None:
    """The night of a nightly run: explicit, else the scheduled start of this Prefect flow run."""
    if night:
        return parse_night(night)
    if not nightly:
        return None
    scheduled = flow_run.scheduled_start_time
    if scheduled is None:
        raise RunPlanError("a nightly run needs a night: pass night=YYYY-MM-DD or run it from the deployment")
    return parse_night(scheduled)
