"""A nightly run's starting adapter: the registered champion's weights, checked against this run.

A night's step 0 starts from the registered champion's adapter weights (fresh optimizer), fetched
through MLflow into the store (stage ``warm-start``, ``qerl.pipeline.registry.adapters``), whose
digest enters every downstream cache key. A champion trained on another base model or with another
LoRA shape is an error, not a silent start from scratch. A resumed night names its own registered
version, so it starts where it first started, even when that version has been released since
(``qerl.pipeline.registry.release``): retention keeps the store copy a kept run started from, and
without it the night cannot be re-run, which the error says. A released champion (an alias moved
onto it by hand) is refused by name.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from qerl.pipeline.planning.errors import RunPlanError
from qerl.pipeline.store.artifact_store import ArtifactStore
from qerl.pipeline.store.manifest import Manifest

log = logging.getLogger("qerl.runplan")


def warm_start_adapter(
    cfg: Any, work: Path, store: ArtifactStore, base_digest: str, version: str | None = None
) -> Manifest | None:
    """The champion's adapter (or registered ``version``'s: a resumed night keeps its own) as a store
    artifact whose folder ``adapter/`` holds it; None when there is no champion yet.

    ``cfg`` is the RunConfig; ``base_digest`` the lineage digest of this run's base model, which the
    adapter must have been trained on."""
    from mlflow.exceptions import MlflowException
    from qerl.pipeline.registry import adapters, tracking
    from qerl.pipeline.registry.lock import RegistryError
    from qerl.pipeline.registry.release import RELEASED_TAG, check_not_released

    reg = tracking.connect(cfg.registry, work)
    if version is None:
        champion = adapters.registered_version(reg.model_name, alias=reg.champion_alias)
        if champion is None:
            log.info(
                "warm start: %s has no @%s yet; starting from the base", reg.model_name, reg.champion_alias
            )
            return None
    else:
        champion = tracking.MlflowClient().get_model_version(reg.model_name, str(version))
    what = f"{reg.model_name} v{champion.version}"
    try:
        if version is None:  # a resumed night's version may be released: its store copy serves (below)
            check_not_released(champion)
        hint = "it cannot warm-start this run (set loop.warm_start: base, or promote a matching version)"
        adapters.check_base(champion, base_digest, "this run's base", hint)
    except RegistryError as err:
        raise RunPlanError(str(err)) from None
    released = champion.tags.get(RELEASED_TAG)
    try:
        manifest, cached = adapters.fetch_adapter(champion, store)
    except (MlflowException, RegistryError):
        if released is None:
            raise
        manifest, cached = None, False  # not in the store, and MLflow's copy is deleted
    if released is not None and (manifest is None or manifest.pruned):
        raise RunPlanError(
            f"this night started from {what}, which retention released ({released}); its store copy is "
            "gone too (no kept run started from it), so the night cannot be re-run"
        )
    assert manifest is not None
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
