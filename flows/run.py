"""One QeRL run, top to bottom: quantize once, then N steps of rollout -> score -> train, evaluate,
register.

``rl_flow`` is the one way a run starts: ``qerl run``, ``qerl resume``, ``qerl run --night``, an
ablation's arm and every scheduled night (the deployment runs this flow) all call it. It takes the
run's lock (one attempt at a time, ``qerl.pipeline.store.run_lock``), arms its deadline
(``loop.deadline_h``, ``qerl.flows.deadline``) and goes through the phases of ``attempt`` in order.
Everything the run decides and measures goes into its typed record (``RunRecord``,
``<work>/runs/<run_id>/run.json``), saved after every phase and step; the phases pass what they
build to the next as values.

The stages cache themselves in the content-addressed store, so resumption is exact: a re-run of the
same config (``qerl run`` again or ``qerl resume RUN``) finds every finished stage under its key and
executes only what is missing, down to the half-done step. Each check is made once, inside the
attempt, so a scheduled night gets them too: the registry must answer, the run must fit the disk,
and the data is read before anything is built (a malformed file fails the run first). The rollout
engine is built on first use (a re-run whose stages are all cached starts no vLLM) and serves every
step and evaluation; its start-up is counted apart, so the console's ETA leaves it out. Only
transient failures retry (``qerl.flows.tasks``); a run that dies is continued by ``qerl resume``.

Two kinds of run:

- a plain run: its id is ``<loop.name>-<config hash>`` (``qerl.pipeline.planning.runs``), so the
  same config is the same run; it trains from a fresh LoRA on the first ``loop.steps`` slots of the
  data stream;
- a nightly run: its id adds the night (``-YYYYMMDD``, from Prefect's scheduled start time, or
  ``--night``), so every night is a new run. It warm-starts from the champion (``loop.warm_start``),
  trains on the next slice of the data cursor, evaluates, registers and promotes only on a win; the
  cursor advances when the night completes (``qerl.pipeline.planning.prompt_stream``).

An ablation's run is a plain run with an ``ablation`` argument (its id, the arm, the MLflow parent
run): lineage tags, and its registered version takes no alias, so an ablation never moves the
champion.

The phases that need more room than a function live beside this module: the step loop and the
chain of checkpoints (``qerl.flows.steps``), the registration and its evidence
(``qerl.flows.promotion``); what an attempt carries is ``qerl.flows.attempt``.
"""

from __future__ import annotations

import datetime as _dt
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from qerl.flows import console, deadline, fleet, orchestration, report, tasks
from qerl.flows.attempt import Base, Clock, Run, parent_tags
from qerl.flows.promotion import register
from qerl.flows.steps import evaluate, train_steps
from qerl.pipeline.data.datasets import load_problems, problems_digest
from qerl.pipeline.evaluation.eval_config import validation_split
from qerl.pipeline.nvfp4.quality_report import quality_brief, quality_line, quality_metrics
from qerl.pipeline.planning.disk_plan import check_disk
from qerl.pipeline.planning.engine_setup import needs_twin
from qerl.pipeline.planning.errors import RunPlanError
from qerl.pipeline.planning.prompt_fit import fit_prompts, load_tokenizer, prompt_token_limit
from qerl.pipeline.planning.prompt_stream import DataCursor, data_slice, parse_night, stream_key
from qerl.pipeline.planning.run_checks import check_model
from qerl.pipeline.planning.run_config import RunConfig
from qerl.pipeline.planning.runs import run_id_for
from qerl.pipeline.registry import live, release, tracking
from qerl.pipeline.registry.adapters import base_lineage_digest
from qerl.pipeline.rollout.lazy import LazyEngine
from qerl.pipeline.store import retention, run_lock
from qerl.pipeline.store.artifact_store import ArtifactStore, open_store
from qerl.pipeline.store.code_version import dependency_versions, package_version
from qerl.pipeline.store.files import atomic_write_bytes, read_json
from qerl.pipeline.store.layout import RUN_RECORD, default_work_dir
from qerl.pipeline.store.manifest import Adapter, Manifest
from qerl.pipeline.store.run_record import (
    Ablation,
    DataSection,
    HeldOut,
    Plan,
    QuantizeSection,
    RunRecord,
    WarmStart,
    previous_record,
    run_dir,
)
from qerl.pipeline.store.shared import fetch_record
from qerl.stages import train


@flow(name="qerl-rl", log_prints=True)
def rl_flow(
    config: dict[str, Any],
    work_dir: str | None = None,
    nightly: bool = False,
    night: str | None = None,
    ablation: dict[str, Any] | None = None,
) -> RunRecord:
    """Start or continue one run (module docstring); returns its record.

    ``work_dir``: None is ``$QERL_WORK_DIR`` (a fleet worker's). ``nightly``: the night Prefect
    scheduled this flow run for; ``night`` (``YYYY-MM-DD``) names it
    (and implies ``nightly``). ``ablation``: the ablation this run belongs to (never promoted)."""
    cfg = RunConfig.model_validate(config)
    if ablation is not None and (nightly or night):
        raise RunPlanError("an ablation run is a plain run, not a nightly one")
    run = open_run(cfg, default_work_dir(work_dir), _night(nightly, night), ablation)
    with (
        run_lock.hold(run_dir(run.work, run.run_id), run.run_id),  # one attempt at a time
        fleet.run_resources(run.run_id),  # its GPUs, and on a fleet a slot of the GPU limit
    ):
        cancel = deadline.arm(run, cfg.loop.deadline_h)  # a hung attempt is stopped, not waited for
        try:
            return attempt(run)
        finally:
            cancel()


def open_run(cfg: RunConfig, work: Path, night: _dt.date | None, ablation: dict[str, Any] | None) -> Run:
    """The attempt's context and a fresh record that keeps what earlier attempts decided once for
    the run (its plan and MLflow run), so an attempt that dies before its plan keeps it."""
    run_id = run_id_for(cfg, night)
    store = open_store(work, cfg.store)  # on a fleet: this machine's cache of the shared store
    previous = previous_record(work, run_id) or shared_record(store, work, run_id)
    carried = {
        k: getattr(previous, k) for k in ("plan", "mlflow_run_id") if previous and getattr(previous, k)
    }
    record = RunRecord(
        run_id=run_id,
        status="running",
        config=cfg.model_dump(mode="json"),
        night=night,
        ablation=Ablation.model_validate(ablation) if ablation else None,
        flow_run_id=_flow_run_id(),
        code_version=package_version(),
        versions=dependency_versions(),
        steps=[],
        evaluations=[],
        started_at=_dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        **carried,
    )
    return Run(cfg, work, store, record, previous, console.current(), get_run_logger())


def shared_record(store: ArtifactStore, work: Path, run_id: str) -> RunRecord | None:
    """The record another machine's attempt at ``run_id`` left in the shared store, copied here."""
    data = fetch_record(store.shared, run_id) if store.shared is not None else None
    if data is None:
        return None
    atomic_write_bytes(run_dir(work, run_id) / RUN_RECORD, data)
    return previous_record(work, run_id)


def attempt(run: Run) -> RunRecord:
    """One attempt at the run, under its lock: the phases in order, then the retention passes."""
    cfg, rec = run.cfg, run.record
    detach_log = console.attach_run_log(run_dir(run.work, run.run_id))  # a scheduled night's run.log
    run.logger.info("run %s: started (flow run %s)", run.run_id, rec.flow_run_id)
    run.save()
    engine, failure = None, None
    try:
        tracking.check_reachable(cfg.registry, run.work)  # a dead registry fails now, not after training
        rec.disk_estimate = check_disk(cfg, run.work)  # refuses a run that cannot fit, with the numbers
        rows, held_out = read_data(run)  # before anything is built: bad data fails the run here
        base = prepare_base(run, held_out)
        # started by the first stage that generates; a run with AQN gets an engine that holds it exactly
        engine = LazyEngine(cfg.rollout, base.quantized, base.twin, aqn=cfg.aqn.active)
        rec.engine_mode = engine.mode
        run.logger.info("run %s: engine mode %s, work dir %s", run.run_id, engine.mode, run.work)
        problems, validation = fit_data(run, base, rows, held_out)
        quality = measure_quality(run, base, validation)  # before the engine takes its memory
        warm = plan(run, base, problems)
        open_live(run)
        run.save()  # the MLflow run's id on disk now: an attempt killed before its first step keeps it
        final = train_steps(run, base, engine, problems, warm)
        final_eval = evaluate(run, base, Adapter.of(final), final, engine, cfg.loop.steps, validation)
        baseline = evaluate(run, base, None, None, engine, 0, validation) if cfg.loop.eval_base else None
        register(run, base, final, final_eval, engine, validation, quality)
        finish(run, final, final_eval, baseline)
    except BaseException as err:
        failure = err
        rec.status, rec.error = "failed", f"{type(err).__name__}: {err}"
        raise
    finally:
        run.save()
        if run.live is not None:
            live.end_run(run.live, failed=failure is not None)
        if engine is not None:
            engine.close()
        train.drop_resident_policy()  # a serving process (qerl schedule) must not keep it across nights
        report.publish(rec, orchestration.answers)
        detach_log(failure)
    retention.prune_run(run.work, run.run_id, cfg.store)  # completed: no optimizer state stays
    freed, released = release.release_old_versions(run.work)  # store.keep_versions: older nights go
    if released:
        run.ui.line(
            f"{'retention':<11} released {', '.join(released)} (store.keep_versions), "
            f"{retention.human_bytes(freed)} freed"
        )
    return rec


def read_data(run: Run) -> tuple[list[Any], list[Any]]:
    """The training rows as the data gives them and the validation split held out of them, read
    before anything is built; every benchmark is read too, so one that cannot be read fails now."""
    rows = load_problems(run.cfg.data, "train")
    for bench in (run.cfg.eval.benchmark, *run.cfg.eval.also):
        load_problems(bench)
    return rows, validation_split(rows, run.cfg.eval.validation)[1]


def prepare_base(run: Run, held_out: list[Any]) -> Base:
    """The base model, its quantized checkpoint (GPTQ never calibrates on a held-out question) and,
    where the engine needs one, the dequantized twin."""
    cfg, store = run.cfg, run.store
    clock = Clock()
    src = tasks.base_model(
        cfg=cfg, store=store, exclude=frozenset(p["group"] for p in held_out if p.get("group"))
    )
    run.show("base", src, clock)
    if (Path(src) / "config.json").is_file():  # the demo's and the catalogue's are known only now
        check_model(cfg.rollout, read_json(Path(src) / "config.json"))
    clock = Clock()
    questions = frozenset(p["question"] for p in held_out)
    progress = console.quantize_progress(run.ui)
    quantized = tasks.quantized(cfg=cfg, src=src, store=store, held_out=questions, progress=progress)
    what = {"none": "unquantized base", "nf4": "NF4 checkpoint"}.get(cfg.quantize.scheme, "NVFP4 checkpoint")
    run.show("quantize", f"{what} ({quantized.mode})", clock, quantized)
    method = {"nvfp4": cfg.quantize.method, "nf4": "nf4 (bitsandbytes)"}.get(cfg.quantize.scheme)
    run.record.quantize = QuantizeSection(manifest=str(quantized.dir), mode=quantized.mode, method=method)
    twin = None
    if needs_twin(cfg.rollout.engine, cfg.quantize.scheme):
        clock = Clock()
        twin = tasks.twin(cfg=cfg, base=quantized, store=store)
        run.show("twin", f"dequantized {cfg.quantize.twin_dtype}", clock, twin)
    return Base(src, quantized, twin)


def fit_data(run: Run, base: Base, rows: list[Any], held_out: list[Any]) -> tuple[list[Any], list[Any]]:
    """(training problems, validation problems) whose prompts fit the engine: an over-long prompt
    would fail its step. The validation split was chosen before the fit, which may drop some of it."""
    cfg = run.cfg
    limit = prompt_token_limit(cfg.rollout)
    fit = fit_prompts(rows, load_tokenizer((base.twin or base.quantized).dir), cfg.rollout.template, limit)
    held = {p["id"] for p in held_out}
    problems = [p for p in fit.kept if p["id"] not in held]
    validation = [p for p in fit.kept if p["id"] in held]
    run.record.data = DataSection(
        **fit.report(),
        dataset_digest=problems_digest(problems),
        validation=HeldOut(n_items=len(validation), digest=problems_digest(validation)),
    )
    dropped = f", {len(fit.dropped)} dropped (prompt > {limit} tokens)" if fit.dropped else ""
    kept = f", {len(validation)} held out for validation" if validation else ""
    run.ui.stage("data", f"{len(problems)} problems from {cfg.data.dataset}/{cfg.data.split}{dropped}{kept}")
    return problems, validation


def measure_quality(run: Run, base: Base, validation: list[Any]) -> Manifest | None:
    """What quantization cost (``quantize.quality``) on the run's validation texts where it has
    them: a console line, the whole in the run's log, the numbers in the record."""
    cfg = run.cfg
    if cfg.quantize.scheme == "none" or not cfg.quantize.quality.enabled:
        return None
    clock = Clock()
    made = tasks.quality_report(
        cfg=cfg, base=base.quantized, src=base.src, store=run.store, validation=validation
    )
    section = made.extra.get("quality")
    texts = (section or {}).get("texts")
    on = f" on {texts['count']} {texts['source']} texts" if texts else ""
    run.show("quality", quality_brief(section).removeprefix(", ") + on, clock, made)
    run.logger.info(quality_line(section))
    assert run.record.quantize is not None
    run.record.quantize = QuantizeSection.model_validate(
        {**run.record.quantize.model_dump(), **quality_metrics(section)}
    )
    return made


def plan(run: Run, base: Base, problems: list[Any]) -> Manifest | None:
    """The data slice and the warm start, decided once (a resumed run keeps its recorded plan);
    returns the warm start."""
    cfg, rec = run.cfg, run.record
    assert rec.data is not None
    if rec.plan is None:
        stream = stream_key(rec.data.dataset_digest, cfg.loop.seed, cfg.loop.prompts_per_step)
        start = DataCursor(run.work, cfg.loop.name).position(stream) if rec.night is not None else 0
        rec.plan = Plan(
            stream=stream, **data_slice(start, cfg.loop.steps, len(problems), cfg.loop.prompts_per_step)
        )
    p = rec.plan
    if max(p.epochs) > 0:
        run.logger.warning(
            "data slots %d..%d reach epoch %d: the %d problems were all used, a new shuffled epoch repeats them",
            p.start_slot,
            p.end_slot - 1,
            max(p.epochs),
            len(problems),
        )
    warm = None
    if rec.night is not None and cfg.loop.warm_start == "champion":
        pinned = p.warm_start.version if p.warm_start else None
        if p.warm_start is None or pinned:  # a resumed night started from base stays on base
            digest = base_lineage_digest(base.quantized)
            warm = tasks.warm_start(
                cfg=cfg, work=run.work, store=run.store, base_digest=digest, version=pinned
            )
        p.warm_start = (
            WarmStart(source="champion", version=str(warm.extra["version"]), digest=warm.digest)
            if warm is not None
            else WarmStart(source="base", version=None)
        )
    elif rec.night is not None:  # loop.warm_start: base, recorded as the MLflow tags read it
        p.warm_start = WarmStart(source="base", version=None)
    slots = f"slots {p.start_slot}..{p.end_slot - 1} (epoch {', '.join(map(str, p.epochs))})"
    start = f"warm start from v{warm.extra['version']}" if warm else "fresh LoRA"
    run.ui.stage("plan", f"{slots}, {start}")
    run.save()
    return warm


def open_live(run: Run) -> None:
    """The run's MLflow run, which gets each step as it ends (``qerl.pipeline.registry.live``)."""
    rec = run.record
    tags = {"flow_run_id": rec.flow_run_id, "code_version": package_version()}
    if rec.night is not None:
        tags.update(night=rec.night.isoformat(), warm_start=str(rec.warm_start_version))
    if rec.ablation is not None:
        tags.update(ablation_id=rec.ablation.id, arm=rec.ablation.arm, **parent_tags(rec.ablation))
    run.live = live.open_run(run.cfg.registry, run.work, rec, run.previous, tags)


def finish(run: Run, final: Manifest, final_eval: Manifest, baseline: Manifest | None) -> None:
    """The outcome in the record; a completed night moves the data cursor past its slice."""
    rec = run.record
    rec.final_adapter = str(final.dir / "adapter")
    rec.baseline_accuracy = baseline.metrics.get("accuracy") if baseline else None
    rec.lift = report.lift_of(final_eval, baseline) if baseline else None
    rec.final_accuracy = final_eval.metrics.get("accuracy")
    rec.status = "completed"
    run.park_if_stopped()
    if rec.night is not None and rec.plan is not None:  # only a completed night consumes its slice
        cursor = DataCursor(run.work, run.cfg.loop.name)
        rec.plan.cursor_after = cursor.advance(rec.plan.stream, rec.plan.end_slot, run.run_id)


def _flow_run_id() -> str | None:
    found = flow_run.get_id()
    return None if found is None else str(found)


def _night(nightly: bool, night: str | None) -> _dt.date | None:
    """The night of a nightly run: explicit, else the scheduled start of this Prefect flow run."""
    if night:
        return parse_night(night)
    if not nightly:
        return None
    scheduled = flow_run.scheduled_start_time
    if scheduled is None:
        raise RunPlanError("a nightly run needs a night: pass night=YYYY-MM-DD or run it from the deployment")
    return parse_night(scheduled)
