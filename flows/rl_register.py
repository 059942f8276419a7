"""The run's last phase: register the final adapter, with the evidence its promotion is decided on.

Before registering, the champion is fetched through the warm-start stage and evaluated under this
run's protocol on its validation items (``_champion_evaluation``, a store hit when it already was);
without a champion the base model without an adapter is evaluated the same way, since a registered
model's first candidate must beat it (``_base_evaluation``); a run that held out no validation split
passes the reason it cannot be promoted (``NO_VALIDATION``). The register stage then decides under
the registered model's policy (``qerl.pipeline.registry.policy``). An ablation's run, and a re-run
that registered before, are registered with no comparison at all.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from prefect.runtime import flow_run
from qerl.flows.rl_phases import Run
from qerl.flows.rl_tasks import evaluate_task, register_task, warm_start_task
from qerl.flows.run_record import earlier_registration
from qerl.pipeline.nvfp4.quality_report import quality_metrics
from qerl.pipeline.planning.errors import RunPlanError
from qerl.pipeline.registry import heldout, live, promotion, tracking
from qerl.pipeline.registry.adapters import base_lineage_digest, base_recipe, is_legacy_recipe
from qerl.pipeline.registry.protocol import log_protocol, protocol_of
from qerl.pipeline.rollout.lazy import LazyEngine
from qerl.pipeline.store import releases
from qerl.pipeline.store.code_version import package_version
from qerl.pipeline.store.layout import RUN_RECORD, RUNS_DIR
from qerl.pipeline.store.manifest import ArtifactError, Manifest


def register_final(
    run: Run, quantized: Manifest, final: Manifest, final_eval: Manifest, engine: LazyEngine
) -> None:
    """Register the final adapter with its lineage (promoted on a win, never for an ablation run)."""
    run.park_if_stopped()
    rec = run.record
    lineage = {
        "base_digest": base_lineage_digest(quantized),
        "quant_recipe": base_recipe(quantized),
        "base_checkpoint": quantized.digest,  # the exact checkpoint, which qerl eval evaluates on
        "dataset_digest": rec["data"]["dataset_digest"],
        "code_version": package_version(),
        "flow_run_id": str(flow_run.get_id()),
        "run_id": run.run_id,
        "engine_mode": engine.mode,
    }
    if run.night is not None:
        lineage.update(
            night=run.night.isoformat(), warm_start=str((rec["plan"].get("warm_start") or {}).get("version"))
        )
    if run.ablation is not None:
        lineage.update(ablation_id=run.ablation["id"], arm=run.ablation["arm"])
    lineage.update(_heldout(run))
    history = [{k: v for k, v in h.items() if k != "manifests"} for h in rec["steps"]]
    t0 = time.perf_counter()
    # a run that registered before (a re-run) finds its registration in the store: the champion, maybe
    # this very run's version by now, is not fetched or evaluated again
    before = run.previous.get("registration") or {}
    released = releases.by_run(releases.load(run.store)).get(run.run_id)
    if before.get("version") and released:  # its adapter is gone: the registration stays as it was
        rec["registration"] = before
        detail = f"{before.get('model_name')} v{before['version']}, {released}: not registered again"
        run.ui.stage("register", detail, time.perf_counter() - t0, True)
        return
    champion = None
    if run.ablation is None and not before.get("version"):  # a candidate: its evidence
        if not run.validation:  # promotion never decides on the test set: nothing to evaluate
            champion = NO_VALIDATION
        else:
            champion = _champion_evaluation(run, quantized, engine) or _base_evaluation(
                run, quantized, engine
            )
    reg = register_task(
        run.cfg, final, final_eval, lineage, history, run.work, run.store, run.ablation, champion,
        rec.get(live.RECORD_KEY),
    )  # fmt: skip
    if reg.metrics.get("created") and not run.cached(reg):
        _log_quantize_quality(run, str(reg.extra["run_id"]))
    if reg.metrics.get("created"):
        # for `qerl eval` of this version where this run's record is not (another machine's work dir);
        # a re-run logs it again (the same file): it backfills one registered before it existed, or
        # whose logging failed after the registration
        tracking.connect(run.cfg.registry, run.work)
        log_protocol(str(reg.extra["run_id"]), protocol_of(rec["config"], run.run_id))
    decision = json.loads(reg.file("registration.json").read_text())
    rec["registration"] = {**reg.extra, **reg.metrics, "promotion": decision.get("promotion"),
                           "decided_on": decision.get("decided_on")}  # fmt: skip
    promoted = "champion" if reg.metrics.get("promoted") else "not promoted"
    by = earlier_registration(rec)
    already = "" if by is None else f" (already registered by run {by}: the same adapter)"
    run.ui.stage("register", f"{reg.extra.get('model_name')} v{reg.metrics.get('version')}{already}, {promoted}",
                 time.perf_counter() - t0, run.cached(reg))  # fmt: skip
    if decision.get("promotion"):
        run.logger.info("promotion: %s", decision["promotion"])


def _heldout(run: Run) -> dict[str, str]:
    """The lineage's validation items: this run's (``validation_digest``) and those no run of its
    lineage trained on (``heldout.HELDOUT_TAG``, read through the warm start's version tags)."""
    items = run.record["data"]["validation"]["digest"] if run.validation else heldout.NO_HELDOUT
    warm = (run.record["plan"].get("warm_start") or {}).get("version")
    tags = None
    if warm is not None:
        tracking.connect(run.cfg.registry, run.work)
        tags = promotion.version_info(run.cfg.registry, str(warm))["tags"]
    return {"validation_digest": items, heldout.HELDOUT_TAG: heldout.heldout_lineage(items, tags)}


def _recipe_of(run: Run, tags: dict[str, str]) -> str:
    """A registered version's base recipe: its ``quant_recipe`` tag, or for a version an older qerl
    registered (a bare hash, which RTN and GPTQ bases share: ``is_legacy_recipe``) the recipe of the
    checkpoint its run's record names, where that run and checkpoint are in this work directory."""
    recipe = str(tags.get("quant_recipe"))
    if not is_legacy_recipe(recipe):
        return recipe
    path = run.work / RUNS_DIR / str(tags.get("run_id")) / RUN_RECORD
    try:
        checkpoint = Manifest.load(Path(json.loads(path.read_text())["quantize"]["manifest"]))
    except (OSError, ValueError, KeyError, TypeError, ArtifactError):
        return f"{recipe} (an older qerl's hash, and its run's checkpoint is not in this work directory)"
    return base_recipe(checkpoint)


def _log_quantize_quality(run: Run, mlflow_run_id: str) -> None:
    """The quality stage's metrics (``quantize_kl``, ``quantize_top1``, ``quantize_ppl_base``,
    ``quantize_ppl_quant``, the weight errors) on the MLflow run the registration just created, at step
    0: once, since a cached or reused registration logged them already."""
    metrics = quality_metrics(run.quality.extra.get("quality") if run.quality else None)
    if metrics:
        tracking.connect(run.cfg.registry, run.work)
        tracking.log_step_metrics(mlflow_run_id, 0, metrics)


NO_VALIDATION = (
    "the run held out no validation split (eval.validation.size 0), and promotion never decides on the "
    "test set: not promoted automatically (qerl promote does it by hand)"
)


def _base_evaluation(run: Run, quantized: Manifest, engine: LazyEngine) -> tuple[str, Manifest]:
    """("base", the base model's evaluation without an adapter on this run's validation items): what
    a registered model's first candidate must beat."""
    t0 = time.perf_counter()
    ev = evaluate_task(run.cfg, quantized, None, run.store, engine, run.validation)
    if not any(e.get("adapter") is None and "validation" in e for e in run.record["evaluations"]):
        # else loop.eval_base's evaluation was this one, and its line is on the console already
        run.ui.stage("evaluate", "base, no adapter, on the validation items (no champion yet)",
                     time.perf_counter() - t0, run.cached(ev))  # fmt: skip
    return promotion.BASE, ev


def _champion_evaluation(
    run: Run, quantized: Manifest, engine: LazyEngine
) -> tuple[str, Manifest] | str | None:
    """(champion version, its evaluation under this run's protocol and validation items); a reason
    when the champion cannot be evaluated here (another base, recipe or LoRA shape); None: no champion."""
    try:
        champ = warm_start_task(run.cfg, run.work, run.store, base_lineage_digest(quantized), None)
    except RunPlanError as err:
        return f"it cannot be evaluated under this run's protocol ({err})"
    if champ is None:
        return None
    tags = promotion.version_info(run.cfg.registry, str(champ.extra["version"]))["tags"]
    theirs, ours = _recipe_of(run, tags), base_recipe(quantized)
    if theirs != ours:  # its adapter on this checkpoint is not the champion: not evaluated at all
        return (
            f"champion v{champ.extra['version']} was trained on base recipe {theirs}, this run on {ours}: "
            "a champion is evaluated only on its own base (qerl policy and qerl promote decide by hand)"
        )
    registered = champ.inputs.get("registered_adapter")
    digest = registered if registered not in (None, "unknown") else champ.digest
    t0 = time.perf_counter()
    ev = evaluate_task(run.cfg, quantized, champ, run.store, engine, run.validation, digest)
    version = str(champ.extra["version"])
    run.ui.stage("evaluate", f"champion v{version} under this run's protocol", time.perf_counter() - t0,
                 run.cached(ev))  # fmt: skip
    return version, ev
