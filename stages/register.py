"""Stage ``register``: log a finished run to MLflow and register its adapter as a model version.

What: one MLflow run per training run holds the per-step history (reward, accuracy, entropy, KL,
clip fractions, sigma, tokens/s, stage times: every numeric key the flow recorded), the PNG curves,
the train config as params, the adapter, its manifest and the evaluation table. The adapter becomes
a version of ``cfg.model_name`` with lineage tags; a complete run's version becomes ``challenger``
(unless a newer one already is) and ``champion`` when it beats the current champion (see
``qerl.pipeline.registry.promotion`` for the rule and its lock). The comparison is paired: the flow
passes the champion's evaluation under this run's protocol (``champion_eval``; without a champion,
the base model's, as version ``base``), and the per-item rates of both on the run's validation split
(the main benchmark when the run has none) give the mean difference and its standard error
(``PairedEvidence``), judged by the registered model's promotion policy
(``qerl.pipeline.registry.policy``). The test benchmark's accuracy is logged and
tagged (``eval_accuracy``), never decisive; the decision's split and accuracy are tagged
``promotion_benchmark``/``promotion_accuracy``. A failed or partial run is still
registered (its lineage is worth keeping, tagged ``complete=false``) but gets no alias. The adapter
is copied into the MLflow run's artifacts (uploaded through the tracking server when the URI is
``http[s]://``), so a registered version never depends on the store's copy; ``qerl gc`` keeps that
copy while the version is kept (local evaluation reads it), recognising it by this stage's manifest,
whose ``train`` input is its digest, and prunes it once the version is released
(``store.keep_versions``, ``qerl.pipeline.registry.release``).

The MLflow run is the one the flow opened before the first step and logged each step into
(``mlflow_run_id``, ``qerl.pipeline.registry.live``) when it still exists, else a new one; either
way only the points it lacks are logged (a step by its ``step`` metric, the final evaluation by
``eval_accuracy`` at the last step), and only the params it lacks (a resumed run may differ in a
resource setting; the first attempt's value stays).

Idempotence has two layers. The artifact store caches this stage by (registry config, train and
evaluation digests, lineage, history, completeness), so an identical re-run does nothing. Because
the flow run id in the lineage changes when a crashed run is resumed, the registry is also asked
first whether a version with this adapter digest, or of this run with the same adapter weights
(a rebuilt step), exists; if so it is reused and no second version or MLflow run is made. A reused
version keeps its promotion decision (its ``promotion`` tag): a re-run after an upgrade changed this
stage's key, with no champion evaluation passed, must not re-decide it on the recorded accuracies
alone, nor against a champion crowned since. Only a version registered by an attempt cut off before
its decision (no tag) is decided now, and so is an ablation's version (never a candidate) or a
partial run's, when a complete run's registration reuses it. A night whose training left the
warm-start adapter byte-identical (no group of any step had an advantage, and weight decay is off,
its default) reuses that version the same way; ``registered_by`` (the version's ``run_id`` tag) then
names the earlier run, so the run's record and console say the version and its decision are that
run's.

``promote=False`` (the runs of an ablation, ``qerl ablate``): the version is registered with its
lineage but takes no alias at all, neither challenger nor champion: an ablation never moves them.
``run_tags`` are extra tags of the MLflow run only (an ablation's ``mlflow.parentRunId``).
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qerl.pipeline.evaluation.items import item_rates
from qerl.pipeline.evaluation.statistics import paired_difference
from qerl.pipeline.registry import live, promotion, tracking
from qerl.pipeline.registry.lock import backend_kind
from qerl.pipeline.store.artifact_store import ArtifactStore
from qerl.pipeline.store.code_version import code_version
from qerl.pipeline.store.files import sha256_json
from qerl.pipeline.store.layout import MANIFEST, REGISTER_STAGE, TRAIN_STAGE
from qerl.pipeline.store.manifest import ArtifactError, BuildResult, Manifest
from qerl.pipeline.store.retention_inputs import require_adapter

log = logging.getLogger("qerl.stages.register")

STAGE = REGISTER_STAGE
NOT_A_CANDIDATE = "not a candidate: an ablation run never moves aliases"  # its promotion tag


def _flatten(obj: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in obj.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def _eval_summary(evaluation: Manifest) -> dict[str, Any]:
    summary = json.loads(evaluation.file("summary.json").read_text())
    for key in ("benchmark", "accuracy"):
        if key not in summary:
            raise ArtifactError(f"{evaluation.file('summary.json')} has no '{key}'")
    return summary


def eval_metrics(summary: Mapping[str, Any]) -> dict[str, Any]:
    """The final evaluation as MLflow metrics, under stable names: ``eval_accuracy``,
    ``eval_accuracy_stderr``, ``eval_n_items``, ``eval_k`` for the main benchmark (``eval_stderr`` too:
    the same value under the name older MLflow runs carry, so their charts line up), and
    ``eval_<name>_<split>_accuracy`` / ``_accuracy_stderr`` / ``_n_items`` for each ``eval.also``
    benchmark (``eval_gsm8k_test_accuracy``). Absent values are left out."""
    out = {
        "eval_accuracy": summary.get("accuracy"),
        "eval_accuracy_stderr": summary.get("stderr"),
        "eval_stderr": summary.get("stderr"),
        "eval_n_items": summary.get("n_items"),
        "eval_k": summary.get("k"),
    }
    val = summary.get("validation") or {}
    out.update(
        eval_validation_accuracy=val.get("accuracy"),
        eval_validation_accuracy_stderr=val.get("stderr"),
        eval_validation_n_items=val.get("n_items"),
    )
    for other in summary.get("also") or []:
        tag = f"eval_{other.get('benchmark_name')}_{other.get('split')}"
        out.update(
            {
                f"{tag}_accuracy": other.get("accuracy"),
                f"{tag}_accuracy_stderr": other.get("stderr"),
                f"{tag}_n_items": other.get("n_items"),
            }
        )
    return {k: v for k, v in out.items() if v is not None}


@dataclass(frozen=True)
class _Candidate:
    """What one registration is about: the run's adapter, its evaluation and its record."""

    train: Manifest
    evaluation: Manifest
    lineage: Mapping[str, Any]
    history: Sequence[Mapping[str, Any]]
    complete: bool
    run_tags: Mapping[str, Any] | None = None
    champion_eval: tuple[str, Manifest] | str | None = None
    mlflow_run_id: str | None = None


def _log_run(cfg: tracking.RegistryConfig, c: _Candidate, summary: Mapping[str, Any]) -> str:
    """Open the MLflow run (the live one, else a new one) and log what it lacks of everything but
    the adapter; returns the run id."""
    name = f"qerl-{c.lineage.get('flow_run_id') or c.train.key[:12]}"
    tags = {**c.lineage, "complete": str(c.complete).lower(), **(c.run_tags or {})}
    run_id = live.reusable(c.mlflow_run_id)
    if run_id is None:
        run_id = tracking.start_run(cfg, run_name=name, tags=tags)
    else:  # the live run holds the tags known before the first step
        tracking.set_run_tags(run_id, tags)
    client = tracking.MlflowClient()
    params = client.get_run(run_id).data.params
    tracking.log_params(run_id, {k: v for k, v in _flatten(c.train.config).items() if k not in params})
    n_metrics = live.new_steps(run_id, c.history)
    last_step = max((int(e.get("step", i)) for i, e in enumerate(c.history)), default=0)
    if last_step not in live.logged_steps(run_id, "eval_accuracy"):
        n_metrics += tracking.log_step_metrics(run_id, last_step, eval_metrics(summary))
    plots = tracking.log_plots(run_id, c.history)
    for fname in ("results.parquet", "summary.json"):
        client.log_artifact(run_id, str(c.evaluation.file(fname)), artifact_path="evaluation")
    client.log_artifact(run_id, str(c.evaluation.dir / MANIFEST), artifact_path="evaluation")
    log.info("MLflow run %s: %d metric points, plots %s", run_id, n_metrics, plots)
    return run_id


def _checked_lineage(train: Manifest, lineage: Mapping[str, Any]) -> dict[str, Any]:
    """``lineage`` with the adapter digest set to ``train``'s; raises unless ``train`` holds an
    adapter and the lineage names every key the registry requires."""
    adapter_dir = train.dir / "adapter"
    require_adapter(adapter_dir, "register")  # pruned: say which step and file
    if not (adapter_dir / "adapter_config.json").is_file():
        raise ArtifactError(f"train artifact {train.stage}/{train.key} has no adapter at {adapter_dir}")
    if lineage.get("adapter_digest") not in (None, train.digest):
        raise ValueError(
            f"lineage adapter_digest {lineage['adapter_digest']} is not train's digest {train.digest}"
        )
    lineage = {**lineage, "adapter_digest": train.digest}
    missing = [k for k in promotion.LINEAGE_KEYS if k not in lineage]
    if missing:
        raise ValueError(f"lineage lacks {missing} (has {sorted(lineage)})")
    return lineage


def _cache_key(
    resolved: tracking.RegistryConfig, c: _Candidate, promote: bool
) -> tuple[dict[str, Any], dict[str, str]]:
    """(key config, inputs) of the store's cache key for this registration."""
    inputs = {
        TRAIN_STAGE: c.train.digest,  # qerl gc reads it back: the adapter registered from this store
        "evaluation": c.evaluation.digest,
        # which Prefect flow run finishes a resumed run is bookkeeping, not content: not in the key
        "lineage": sha256_json({k: v for k, v in c.lineage.items() if k != "flow_run_id"}),
        "history": sha256_json(list(c.history)),
    }
    # the lock timeout (a resource field) does not change what gets registered: out of the key
    key_cfg = {
        "registry": resolved,
        "complete": c.complete,
    }
    if not promote or c.run_tags:  # only then: ordinary runs keep their cache keys
        key_cfg.update(promote=promote, run_tags=dict(c.run_tags or {}))
    # the champion compared with is not in the key either: a finished registration is not redone
    # when the champion moves (a resumed night keeps its decision), as with the recorded accuracies
    return key_cfg, inputs


def decision_summary(summary: Mapping[str, Any]) -> Mapping[str, Any]:
    """The part of an evaluation summary promotion decides on: the validation split, when the run
    held one out, else the main benchmark."""
    return summary.get("validation") or summary


def _evidence(c: _Candidate, summary: Mapping[str, Any]) -> promotion.PairedEvidence | str | None:
    """The paired comparison with the champion (see the module docstring); a string says why there
    is none, None that the caller gave no champion evaluation."""
    if not isinstance(c.champion_eval, tuple):
        return c.champion_eval
    version, champ = c.champion_eval
    mine, theirs = decision_summary(summary), decision_summary(_eval_summary(champ))
    if theirs.get("benchmark") != mine["benchmark"]:
        return f"its evaluation is on {theirs.get('benchmark')}, this run's on {mine['benchmark']}"
    use_val = "validation" in summary
    paired = paired_difference(item_rates(c.evaluation, use_val), item_rates(champ, use_val))
    return promotion.PairedEvidence(
        benchmark=str(mine["benchmark"]), champion_version=str(version), diff=paired.diff, se=paired.se,
        n_items=paired.n_items, challenger_accuracy=float(mine["accuracy"]),
        champion_accuracy=float(theirs["accuracy"]),
    )  # fmt: skip


def _version(
    cfg: tracking.RegistryConfig, c: _Candidate, summary: Mapping[str, Any]
) -> tuple[str, str, bool]:
    """(version, MLflow run id, created): the version already registered for this adapter digest
    or for this run's adapter weights (``promotion.find_version``), else a new MLflow run and version
    (the run ends FINISHED, or FAILED for an incomplete run)."""
    weights = promotion.weights_digest(c.train.dir / "adapter")
    existing = promotion.find_version(cfg, c.train.digest, c.lineage.get("run_id"), weights)
    if existing is not None:
        return str(existing.version), existing.run_id, False
    run_id = _log_run(cfg, c, summary)
    version, created = promotion.register_adapter(
        cfg, run_id, c.train.dir / "adapter", c.train.dir / MANIFEST, summary, c.lineage, c.complete
    )
    tracking.MlflowClient().set_terminated(run_id, status="FINISHED" if c.complete else "FAILED")
    return version, run_id, created


def _aliases(
    cfg: tracking.RegistryConfig, version: str, c: _Candidate, summary: Mapping[str, Any], promote: bool
) -> tuple[bool, bool]:
    """(challenger set, promoted); with ``promote=False`` no alias moves and the version says why."""
    if not promote:
        tracking.MlflowClient().set_model_version_tag(cfg.model_name, version, "promotion", NOT_A_CANDIDATE)
        return False, False
    complete, decided = c.complete, decision_summary(summary)
    client = tracking.MlflowClient()
    client.set_model_version_tag(cfg.model_name, version, "promotion_benchmark", str(decided["benchmark"]))
    client.set_model_version_tag(cfg.model_name, version, "promotion_accuracy", str(decided.get("accuracy")))
    challenger = promotion.set_challenger(cfg, version) if complete else False
    promoted = promotion.maybe_promote(
        cfg, version, str(decided["benchmark"]), decided.get("accuracy"), complete, _evidence(c, summary),
        lineage=c.lineage if c.champion_eval is not None else None,
    )  # fmt: skip
    return challenger, promoted


def _earlier_decision(
    cfg: tracking.RegistryConfig, version: str, c: _Candidate, promote: bool
) -> tuple[bool, bool] | None:
    """(holds challenger, holds champion) of a reused version whose promotion an earlier
    registration decided (its ``promotion`` tag; see the module docstring); None when none did, or
    when it decided less than this one would: an ablation's version (never a candidate) or a partial
    run's, reused by a complete candidate."""
    info = promotion.version_info(cfg, version)
    tags = info["tags"]
    if "promotion" not in tags or (promote and tags["promotion"] == NOT_A_CANDIDATE):
        return None
    if promote and c.complete and tags.get("complete") == "false":
        return None
    return cfg.challenger_alias in info["aliases"], cfg.champion_alias in info["aliases"]


def run(
    cfg: tracking.RegistryConfig,
    train: Manifest,
    evaluation: Manifest,
    lineage: Mapping[str, Any],
    history: Sequence[Mapping[str, Any]],
    work_dir: str | Path,
    complete: bool,
    store: ArtifactStore,
    promote: bool = True,
    run_tags: Mapping[str, Any] | None = None,
    champion_eval: tuple[str, Manifest] | str | None = None,
    mlflow_run_id: str | None = None,
) -> Manifest:
    """Log, register and (maybe) promote the adapter of ``train``; writes ``registration.json``.

    ``promote=False``: no alias is touched (see the module docstring). ``champion_eval``: (champion
    version, its ``evaluate`` manifest under this run's protocol), or why there is none (no
    promotion over a champion then); None: the recorded accuracies decide (a direct call).
    ``mlflow_run_id``: the MLflow run the flow logged the steps into (not in the cache key)."""
    c = _Candidate(
        train, evaluation, _checked_lineage(train, lineage), history, complete, run_tags, champion_eval,
        mlflow_run_id,
    )  # fmt: skip
    resolved = tracking.resolve_config(cfg, work_dir)
    kind = backend_kind(str(resolved.tracking_uri))
    key_cfg, inputs = _cache_key(resolved, c, promote)

    def build(tmp: Path) -> BuildResult:
        tracking.open_tracking(resolved, work_dir)
        summary = _eval_summary(evaluation)
        version, run_id, created = _version(resolved, c, summary)
        earlier = None if created else _earlier_decision(resolved, version, c, promote)
        challenger, promoted = earlier or _aliases(resolved, version, c, summary, promote)
        info = promotion.version_info(resolved, version)
        record = {
            "model_name": resolved.model_name,
            "version": version,
            "created": created,
            "run_id": run_id,
            "registered_by": info["tags"].get("run_id"),  # another run's, when its adapter is this one
            "source": info["source"],
            "aliases": info["aliases"],
            "challenger": challenger,
            "promoted": promoted,
            "promotion": info["tags"].get("promotion"),
            "complete": complete,
            "benchmark": summary["benchmark"],
            "accuracy": summary.get("accuracy"),
            "decided_on": decision_summary(summary)["benchmark"],
            "decision_accuracy": decision_summary(summary).get("accuracy"),
            "tracking_backend": kind,
        }
        (tmp / "registration.json").write_text(
            json.dumps(record, indent=2, sort_keys=True, default=str) + "\n"
        )
        return BuildResult(
            mode=f"mlflow-{kind}",
            metrics={"version": int(version), "promoted": promoted, "created": created},
            extra={
                "run_id": run_id,
                "model_name": resolved.model_name,
                "registered_by": record["registered_by"],
            },
        )

    code = code_version(sys.modules[__name__])
    manifest, cached = store.produce(STAGE, key_cfg, inputs, code, build)
    log.info(
        "register: %s v%s (%s)%s",
        manifest.extra.get("model_name"),
        manifest.metrics.get("version"),
        "promoted" if manifest.metrics.get("promoted") else "not promoted",
        " [cached]" if cached else "",
    )
    return manifest
