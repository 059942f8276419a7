"""What retention's marks become on disk: one ``Deletion`` per artifact, and the plan that lists them.

``qerl.pipeline.store.retention_policy`` decides which train artifacts keep their optimizer state and
adapter and which step tables stay; the functions here turn those marks, and the released versions
(``qerl.pipeline.store.releases``), into the files to delete, each with its size and its reason,
skipping what is already gone and noting what cannot be read. ``qerl.pipeline.store.retention``
plans and carries them out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from qerl.pipeline.store import releases
from qerl.pipeline.store.artifact_store import ArtifactStore
from qerl.pipeline.store.layout import MANIFEST, OBJECTS_DIR, OPTIMIZER_FILE, TRAIN_STAGE, WARM_START_STAGE
from qerl.pipeline.store.manifest import ArtifactError, Manifest
from qerl.pipeline.store.retention_policy import Marks
from qerl.pipeline.store.run_record import RunRecord


@dataclass
class Deletion:
    """One thing the plan deletes: files of an artifact (``prune``), a whole superseded artifact
    (``remove``) or a folder (``trash``/``tmp``)."""

    kind: str
    path: Path
    nbytes: int
    reason: str
    stage: str = ""
    key: str = ""
    files: list[str] = field(default_factory=list)
    release: str = ""  # the version being released that this deletion waits for (its label)


@dataclass
class GcPlan:
    deletions: list[Deletion] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    releases: list[releases.Release] = field(default_factory=list)  # to carry out before the deletions

    @property
    def nbytes(self) -> int:
        return sum(d.nbytes for d in self.deletions)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def tree_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def _readable(directory: Path, notes: list[str]) -> Manifest | None:
    """The finished artifact's manifest; None when it is gone (a re-run rebuilds it if ever needed)
    or unreadable (noted: the next lookup moves it aside, not gc's to judge)."""
    if not (directory / MANIFEST).is_file():
        return None
    try:
        return Manifest.load(directory)
    except (ValueError, ArtifactError) as err:
        notes.append(f"kept {directory}: unreadable manifest ({err})")
        return None


def _whole(manifest: Manifest, reason: str, release: str = "") -> Deletion | None:
    """A prune of every file ``manifest`` still holds (and leftovers of an interrupted prune)."""
    directory = manifest.dir
    names = [n for n in manifest.files if n not in manifest.pruned]
    leftovers = [n for n in manifest.pruned if (directory / n).is_file()]
    if not names and not leftovers:
        return None
    nbytes = sum((directory / n).stat().st_size for n in {*names, *leftovers} if (directory / n).is_file())
    return Deletion("prune", directory, nbytes, reason, manifest.stage, manifest.key, names, release)


def adapter_and_optimizer_prunes(
    store: ArtifactStore, marks: Marks, registered: set[str], notes: list[str]
) -> list[Deletion]:
    out = []
    for key in sorted(set(marks.drop_opt) | set(marks.drop_adapter)):
        directory = store.path_for(TRAIN_STAGE, key)
        manifest = _readable(directory, notes)
        if manifest is None:
            continue
        names, reasons = [], []
        if key in marks.drop_opt and key not in marks.keep_opt and OPTIMIZER_FILE in manifest.files:
            if OPTIMIZER_FILE not in manifest.pruned:  # else gone already: no reason to give again
                names.append(OPTIMIZER_FILE)
                reasons.append(f"optimizer: {marks.drop_opt[key]}")
        # a released run's registered adapter is no longer protected as registered (its version is)
        protected = manifest.digest in registered and key not in marks.released
        if key in marks.drop_adapter and key not in marks.keep_adapter and not protected:
            folder = str(manifest.extra.get("adapter", "adapter")).rstrip("/") + "/"
            names += [n for n in manifest.files if n.startswith(folder)]
            reasons.append(f"adapter: {marks.drop_adapter[key]}")
        names = [n for n in names if n not in manifest.pruned]
        # files an interrupted prune marked but did not delete (ArtifactStore.prune removes them too)
        leftovers = [n for n in manifest.pruned if (directory / n).is_file()]
        if leftovers:
            reasons.append(f"left over by an interrupted prune: {leftovers}")
        if names or leftovers:
            nbytes = sum(
                (directory / n).stat().st_size for n in {*names, *leftovers} if (directory / n).is_file()
            )
            out.append(Deletion("prune", directory, nbytes, "; ".join(reasons), TRAIN_STAGE, key, names))
    return out


def table_prunes(store: ArtifactStore, marks: Marks, notes: list[str]) -> list[Deletion]:
    """Every file of the rollout and scored tables ``marks`` drops (``keep_step_tables: false``)."""
    out = []
    for stage, key in sorted(set(marks.drop_tables) - marks.keep_tables):
        manifest = _readable(store.path_for(stage, key), notes)
        deletion = manifest and _whole(manifest, marks.drop_tables[(stage, key)])
        if deletion:
            out.append(deletion)
    return out


def warm_start_prunes(
    store: ArtifactStore,
    released: Sequence[releases.Release],
    releasing: Sequence[releases.Release],
    live: list[str],
    started: dict[str, str],
    notes: list[str],
) -> list[Deletion]:
    """Every file of the warm-start copies (``qerl.pipeline.registry.adapters.fetch_adapter``) of a
    released version, matched by its MLflow source; none while a run is live (it may be reading
    one), and not those whose digest is in ``started`` (digest -> a kept run that started from it)."""
    pending = {r.source: r.label for r in releasing if r.source}
    sources = {**{r.source: r.label for r in released if r.source}, **pending}
    out: list[Deletion] = []
    for directory in sorted((store.root / OBJECTS_DIR / WARM_START_STAGE).glob("*")):
        manifest = _readable(directory, notes)
        source = str(manifest.config.get("source", "")) if manifest else ""
        if manifest is None or source not in sources:
            continue
        if live:
            notes.append(
                f"kept the warm-start copy of {sources[source]}: run {live[0]} is live (it may read it)"
            )
            continue
        if manifest.digest in started:
            run = started[manifest.digest]
            notes.append(f"kept the warm-start copy of {sources[source]}: run {run} started from it")
            continue
        deletion = _whole(
            manifest, f"warm-start copy of {sources[source]}, released", pending.get(source, "")
        )
        if deletion:
            out.append(deletion)
    return out


def name_releases(
    deletions: list[Deletion], releasing: Sequence[releases.Release], records: list[RunRecord]
) -> None:
    """Tag each train deletion of a run whose version ``releasing`` releases with that release's label."""
    label_of_key: dict[tuple[str, str], str] = {}
    by_id = {r.run_id: r for r in records}
    for rel in releasing:
        for run in rel.runs:
            for _, key in by_id[run].train_keys() if run in by_id else []:
                label_of_key[(TRAIN_STAGE, key)] = rel.label
    for d in deletions:
        d.release = label_of_key.get((d.stage, d.key), "")
