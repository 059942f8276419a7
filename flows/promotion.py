"""The run's last phase: register the final adapter, with the evidence its promotion is decided on.

Before registering, the champion is fetched through the warm-start stage and evaluated under this
run's protocol on its validation items (``_champion_evaluation``, a store hit when it already was),
only on its own base (``qerl.pipeline.registry.lineage``); without a champion the base model
without an adapter is evaluated the same way, since a registered model's first candidate must beat
it (``_base_evaluation``); a run that held out no validation split passes the reason it cannot be
promoted. The register stage then decides under the registered model's policy
(``qerl.pipeline.registry.policy``). An ablation's run, and a re-run that registered before, are
registered with no comparison at all.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect.runtime import flow_run
from qerl.flows import tasks
from qerl.flows.attempt import Base, Clock, Run, parent_tags
from qerl.pipeline.nvfp4.quality_report import quality_metrics
from qerl.pipeline.planning.errors import RunPlanError
from qerl.pipeline.planning.run_config import RunConfig
from qerl.pipeline.registry import promotion, tracking
from qerl.pipeline.registry.adapters import base_lineage_digest, base_recipe
from qerl.pipeline.registry.lineage import NO_VALIDATION, run_lineage, version_recipe
from qerl.pipeline.registry.protocol import log_protocol, protocol_of
from qerl.pipeline.rollout.lazy import LazyEngine
from qerl.pipeline.store import releases
from qerl.pipeline.store.code_version import package_version
from qerl.pipeline.store.files import read_json
from qerl.pipeline.store.manifest import Adapter, Manifest
from qerl.pipeline.store.run_record import Registration


def register(
    run: Run,
    base: Base,
    final: Manifest,
    final_eval: Manifest,
    engine: LazyEngine,
    validation: list[Any],
    quality: Manifest | None,
) -> None:
    """Register the final adapter with its lineage and the evidence its promotion is decided on: the
    champion's (or base model's) evaluation under this run's protocol on the validation items; none
    for an ablation's run or a re-run that registered before."""
    run.park_if_stopped()
    cfg, rec, clock = run.cfg, run.record, Clock()
    warm_tags = None
    if rec.warm_start_version is not None:
        tracking.connect(cfg.registry, run.work)
        warm_tags = promotion.version_info(cfg.registry, rec.warm_start_version)["tags"]
    lineage = run_lineage(
        rec, base.quantized, package_version(), str(flow_run.get_id()), engine.mode, warm_tags
    )
    before = run.previous.registration if run.previous else None
    gone = releases.by_run(releases.load(run.store)).get(run.run_id)
    if before is not None and before.version and gone:  # its adapter is gone: the registration stays
        rec.registration = before
        run.show(
            "register", f"{before.model_name} v{before.version}, {gone}: not registered again", clock, final
        )
        return
    champion = None
    if rec.ablation is None and not (before and before.version):  # a candidate: its evidence
        champion = (
            (
                _champion_evaluation(run, base, engine, validation)
                or _base_evaluation(run, base, engine, validation)
            )
            if validation
            else NO_VALIDATION
        )
    reg = tasks.registration(
        cfg=cfg,
        final=final,
        evaluation=final_eval,
        lineage=lineage,
        history=rec.history(),
        work=run.work,
        store=run.store,
        candidate=rec.ablation is None,
        champion_eval=champion,
        run_tags=parent_tags(rec.ablation) if rec.ablation else None,
        mlflow_run_id=rec.mlflow_run_id,
    )
    if reg.metrics.get("created"):
        if not run.cached(reg):  # once: a cached registration logged them already
            log_quality(cfg, run.work, str(reg.extra["run_id"]), quality)
        # for qerl eval of this version where this record is not (another machine's work dir)
        tracking.connect(cfg.registry, run.work)
        log_protocol(str(reg.extra["run_id"]), protocol_of(rec.config, run.run_id))
    decision = read_json(reg.file("registration.json"))
    rec.registration = Registration(
        **{**reg.extra, **reg.metrics},
        promotion=decision.get("promotion"),
        decided_on=decision.get("decided_on"),
    )
    by = rec.earlier_registration()
    already = "" if by is None else f" (already registered by run {by}: the same adapter)"
    promoted = "champion" if reg.metrics.get("promoted") else "not promoted"
    run.show(
        "register",
        f"{reg.extra.get('model_name')} v{reg.metrics.get('version')}{already}, {promoted}",
        clock,
        reg,
    )
    if decision.get("promotion"):
        run.logger.info("promotion: %s", decision["promotion"])


def log_quality(cfg: RunConfig, work: Path, mlflow_run_id: str, quality: Any) -> None:
    """The quality stage's metrics (``quantize_kl``, ``quantize_top1``, the perplexities and weight
    errors) on the registered version's MLflow run, at step 0."""
    measured = quality_metrics(quality.extra.get("quality")) if quality is not None else {}
    if measured:
        tracking.connect(cfg.registry, work)
        tracking.log_step_metrics(mlflow_run_id, 0, measured)


def _base_evaluation(run: Run, base: Base, engine: LazyEngine, validation: list[Any]) -> tuple[str, Manifest]:
    """("base", the base model's evaluation without an adapter on the validation items): what a
    registered model's first candidate must beat."""
    clock = Clock(engine)
    ev = tasks.evaluation(
        cfg=run.cfg, base=base.quantized, adapter=None, store=run.store, engine=engine, validation=validation
    )
    if not any(e.adapter is None and e.validation is not None for e in run.record.evaluations):
        # else loop.eval_base's evaluation was this one, and its line is on the console already
        run.show("evaluate", "base, no adapter, on the validation items (no champion yet)", clock, ev)
    return promotion.BASE, ev


def _champion_evaluation(
    run: Run, base: Base, engine: LazyEngine, validation: list[Any]
) -> tuple[str, Manifest] | str | None:
    """(champion version, its evaluation under this run's protocol); a reason when it cannot be
    evaluated here (another base, recipe or LoRA shape); None: no champion yet."""
    cfg = run.cfg
    try:
        champ = tasks.warm_start(
            cfg=cfg,
            work=run.work,
            store=run.store,
            base_digest=base_lineage_digest(base.quantized),
            version=None,
        )
    except RunPlanError as err:
        return f"it cannot be evaluated under this run's protocol ({err})"
    if champ is None:
        return None
    version = str(champ.extra["version"])
    theirs, ours = (
        version_recipe(promotion.version_info(cfg.registry, version)["tags"], run.work),
        base_recipe(base.quantized),
    )
    if theirs != ours:  # its adapter on this checkpoint is not the champion: not evaluated at all
        return (
            f"champion v{version} was trained on base recipe {theirs}, this run on {ours}: "
            "a champion is evaluated only on its own base (qerl policy and qerl promote decide by hand)"
        )
    registered = champ.inputs.get("registered_adapter")
    adapter = Adapter.of(champ, registered if registered not in (None, "unknown") else None)
    clock = Clock(engine)
    ev = tasks.evaluation(
        cfg=cfg, base=base.quantized, adapter=adapter, store=run.store, engine=engine, validation=validation
    )
    run.show("evaluate", f"champion v{version} under this run's protocol", clock, ev)
    return version, ev
