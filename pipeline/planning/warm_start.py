"""A nightly run's starting adapter: the registered champion's weights, checked against this run.

A night's step 0 starts from the registered champion's adapter weights (fresh optimizer), fetched
through MLflow into the store (stage ``warm-start``), whose digest enters every downstream cache key.
A champion trained on another base model or with another LoRA shape is an error, not a silent start
from scratch. A resumed night names its own registered version, so it starts where it first started.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

from qerl.pipeline.planning.errors import RunPlanError
from qerl.pipeline.store.artifact_store import ArtifactStore
from qerl.pipeline.store.code_version import code_version
from qerl.pipeline.store.layout import WARM_START_STAGE
from qerl.pipeline.store.manifest import BuildResult, Manifest

log = logging.getLogger("qerl.runplan")


def warm_start_adapter(
    cfg: Any, work: Path, store: ArtifactStore, base_digest: str, version: str | None = None
) -> Manifest | None:
    """The champion's adapter (or registered ``version``'s: a resumed night keeps its own) as a store
    artifact whose folder ``adapter/`` holds it; None when there is no champion yet.

    ``cfg`` is the RunConfig; ``base_digest`` the lineage digest of this run's base model, which the
    adapter must have been trained on."""
    from qerl.pipeline.registry import promotion, tracking

    reg = tracking.connect(cfg.registry, work)
    if version is None:
        champion = promotion.alias_version(reg, reg.champion_alias)
        if champion is None:
            log.info(
                "warm start: %s has no @%s yet; starting from the base", reg.model_name, reg.champion_alias
            )
            return None
    else:
        champion = tracking.MlflowClient().get_model_version(reg.model_name, str(version))
    what = f"{reg.model_name} v{champion.version}"
    if champion.tags.get("base_digest") != base_digest:
        raise RunPlanError(
            f"{what} was trained on base {champion.tags.get('base_digest')}, this run's base is {base_digest}: "
            "it cannot warm-start this run (set loop.warm_start: base, or promote a matching version)"
        )
    config = {"model_name": reg.model_name, "version": str(champion.version), "source": champion.source}
    inputs = {"registered_adapter": str(champion.tags.get("adapter_digest", "unknown"))}

    def build(tmp: Path) -> BuildResult:
        promotion.download_adapter(champion, tmp / "adapter")
        return BuildResult(
            mode="mlflow-download", extra={"version": str(champion.version), "adapter": "adapter"}
        )

    manifest, cached = store.produce(
        WARM_START_STAGE, config, inputs, code_version(sys.modules[__name__]), build
    )
    from qerl.pipeline.rl.policy import check_adapter_shape

    try:
        check_adapter_shape(manifest.dir / "adapter", cfg.train)
    except ValueError as err:
        raise RunPlanError(
            f"{what} cannot warm-start this run ({err}); set loop.warm_start: base, or match "
            "train.lora_r/lora_alpha/target_modules"
        ) from None
    log.info("warm start from %s (%s)%s", what, manifest.dir, " [cached]" if cached else "")
    return manifest
