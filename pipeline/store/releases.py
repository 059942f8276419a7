"""The ledger of released registered versions: which runs' adapters retention may now delete.

A registered version is *released* by ``store.keep_versions`` (``qerl.pipeline.registry.release``
decides and carries it out in MLflow). From then on neither its MLflow copy nor the store's copies
are needed, so retention may delete every adapter of the run that registered it, the final one
included, and the warm-start copies of that version (``qerl.pipeline.store.retention``).

The ledger is the store's ``gc.jsonl``, one ``released`` line per version, written after the MLflow
side is done. Retention reads it, not MLflow, so ``qerl gc`` keeps deleting a released run's
copies when the registry is out of reach, and a version only counts as released here when this
work dir released it. A release whose ledger line was lost (a crash after the MLflow side) is found
again by the next release pass, which sees the version's ``released`` tag and writes the line.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from qerl.pipeline.store.artifact_store import ArtifactStore
from qerl.pipeline.store.layout import GC_LOG

EVENT = "released"


@dataclass
class Release:
    """One registered version to release (or released): its model, the runs that registered it,
    the MLflow source of its adapter, and why."""

    registry: str  # the tracking URI as it can be printed
    model_name: str
    version: str
    runs: list[str]
    source: str
    reason: str
    nbytes: int = 0  # the MLflow copy's size where it could be listed
    already: bool = False  # tagged released in MLflow before this pass (the ledger line is missing)
    uri: str = ""  # the tracking URI to connect to; never written (a database URI may hold a password)

    @property
    def label(self) -> str:
        return f"{self.model_name} v{self.version}"


def record(store: ArtifactStore, release: Release) -> None:
    """Append ``release`` to the ledger (after its MLflow side is done)."""
    entry = {
        "event": EVENT,
        "registry": release.registry,
        "model_name": release.model_name,
        "version": release.version,
        "runs": list(release.runs),
        "source": release.source,
        "reason": release.reason,
    }
    store._journal(entry, GC_LOG)


def load(store: ArtifactStore) -> list[Release]:
    """Every released version of the ledger (a line that does not parse is skipped: the ledger is
    append-only, and a torn last line is one a crash cut)."""
    path = store.root / GC_LOG
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and entry.get("event") == EVENT:
            out.append(
                Release(
                    registry=str(entry.get("registry", "")),
                    model_name=str(entry.get("model_name", "")),
                    version=str(entry.get("version", "")),
                    runs=[str(r) for r in entry.get("runs") or []],
                    source=str(entry.get("source", "")),
                    reason=str(entry.get("reason", "")),
                )
            )
    return out


def by_run(releases: Sequence[Release]) -> dict[str, str]:
    """run id -> why its registered version was released (the reason retention gives its deletions)."""
    return {run: f"registered as {r.label}, released ({r.reason})" for r in releases for run in r.runs}
