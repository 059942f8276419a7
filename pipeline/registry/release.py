"""Releasing old registered versions (``store.keep_versions``): the registry side of retention.

Why: every night registers its adapter, and each registered version holds two copies of it, one in
MLflow's artifacts and one in the store (its run's final adapter), which retention otherwise keeps
forever, so a nightly schedule's disk use grows by two adapters a night for as long as it runs. With
``store.keep_versions: N`` a version is *released* when it is not among the N newest versions this
work dir registered of its model and holds no alias (the champion, the challenger or any other).

What a release does, under the registry's lock (``qerl.pipeline.registry.lock``), after re-reading
the version's aliases: it tags the version ``released`` (when, and why), then deletes its adapter
from MLflow's artifacts (the version's ``source``, through MLflow's artifact layer: a local file
store, ``mlflow-artifacts:`` behind a server, cloud stores), then writes the store's ledger line
(``qerl.pipeline.store.releases``), after which retention deletes the run's adapters and the
version's warm-start copies. The version itself stays in the registry with its lineage, metrics and
tags: the history of what ran is kept, only the weights go. A crash at any point is finished by the
next release pass or ``qerl gc`` (the tag is what says a version is released; deleting is
idempotent; the store side follows the ledger line).

What is never released: a version holding an alias, a version registered by a run that did not
complete (it may be resumed, and its registration re-decided), a version a run that did not complete
started from (its resume plans from it), a version no run record of this work dir names (another
work dir's, on a shared registry), and anything at all when ``keep_versions`` is unset (the
default). The store keeps the warm-start copy of a released version while a kept run started from
it, so re-running that night still plans from it. Which ``keep_versions`` applies to a model:
``qerl gc --keep-versions``, else the ``store`` section of the newest run that registered into it.

Readers refuse a released version with a ``RegistryError`` that names it and when it was released
(``check_not_released``): ``qerl eval --adapter models:/…``, ``qerl promote`` and the nightly warm
start. A champion is never released, so a warm start only meets one when an alias was moved onto a
released version by hand.
"""

from __future__ import annotations

import datetime as _dt
import logging
from pathlib import Path
from typing import Any

from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository
from mlflow.tracking import MlflowClient
from pydantic import ValidationError
from qerl.pipeline.registry import health
from qerl.pipeline.registry.adapters import open_registry, registered_version
from qerl.pipeline.registry.lock import RegistryError, registry_lock
from qerl.pipeline.registry.tracking import RegistryConfig, resolve_uris
from qerl.pipeline.store import releases, retention
from qerl.pipeline.store.artifact_store import ArtifactStore
from qerl.pipeline.store.layout import STORE_DIR
from qerl.pipeline.store.retention_policy import RetentionError, load_runs, policy_for
from qerl.pipeline.store.run_record import RunRecord

log = logging.getLogger("qerl.registry")

RELEASED_TAG = "released"


def check_not_released(version: ModelVersion) -> None:
    """A ``RegistryError`` when ``version`` was released: its adapter files are gone."""
    when = version.tags.get(RELEASED_TAG)
    if when is not None:
        raise RegistryError(
            f"{version.name} v{version.version} was released by retention ({when}): its adapter is "
            "deleted; use a kept version (the champion, or one of the newest store.keep_versions)"
        )


def _artifact_bytes(source: str) -> int:
    """The size of the files under ``source`` as the artifact store lists them (0 where it cannot)."""
    try:
        repo = get_artifact_repository(source)

        def walk(path: str | None) -> int:
            return sum(walk(f.path) if f.is_dir else int(f.file_size or 0) for f in repo.list_artifacts(path))

        return walk(None)
    except (MlflowException, OSError):
        return 0


def _registered_runs(work: Path, records: list[RunRecord]) -> dict[tuple[str, str], list[RunRecord]]:
    """(tracking URI, model name) -> the completed run records that registered into it."""
    groups: dict[tuple[str, str], list[RunRecord]] = {}
    for record in records:
        reg = record.registration
        if record.status != "completed" or reg is None or reg.version is None:
            continue
        own = record.config.get("registry") or {}
        try:
            uri, _ = resolve_uris(RegistryConfig.model_validate(own), work)
        except ValidationError as err:
            raise RetentionError(f"run {record.run_id}: bad registry section in its record: {err}") from err
        groups.setdefault((uri, str(reg.model_name)), []).append(record)
    return groups


def _started_from(records: list[RunRecord], name: str, version: str) -> list[str]:
    """The runs not completed (a resume may need their starting adapter) that warm-started from
    ``name`` v``version``."""
    return [
        r.run_id
        for r in records
        if r.status != "completed"
        and str(r.warm_start_version) == version
        and (r.config.get("registry") or {}).get("model_name", name) == name
    ]


def plan_releases(
    work: str | Path, overrides: dict[str, Any] | None = None, notes: list[str] | None = None
) -> list[releases.Release]:
    """The versions a release pass would release now (nothing is touched); why others stay, in
    ``notes``. A registry that cannot be read releases nothing and is noted, never an error: space
    is worth less than a failed gc."""
    work = Path(work)
    notes = notes if notes is not None else []
    done = {(r.registry, r.model_name, r.version) for r in releases.load(ArtifactStore(work / STORE_DIR))}
    every_run = load_runs(work)
    out: list[releases.Release] = []
    for (uri, name), records in sorted(_registered_runs(work, every_run).items()):
        newest = max(records, key=lambda r: str(r.updated_at or r.started_at or ""))
        keep = policy_for(newest, overrides).keep_versions
        if keep is None:
            continue
        runs: dict[str, list[str]] = {}
        for record in records:
            assert record.registration is not None
            runs.setdefault(str(record.registration.version), []).append(record.run_id)
        ordered = sorted(runs, key=int, reverse=True)
        shown = health.shown_uri(uri)
        pending = [v for v in ordered[keep:] if (shown, name, v) not in done]  # the ledger's are done
        if not pending:
            continue
        try:
            open_registry(RegistryConfig(tracking_uri=uri), work)
            found = {v: registered_version(name, v) for v in pending}
        except (RegistryError, MlflowException, OSError) as err:
            notes.append(f"released no version of {name}: the registry {shown} cannot be read ({err})")
            continue
        reason = f"store.keep_versions {keep}: not among the newest {keep} this work dir registered"
        for version, mv in found.items():
            if mv is None:
                notes.append(f"{name} v{version} is no longer in {shown}: nothing to release")
            elif mv.aliases:
                notes.append(f"kept {name} v{version}: it holds @{', @'.join(sorted(mv.aliases))}")
            elif starts := _started_from(every_run, name, version):
                notes.append(f"kept {name} v{version}: unfinished run {starts[0]} started from it")
            else:
                already = RELEASED_TAG in mv.tags
                nbytes = 0 if already else _artifact_bytes(mv.source)
                out.append(releases.Release(shown, name, version, runs[version], mv.source, reason, nbytes,
                                            already, uri=uri))  # fmt: skip
    return out


def release(work: str | Path, rel: releases.Release) -> None:
    """Carry out ``rel`` (see the module docstring); a ``RegistryError`` when the version took an
    alias since it was planned (it is not released then)."""
    cfg = RegistryConfig(tracking_uri=rel.uri or rel.registry)
    uri = open_registry(cfg, work)
    client = MlflowClient()
    with registry_lock(uri, rel.model_name, cfg.lock_timeout_s):
        mv = client.get_model_version(rel.model_name, rel.version)
        if mv.aliases:
            raise RegistryError(f"{rel.label} now holds @{', @'.join(sorted(mv.aliases))}: not released")
        if RELEASED_TAG not in mv.tags:
            when = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
            client.set_model_version_tag(rel.model_name, rel.version, RELEASED_TAG, f"{when}, {rel.reason}")
        get_artifact_repository(mv.source).delete_artifacts()
    releases.record(ArtifactStore(Path(work) / STORE_DIR), rel)
    log.info("released %s (%s)", rel.label, rel.reason)


def release_all(
    work: str | Path, planned: list[releases.Release], notes: list[str] | None = None
) -> set[str]:
    """Carry out every release of ``planned``; the labels of those done. One that fails is noted (and
    logged) and left to the next pass; the others go on."""
    notes = notes if notes is not None else []
    done = set()
    for rel in planned:
        try:
            release(work, rel)
        except (RegistryError, MlflowException, OSError) as err:
            notes.append(f"did not release {rel.label}: {err}")
            log.warning("did not release %s: %s", rel.label, err)
            continue
        done.add(rel.label)
    return done


def release_old_versions(work: str | Path) -> tuple[int, list[str]]:
    """The flow's release pass after a run completes: release what each model's ``keep_versions``
    lets go, then prune the released runs' store copies; (bytes freed, labels released). Never fails
    the run: what could not be done is logged, and ``qerl gc`` finishes it (a release not done is
    planned again; the store copies of one done go by its ledger line)."""
    notes: list[str] = []
    freed, released = 0, []
    try:
        planned = plan_releases(work, notes=notes)
        done = release_all(work, planned, notes)
        for rel in planned:
            if rel.label in done:
                released.append(rel.label)
                freed += rel.nbytes
                for run in rel.runs:
                    freed += retention.apply(work, retention.plan(work, only_run=run))
    except Exception as err:  # noqa: BLE001  # the run is complete and recorded: space must not fail it
        log.warning("release pass stopped (%s: %s); qerl gc finishes it", type(err).__name__, err)
    for note in notes:
        log.info("release pass: %s", note)
    return freed, released
