"""What a registered version says of where it came from, and how a version's base is told apart.

A run registers its final adapter with a lineage (``run_lineage``): the base model's digest, the
recipe that quantized it (``quant_recipe``, ``adapters.base_recipe``) and the exact checkpoint
(``base_checkpoint``, which ``qerl eval`` evaluates on), the training data, qerl's version, the run
and flow run, the engine mode, a night's warm start, an ablation's id and arm, and the validation
items the lineage held out (``qerl.pipeline.registry.heldout``). Everything comes from the run's
record and its quantize manifest, so the same run registers the same lineage on every attempt.

A champion is evaluated against a candidate only on its own base: ``version_recipe`` reads a
version's recipe from its tags, or for a version an older qerl registered (a bare hash that RTN and
GPTQ bases share) from the checkpoint its run's record names, where that record is in the work dir.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from qerl.pipeline.registry import heldout
from qerl.pipeline.registry.adapters import base_lineage_digest, base_recipe, is_legacy_recipe
from qerl.pipeline.store.manifest import ArtifactError, Manifest
from qerl.pipeline.store.run_record import RecordError, RunRecord, load_record

NO_VALIDATION = (
    "the run held out no validation split (eval.validation.size 0), and promotion never decides on the "
    "test set: not promoted automatically (qerl promote does it by hand)"
)


def run_lineage(
    record: RunRecord, quantized: Manifest, code_version: str, flow_run_id: str, engine_mode: str,
    warm_start_tags: Mapping[str, str] | None,
) -> dict[str, str]:  # fmt: skip
    """The lineage tags of ``record``'s final adapter (module docstring); ``warm_start_tags``: the
    tags of the version a night warm-started from (None: it started from the base)."""
    assert record.data is not None, "a run registers after its data phase"
    lineage = {
        "base_digest": base_lineage_digest(quantized),
        "quant_recipe": base_recipe(quantized),
        "base_checkpoint": quantized.digest,
        "dataset_digest": record.data.dataset_digest,
        "code_version": code_version,
        "flow_run_id": flow_run_id,
        "run_id": record.run_id,
        "engine_mode": engine_mode,
    }
    if record.night is not None:
        lineage.update(night=record.night.isoformat(), warm_start=str(record.warm_start_version))
    if record.ablation is not None:
        lineage.update(ablation_id=record.ablation.id, arm=record.ablation.arm)
    items = record.data.validation.digest if record.data.validation else heldout.NO_HELDOUT
    lineage["validation_digest"] = items
    lineage[heldout.HELDOUT_TAG] = heldout.heldout_lineage(items, warm_start_tags)
    return lineage


def version_recipe(tags: Mapping[str, Any], work: Path) -> str:
    """A registered version's base recipe (module docstring); for an older qerl's version whose run
    is not in ``work``, the bare hash with the reason it cannot be told apart."""
    recipe = str(tags.get("quant_recipe"))
    if not is_legacy_recipe(recipe):
        return recipe
    try:
        quantize = load_record(work, str(tags.get("run_id"))).quantize
        if quantize is None:
            raise RecordError("no quantize section")
        checkpoint = Manifest.load(Path(quantize.manifest))
    except (OSError, ValueError, ArtifactError):
        return f"{recipe} (an older qerl's hash, and its run's checkpoint is not in this work directory)"
    return base_recipe(checkpoint)
