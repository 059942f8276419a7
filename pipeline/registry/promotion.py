"""The model registry: adapter versions with their lineage, the aliases, and the promotion rule.

What: a run's adapter becomes a registered model version carrying its lineage as tags (base model
digest, quantization recipe, dataset digest, code version, Prefect flow run id, the adapter's own
digest and its evaluation). Aliases, not the deprecated stages, name the roles: ``challenger`` is
the newest complete version, ``champion`` the one serving. Registration is idempotent by adapter
digest, and by run and weights: a version already carrying the digest, or registered by the same run
(``run_id`` tag) with the same ``adapter_model.safetensors`` bytes (``adapter_weights_digest`` tag), is
returned as is (a rebuilt step whose other files differ is still the same adapter).

Promotion rule: a version becomes champion only when its run is complete and it beats the current
champion, or the base model without an adapter when there is no champion yet, in a *paired*
comparison (``PairedEvidence``): both evaluated on the same items under the same protocol (the
benchmark id carries the items and the protocol), the mean per-item difference (challenger minus
champion) above ``margin_se`` standard errors of that difference and above ``margin`` (absolute),
on at least ``MIN_PAIRED_ITEMS`` items (on fewer the standard error is no bar: 0 for one item).
The margins, the decision split and the base are the registered model's promotion policy
(``qerl.pipeline.registry.policy``), which the first candidate sets and only ``qerl policy``
changes; a candidate it does not fit is not compared. The register stage builds the evidence: the
champion (or the base) is evaluated under the challenger's protocol (a store hit when it already
was), on the run's validation split, never on the reported test set; a run without a validation
split is never promoted automatically. Evidence that could not be built (the champion cannot be
evaluated here) is a reason, and the candidate is not promoted (``qerl promote`` is the way to change
protocols by hand). Without evidence (a direct call) the rule compares the recorded accuracies on the
same benchmark id. The decision and its reason are written as a version tag.

Race safety, and why a lock rather than compare-and-set: "read the champion, compare, set the
alias" is a read-modify-write; two runs finishing together could both read the old champion and
the loser could write last. MLflow has no conditional alias update, so a compare-and-set loop
(set, re-read, retry) can only detect a lost update after the fact and cannot order two writers
correctly by accuracy. The whole decision (and version creation, so the "same adapter digest
already registered?" check is atomic too) is therefore serialised under a lock that lives with the
database: an ``flock`` on ``<db>.lock`` next to a sqlite file, a session-level
``pg_advisory_lock`` on the same PostgreSQL database. Both are released by the kernel/server when
the holder dies, so a crashed run never wedges the registry. After setting an alias it is re-read
as a sanity check. Any other backend is refused with a clear error rather than run unprotected.
Through a tracking server there is no such lock; ``qerl.pipeline.registry.lock`` explains the ticket
lock used instead (a version-numbered lease on the server).

Every function uses MLflow's process-wide URIs: ``qerl.pipeline.registry.tracking.connect`` first.
Departure from the paper: none (the paper has no registry); this is the product's MLOps layer.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlflow
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from qerl.pipeline.registry.adapters import is_legacy_recipe, registered_version
from qerl.pipeline.registry.heldout import HELDOUT_TAG, NO_HELDOUT, heldout_conflict, heldout_lineage
from qerl.pipeline.registry.lock import RegistryError, registry_lock
from qerl.pipeline.registry.policy import PromotionPolicy, change_policy, first_policy, mismatch
from qerl.pipeline.registry.tracking import RegistryConfig, tag_value
from qerl.pipeline.store.files import sha256_file

log = logging.getLogger("qerl.registry")

__all__ = [
    "BASE", "HELDOUT_TAG", "MIN_PAIRED_ITEMS", "NO_HELDOUT", "PairedEvidence", "find_version", "heldout_conflict",
    "heldout_lineage", "maybe_promote", "promote", "promotion_decision", "register_adapter", "version_info",
]  # fmt: skip

LINEAGE_KEYS = ("base_digest", "quant_recipe", "dataset_digest", "code_version", "flow_run_id")
WEIGHTS_FILE = "adapter_model.safetensors"


def _uri() -> str:
    return mlflow.get_tracking_uri()


def _filterable(value: str) -> bool:
    return bool(value) and all(c.isalnum() or c in "-_:." for c in value)


def weights_digest(adapter_dir: str | Path) -> str | None:
    """sha256 of the adapter's weights file (``adapter_model.safetensors``), None without one."""
    path = Path(adapter_dir) / WEIGHTS_FILE
    return sha256_file(path) if path.is_file() else None


def find_version(
    cfg: RegistryConfig, adapter_digest: str, run_id: str | None = None, weights: str | None = None
) -> ModelVersion | None:
    """The existing version of ``cfg.model_name`` registered for ``adapter_digest``, else (given
    both) one registered by the same run (``run_id`` tag) with the same adapter weights (``weights``,
    the ``adapter_weights_digest`` tag): a rebuilt step whose other files differ is the same adapter."""
    if not _filterable(adapter_digest):
        raise RegistryError(f"adapter digest '{adapter_digest}' has characters a registry filter cannot hold")
    queries = [f"tags.adapter_digest = '{adapter_digest}'"]
    if run_id and weights and _filterable(run_id) and _filterable(weights):
        queries.append(f"tags.run_id = '{run_id}' and tags.adapter_weights_digest = '{weights}'")
    for query in queries:
        found = MlflowClient().search_model_versions(f"name = '{cfg.model_name}' and {query}")
        if found:
            return min(found, key=lambda v: int(v.version))
    return None


def register_adapter(
    cfg: RegistryConfig,
    run_id: str,
    adapter_dir: str | Path,
    manifest_path: str | Path | None,
    eval_summary: Mapping[str, Any],
    lineage: Mapping[str, Any],
    complete: bool = True,
) -> tuple[str, bool]:
    """Log the adapter (and its manifest) to ``run_id`` and register it; returns (version, created).

    Idempotent: a version already carrying ``lineage['adapter_digest']``, or registered by the same
    run (``lineage['run_id']``) with the same weights (``find_version``), is returned as is
    (created=False) and nothing is logged again.
    """
    missing = [k for k in (*LINEAGE_KEYS, "adapter_digest") if k not in lineage]
    if missing:
        raise RegistryError(f"lineage for {cfg.model_name} lacks {missing} (has {sorted(lineage)})")
    adapter_dir = Path(adapter_dir)
    if not (adapter_dir / "adapter_config.json").is_file():
        raise RegistryError(f"{adapter_dir} is not a peft adapter folder (no adapter_config.json)")
    client = MlflowClient()
    weights = weights_digest(adapter_dir)
    with registry_lock(_uri(), cfg.model_name, cfg.lock_timeout_s):
        existing = find_version(cfg, str(lineage["adapter_digest"]), lineage.get("run_id"), weights)
        if existing is not None:
            log.info(
                "adapter %s is already %s v%s", lineage["adapter_digest"], cfg.model_name, existing.version
            )
            return str(existing.version), False
        client.log_artifacts(run_id, str(adapter_dir), artifact_path="adapter")
        if manifest_path is not None:
            client.log_artifact(run_id, str(manifest_path), artifact_path="adapter_manifest")
        tags = {k: tag_value(v) for k, v in lineage.items() if not isinstance(v, dict | list)}
        if weights is not None:
            tags["adapter_weights_digest"] = weights
        tags.update(
            eval_benchmark=tag_value(eval_summary.get("benchmark")),
            eval_accuracy=tag_value(eval_summary.get("accuracy")),
            eval_k=tag_value(eval_summary.get("k")),
            eval_n_items=tag_value(eval_summary.get("n_items")),
            complete=str(bool(complete)).lower(),
        )
        source = f"{client.get_run(run_id).info.artifact_uri}/adapter"
        version = client.create_model_version(cfg.model_name, source=source, run_id=run_id, tags=tags)
    log.info("registered %s v%s from run %s", cfg.model_name, version.version, run_id)
    return str(version.version), True


def alias_version(cfg: RegistryConfig, alias: str) -> ModelVersion | None:
    return registered_version(cfg.model_name, alias=alias)


def _set_alias(cfg: RegistryConfig, alias: str, version: str) -> None:
    client = MlflowClient()
    client.set_registered_model_alias(cfg.model_name, alias, str(version))
    now = alias_version(cfg, alias)  # sanity re-read: we hold the lock, so this must be ours
    if now is None or str(now.version) != str(version):
        raise RegistryError(
            f"alias {cfg.model_name}@{alias} reads back {now and now.version}, expected {version}"
        )


def set_challenger(cfg: RegistryConfig, version: str) -> bool:
    """Point ``challenger`` at ``version`` unless a newer version already holds it."""
    with registry_lock(_uri(), cfg.model_name, cfg.lock_timeout_s):
        current = alias_version(cfg, cfg.challenger_alias)
        if current is not None and int(current.version) > int(version):
            return False
        _set_alias(cfg, cfg.challenger_alias, version)
    return True


def _accuracy(version: ModelVersion) -> float | None:
    try:
        value = float(version.tags.get("eval_accuracy", "nan"))
    except ValueError:
        return None
    return value if math.isfinite(value) else None


@dataclass(frozen=True)
class PairedEvidence:
    """The challenger against ``champion_version`` on the same items under the same protocol
    (``benchmark``): the mean per-item difference (challenger minus champion) and its standard error."""

    benchmark: str
    champion_version: str
    diff: float
    se: float
    n_items: int
    challenger_accuracy: float
    champion_accuracy: float


# the fewest paired items the rule decides on: with one its standard error is 0, and with a handful
# it is too noisy to be a bar (a tiny validation split is promoted by hand, qerl promote)
MIN_PAIRED_ITEMS = 10
BASE = "base"  # PairedEvidence.champion_version of a comparison with the base model, no adapter


def _margins(cfg: RegistryConfig, policy: PromotionPolicy | None) -> tuple[float, float]:
    """(margin_se, margin): the registered model's policy's, else (a direct call) the config's."""
    return (policy.margin_se, policy.margin) if policy else (cfg.promote_margin_se, cfg.promote_margin)


def _paired_decision(
    cfg: RegistryConfig, champion: ModelVersion | None, ev: PairedEvidence, policy: PromotionPolicy | None
) -> tuple[bool, str]:
    """The paired rule: promote when the difference exceeds both margins (strictly). Without a
    champion the comparison is with the base model (``BASE``)."""
    expected = BASE if champion is None else str(champion.version)
    if ev.champion_version != expected:
        now = "there is none" if champion is None else f"it is now v{champion.version}"
        return False, (
            f"the comparison was with {ev.champion_version} but the champion {now}: "
            "not promoted (register again to compare with the current champion)"
        )
    margin_se, margin = _margins(cfg, policy)
    need = max(margin, margin_se * ev.se)
    against = "the base model" if champion is None else "the champion"
    who = "the base model (no adapter)" if champion is None else f"champion v{champion.version}"
    text = (
        f"on {ev.benchmark} ({ev.n_items} items, paired): {ev.challenger_accuracy:.4f} vs {who} "
        f"{ev.champion_accuracy:.4f}, difference {ev.diff:+.4f} (se {ev.se:.4f}); "
        f"margin max({margin_se} se, {margin}) = {need:.4f}"
    )
    if ev.n_items < MIN_PAIRED_ITEMS:  # se is 0 for one item: any gain would pass the margin
        return (
            False,
            f"too few items to decide against {against} {text}: at least {MIN_PAIRED_ITEMS} are needed",
        )
    if math.isfinite(ev.diff) and ev.diff > need:
        return True, f"beats {against} {text}"
    return False, f"does not beat {against} {text}"


def promotion_decision(
    cfg: RegistryConfig,
    champion: ModelVersion | None,
    version: str,
    benchmark: str,
    accuracy: float | None,
    complete: bool,
    evidence: PairedEvidence | str | None = None,
    policy: PromotionPolicy | None = None,
) -> tuple[bool, str]:
    """(promote?, reason) — the pure rule, given the current champion (None if there is none), the
    paired evidence against it or, without one, against the base model (a string: why there is none,
    so no promotion) and the registered model's policy (its margins; None: the config's)."""
    if not complete:
        return False, "run incomplete or failed: never promoted"
    if accuracy is None or not math.isfinite(accuracy):
        return False, f"no finite accuracy on {benchmark}"
    if champion is not None and str(champion.version) == str(version):
        return True, "already champion"
    against = "the base model" if champion is None else f"champion v{champion.version}"
    if isinstance(evidence, str):
        return False, f"not compared with {against}: {evidence}"
    if evidence is not None:
        return _paired_decision(cfg, champion, evidence, policy)
    if champion is None:  # a direct call with no evidence: nothing to compare with
        return True, f"no champion yet; accuracy {accuracy:.4f} on {benchmark}"
    champ_bench = champion.tags.get("eval_benchmark")
    champ_acc = _accuracy(champion)
    if champ_bench != benchmark:
        return (
            False,
            f"champion v{champion.version} was evaluated on {champ_bench}, not {benchmark}: not comparable",
        )
    if champ_acc is None:
        return True, f"champion v{champion.version} has no recorded accuracy"
    if accuracy > champ_acc + cfg.promote_margin:
        return (
            True,
            f"{accuracy:.4f} beats champion v{champion.version} {champ_acc:.4f} + margin {cfg.promote_margin}",
        )
    return (
        False,
        f"{accuracy:.4f} does not beat champion v{champion.version} {champ_acc:.4f} + margin {cfg.promote_margin}",
    )


def maybe_promote(
    cfg: RegistryConfig,
    version: str,
    benchmark: str,
    accuracy: float | None,
    complete: bool,
    evidence: PairedEvidence | str | None = None,
    lineage: Mapping[str, Any] | None = None,
) -> bool:
    """Make ``version`` champion if the rule says so (see the module docstring); race-safe. With
    ``lineage`` (the register stage's calls) the registered model's policy applies
    (``qerl.pipeline.registry.policy``): a complete candidate with paired evidence sets it when the
    model has none, and a candidate it does not fit is not compared."""
    client = MlflowClient()
    with registry_lock(_uri(), cfg.model_name, cfg.lock_timeout_s):
        champion = alias_version(cfg, cfg.champion_alias)
        policy = None
        if lineage is not None and complete and isinstance(evidence, PairedEvidence):
            policy = first_policy(cfg.model_name, _proposed_policy(cfg, evidence.benchmark, lineage))
            policy = _named_recipe(cfg.model_name, policy, evidence, lineage)
            evidence = (
                mismatch(policy, evidence.benchmark, lineage)
                or heldout_conflict(champion, lineage)
                or evidence
            )
        promote_it, reason = promotion_decision(
            cfg, champion, version, benchmark, accuracy, complete, evidence, policy
        )
        if promote_it and (champion is None or str(champion.version) != str(version)):
            _set_alias(cfg, cfg.champion_alias, version)
        client.set_model_version_tag(cfg.model_name, str(version), "promotion", reason[:5000])
    log.info("%s v%s: %s (%s)", cfg.model_name, version, "promoted" if promote_it else "not promoted", reason)
    return promote_it


def _named_recipe(
    name: str, policy: PromotionPolicy, evidence: PairedEvidence, lineage: Mapping[str, Any]
) -> PromotionPolicy:
    """``policy`` with its base recipe named, when an older qerl set it as a bare hash that every NVFP4
    method shared (``is_legacy_recipe``): paired evidence means the register stage evaluated the
    champion (or the base) on this candidate's base after checking that the champion was trained on
    the same recipe, so the policy takes the candidate's name for it, as a recorded change."""
    recipe = str(lineage.get("quant_recipe"))
    if not is_legacy_recipe(policy.quant_recipe) or is_legacy_recipe(recipe):
        return policy
    against = (
        "the base model" if evidence.champion_version == BASE else f"champion v{evidence.champion_version}"
    )
    by = f"qerl, run {lineage.get('run_id')}: {against} evaluated on base recipe {recipe} (an older qerl's hash named)"
    return change_policy(name, {"quant_recipe": recipe}, by)[1]


def _proposed_policy(cfg: RegistryConfig, benchmark: str, lineage: Mapping[str, Any]) -> PromotionPolicy:
    """The policy a new registered model takes from its first candidate (``policy.first_policy``)."""
    return PromotionPolicy(
        margin_se=cfg.promote_margin_se, margin=cfg.promote_margin, benchmark=benchmark,
        base_digest=str(lineage.get("base_digest")), quant_recipe=str(lineage.get("quant_recipe")),
        set_by="the first candidate" + (f", run {lineage['run_id']}" if lineage.get("run_id") else ""),
    )  # fmt: skip


def promote(cfg: RegistryConfig, name: str, version: str) -> None:
    """Manual promotion (``qerl promote NAME VERSION``): ``name`` v``version`` becomes champion."""
    cfg = cfg.model_copy(update={"model_name": name})
    client = MlflowClient()
    with registry_lock(_uri(), name, cfg.lock_timeout_s):
        try:
            client.get_model_version(name, str(version))
        except MlflowException:
            raise RegistryError(f"model version {name} v{version} does not exist") from None
        _set_alias(cfg, cfg.champion_alias, str(version))
        client.set_model_version_tag(name, str(version), "promotion", "manual promotion")
    log.info("%s v%s promoted to %s manually", name, version, cfg.champion_alias)


def version_info(cfg: RegistryConfig, version: str) -> dict[str, Any]:
    """A JSON-able view of a version: number, source, run, tags, aliases."""
    mv = MlflowClient().get_model_version(cfg.model_name, str(version))
    return {
        "name": mv.name,
        "version": str(mv.version),
        "source": mv.source,
        "run_id": mv.run_id,
        "tags": dict(mv.tags),
        "aliases": sorted(mv.aliases),
    }
