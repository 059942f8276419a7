"""What a consumer of a pruned input gets: ``PrunedInputError``, naming the step, the file and why.

Retention (``qerl.pipeline.store.retention``) deletes files of finished artifacts on purpose and the
manifest keeps their records. A stage that reads an adapter (rollout, evaluate, register) calls
``require_adapter`` before it builds, so a pruned one fails with the retention error (which train
step, which file, the reason the prune recorded) instead of the engine's "no adapter_config.json";
a cache hit reads no adapter and never gets there. The RL flow catches the error for the checkpoint
it continues from and rebuilds it (``qerl.flows.steps.Chain``).
"""

from __future__ import annotations

from pathlib import Path

from qerl.pipeline.store.layout import MANIFEST
from qerl.pipeline.store.manifest import ArtifactError, Manifest


class PrunedInputError(ArtifactError):
    """A consumer needs files that retention pruned from a stored artifact; ``stage``/``key`` name
    it (the flow rebuilds it and retries, ``qerl.flows.steps.Chain``)."""

    def __init__(self, message: str, stage: str = "", key: str = ""):
        super().__init__(message)  # args = (message,): pickles (Prefect may copy a task's error)
        self.stage, self.key = stage, key


def require_adapter(adapter_dir: str | Path | None, consumer: str) -> None:
    """Raise ``PrunedInputError`` naming the step and the file when ``adapter_dir`` is the adapter
    folder of a stored artifact whose adapter retention pruned (a folder outside the store, or a
    whole one, passes: its reader checks it). A consumer calls this before it builds."""
    if adapter_dir is None:
        return
    folder = Path(adapter_dir)
    if not (folder.parent / MANIFEST).is_file():
        return
    try:
        manifest = Manifest.load(folder.parent)
    except (ValueError, ArtifactError):
        return  # not ours to judge here: a lookup of that artifact moves it aside
    gone = sorted(  # adapter_config.json first: the file a reader looks for
        (n for n in manifest.pruned if n.startswith(f"{folder.name}/")),
        key=lambda n: (not n.endswith("/adapter_config.json"), n),
    )
    if gone:
        step = manifest.extra.get("step", "?")
        raise PrunedInputError(
            f"{consumer} needs the adapter of {manifest.stage} step {step} ({manifest.stage}/{manifest.key}), "
            f"but its '{gone[0]}' was deleted by retention ({manifest.pruned[gone[0]]}); "
            "`qerl run` rebuilds it, or keep it with store.keep_adapters_every",
            manifest.stage,
            manifest.key,
        )
