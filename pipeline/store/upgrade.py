"""What changed since a run's last attempt, said by ``qerl resume`` before it starts anything.

Two kinds of change reach a resumed run between a crash and its resume:

- **qerl's code.** Each artifact's manifest records the module roots its code version hashed
  (``code_modules``). The check hashes them again with the installed qerl: where the version moved,
  the stage computes something else now, its key changes and the artifact is built again; so is
  every step after the first such step (each step's inputs hold the previous step's adapter).
  Manifests written by a qerl that recorded no roots are reported as rebuilt, which they are: their
  keys were computed another way.
- **The dependencies** (torch, transformers, vLLM, compressed-tensors, ...), which the code version
  does not hash (``qerl.pipeline.store.code_version``). Steps already built keep the numbers of the
  versions that built them and the steps still to come get the new ones: the check names each
  change so that a user can decide before the run mixes them. It does not refuse: a security release
  of a dependency between a crash and its resume is normal, and the record keeps both sets.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qerl.pipeline.store.artifact_store import ArtifactStore
from qerl.pipeline.store.code_version import code_version, dependency_versions
from qerl.pipeline.store.layout import STORE_DIR, TRAIN_STAGE
from qerl.pipeline.store.manifest import ArtifactError, Manifest
from qerl.pipeline.store.run_record import RunRecord

STEP_STAGES = ("rollout", "score", TRAIN_STAGE)


def version_changes(before: dict[str, Any], now: dict[str, str]) -> list[str]:
    """``name old -> new`` for each package ``before`` recorded whose version is not ``now``'s."""
    return [f"{k} {v} -> {now.get(k, 'not installed')}" for k, v in sorted(before.items()) if now.get(k) != v]


def _code_moved(manifest: Manifest, memo: dict[tuple[str, ...], str]) -> bool:
    roots = tuple(manifest.code_modules)
    if not roots:
        return True  # keyed by a qerl that recorded no roots: its key is computed another way now
    if roots not in memo:
        try:
            memo[roots] = code_version(*roots)
        except ArtifactError:  # a module this qerl no longer has
            memo[roots] = ""
    return memo[roots] != manifest.code_version


def _manifest(store: ArtifactStore, stage: str, key_or_dir: str) -> Manifest | None:
    path = Path(key_or_dir) if "/" in key_or_dir else store.path_for(stage, key_or_dir)
    try:
        return Manifest.load(path)
    except (OSError, ValueError, ArtifactError):
        return None  # gone or unreadable: the resume's own lookup rebuilds and says so


def code_changes(work: Path, record: RunRecord) -> tuple[list[str], int | None]:
    """(stages whose code moved, the first step the resume builds again: None if none, 0 if all)."""
    store, memo, moved = ArtifactStore(work / STORE_DIR), {}, []
    quantized = _manifest(store, "quantize", record.quantize.manifest) if record.quantize else None
    if quantized is not None and _code_moved(quantized, memo):
        moved.append("quantize")
    first = 0 if moved else None
    for entry in record.steps:
        for stage in STEP_STAGES:
            key = getattr(entry.manifests, stage, None)
            built = _manifest(store, stage, key) if key else None
            if built is not None and _code_moved(built, memo):
                moved.append(stage)
                first = entry.step if first is None else first
    return sorted(set(moved)), first


def since_last_attempt(work: Path, record: RunRecord) -> list[str]:
    """The lines ``qerl resume`` prints before it starts: what changed since ``record``'s attempt
    (the run record as that attempt left it) and which steps will be built again."""
    before = record.versions or {"qerl": str(record.code_version)}
    changes = version_changes(before, dependency_versions())
    lines = []
    if changes:
        lines.append(f"installed since the last attempt: {', '.join(changes)}")
    moved, first = code_changes(work, record)
    steps = len(record.steps)
    if first is None:
        what = f"the base and all {steps} built steps" if steps else "everything built so far"
        lines.append(f"kept: {what} (qerl's code for them is unchanged)")
    elif first == 0 and "quantize" in moved:
        lines.append(f"builds again: the base and every step (code changed: {', '.join(moved)})")
    else:
        kept = f"steps 0-{first - 1}" if first > 1 else "step 0" if first == 1 else "no step"
        lines.append(
            f"kept: the base and {kept}; builds again from step {first} (code changed: {', '.join(moved)})"
        )
    if changes and steps and first != 0:
        lines.append("the steps kept were built with the old versions, the steps to come use the new ones")
    return lines
