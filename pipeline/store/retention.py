"""Store retention (``qerl gc``): delete what no resume, lookup or registration needs.

Why: every train artifact holds the fp32 adapter and the AdamW moments; at 7B with r=32 that is
about 1 GB a step (a third adapter, two thirds optimizer), so a 500-step run fills ~480 GB. Only the
newest optimizer state is ever read again (by the next step, or by a resume), and only some adapters
are worth keeping.

What is deleted (per run, from its record ``<work>/runs/<id>/run.json``; policy ``RetentionConfig``,
the run config's ``store`` section, defaults here):

- the optimizer state (``optimizer.safetensors``) of every train step of a completed run (a finished
  run is never continued: a re-run finds every step), and of every step but the last
  ``keep_optimizer_last`` of an unfinished one (the last one is what a resume continues from);
- the adapters of steps that are not a multiple of ``keep_adapters_every`` (unset: the run's
  ``loop.eval_every``, so the evaluated steps' stay; 0 keeps all); the final step's, every
  registered one's and every step whose optimizer is kept stay;
- with ``keep_step_tables: false``, a completed run's rollout and scored tables (its record and
  MLflow keep every step's metrics; a chain through them can no longer be rebuilt);
- every adapter of a completed run whose registered version was released (``keep_versions``;
  ``qerl.pipeline.registry.release`` releases it in MLflow first and writes the store's ledger,
  ``qerl.pipeline.store.releases``), the final one included, and the warm-start copies of that
  version (none while a run is live, nor one a run not released started from: its re-run reads it);
- everything in ``store/trash`` (corrupt artifacts moved aside) older than ten minutes (a younger
  entry may be a prune still moving files), and build folders in ``store/tmp`` whose producer is
  dead (its key's lock is free);
- with the installed code versions (``qerl gc``), the copies of the base model's artifacts that an
  older qerl built and the installed one built again byte for byte
  (``qerl.pipeline.store.superseded``), whole, manifest included: no lookup by this qerl reaches them.

What is never deleted: anything of a *live* run (an attempt holds its lock,
``qerl.pipeline.store.run_lock``, or its status is ``running`` and it was updated within
``live_window_h``, for an attempt on another machine, whose lock is not seen here: gc cannot know
which of its files the running process holds, so all of them stay), the adapter of every version
registered from this store until that version is released (its
register manifest names the train digest; MLflow holds its own copy, but ``qerl eval`` and champion
lookups read the store's), the final evaluated adapter of every run an ablation lists (below), every
artifact of every run an unfinished ablation lists (below), any train artifact that no run record
names (benchmarks, tests: not ours to judge), manifests (but a superseded copy's), and anything
outside the store: run records, logs, and ablations (``<work>/ablations/<id>/``: ``ablation.json``,
``report.md``, ``plots/``).

Ablations (``qerl ablate``, ``qerl.flows.ablate``): each (arm, seed) is an ordinary run with its own run
record. Its runs share their steps up to where their configs part (the NVFP4 arms while sigma is 0),
so while any run the ablation record lists has not completed, nothing of any listed run is pruned:
the unfinished one may continue from any shared checkpoint, and a rebuild of a pruned one on a GPU
does not give the same bytes. When the last listed run completes, its final prune
(``prune_run``) applies every listed run's own policy (an ablation never trains a finished run
again: re-running it finds every stage in the store, and a lookup serves a pruned artifact). What
the comparison is about, each listed run's final evaluated adapter, is kept like a registered one,
whatever the policy (``keep_adapters_every`` included). Its evaluation tables (``items.parquet``, read
by the report) are evaluate artifacts, which gc never touches. An unreadable ``ablation.json`` is
noted and skipped rather than stopping gc: every run it lists has its own record, read regardless, and
that record already names the same adapters; the ablation record only makes the guarantee explicit.

How: an artifact is *pruned*, not removed (``ArtifactStore.prune``): the manifest keeps every
file's record, so its digest and every downstream cache key stay valid and a re-run of a finished
run is still all cache hits; the deleted files are listed in the manifest's ``pruned``. A lookup
serves the artifact; a consumer of a pruned file gets an ArtifactError naming the step, the file
and why (``require_adapter`` for the rollout, evaluate and register stages). The RL flow recomputes
on demand instead: a step that must build from a pruned checkpoint, or a rollout or evaluation
that needs a pruned adapter, rebuilds the chain from its last whole checkpoint
(``qerl.flows.steps.Chain``; a rebuild that does not give the same bytes is re-keyed,
``ArtifactStore._heal``). Resuming an unfinished run needs none of that: its last checkpoint is
always kept.
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
import shutil
import uuid
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from qerl.pipeline.store import releases, run_lock, superseded
from qerl.pipeline.store.artifact_store import ArtifactStore
from qerl.pipeline.store.layout import (
    GC_LOG,
    OBJECTS_DIR,
    RUNS_DIR,
    STORE_DIR,
    TMP_DIR,
    TRASH_DIR,
)
from qerl.pipeline.store.retention_policy import (
    Marks,
    RetentionConfig,
    RetentionError,
    is_live,
    load_ablations,
    load_runs,
    mark_ablations,
    mark_run,
    policy_for,
    registered_train_digests,
    unfinished_listed,
)
from qerl.pipeline.store.retention_prunes import (
    Deletion,
    GcPlan,
    adapter_and_optimizer_prunes,
    human_bytes,
    name_releases,
    table_prunes,
    tree_bytes,
    warm_start_prunes,
)

log = logging.getLogger("qerl.retention")

TRASH_MIN_AGE_S = 600.0  # younger trash entries may still be filling (a prune in progress)


def _tmp_lock_name(folder: Path) -> str | None:
    """``<stage>-<key>`` of a build folder ``tmp/<stage>-<key>-<nonce>`` (see ArtifactStore.produce)."""
    parts = folder.name.rsplit("-", 2)
    return f"{parts[0]}-{parts[1]}" if len(parts) == 3 and len(parts[1]) == 32 else None


def _sweeps(store: ArtifactStore, notes: list[str], now: _dt.datetime) -> list[Deletion]:
    out = []
    for entry in sorted((store.root / TRASH_DIR).iterdir()):
        # a fresh entry may be a prune (or a gc) still moving files into it: leave it to the next gc
        if now.timestamp() - entry.lstat().st_mtime < TRASH_MIN_AGE_S:
            notes.append(f"kept {entry}: moved to trash less than {TRASH_MIN_AGE_S:.0f} s ago")
            continue
        out.append(Deletion("trash", entry, tree_bytes(entry), "moved aside earlier (corrupt or pruned)"))
    for entry in sorted((store.root / TMP_DIR).iterdir()):
        name = _tmp_lock_name(entry)
        if name is None:
            notes.append(f"kept {entry}: not a build folder of this store")
            continue
        with store.try_lock(name) as free:
            if free:  # the lock name rides in ``key``: apply re-takes it before deleting
                out.append(
                    Deletion("tmp", entry, tree_bytes(entry), "unfinished build of a dead process", key=name)
                )
            else:
                notes.append(f"kept {entry}: its build is running")
    return out


def plan(
    work: str | Path,
    overrides: dict[str, Any] | None = None,
    now: _dt.datetime | None = None,
    only_run: str | None = None,
    current_code: Mapping[str, Collection[str]] | None = None,
    releasing: Sequence[releases.Release] = (),
) -> GcPlan:
    """What gc would delete under ``work`` (nothing is touched).

    ``overrides`` replace RetentionConfig fields for every run; ``only_run`` restricts pruning to that
    run's steps and treats it as not live (the flow pruning its own past steps) and skips the sweeps;
    ``current_code`` (stage -> the installed code versions, one per scheme) adds the superseded base artifacts
    (``qerl.pipeline.store.superseded``), unless a run is live. ``releasing``: versions to release
    first (``qerl.pipeline.registry.release``); their runs' adapters and warm-start copies are
    planned as if released, each deletion naming the release it waits for (``Deletion.release``).
    """
    work = Path(work)
    if not (work / STORE_DIR / OBJECTS_DIR).is_dir():
        raise RetentionError(f"no artifact store under {work} (expected {work / STORE_DIR / OBJECTS_DIR})")
    store = ArtifactStore(work / STORE_DIR)
    result = GcPlan(releases=list(releasing))
    marks = Marks()
    records = load_runs(work)
    released = releases.load(store)
    why_released = releases.by_run([*released, *releasing])
    live_runs: list[str] = []
    if only_run is not None and only_run not in {r.run_id for r in records}:
        raise RetentionError(f"no run record for '{only_run}' under {work / RUNS_DIR}")
    for record in records:
        policy = policy_for(record, overrides)
        other = record.run_id != only_run
        locked = other and run_lock.holder(work / RUNS_DIR / record.run_id) is not None
        live = other and (locked or is_live(record, policy.live_window_h, now))
        if live:
            live_runs.append(record.run_id)
            why = "an attempt holds its lock" if locked else f"updated within {policy.live_window_h} h"
            result.notes.append(f"kept every artifact of live run {record.run_id} ({why})")
        # with only_run, every other run only protects (as a live one does): none of its drops count
        protect_only = live or (only_run is not None and record.run_id != only_run)
        mark_run(marks, record, policy, protect_only, why_released.get(record.run_id))
    mark_ablations(marks, load_ablations(work, result.notes), records, result.notes)
    result.deletions += adapter_and_optimizer_prunes(
        store, marks, registered_train_digests(store), result.notes
    )
    result.deletions += table_prunes(store, marks, result.notes)
    name_releases(result.deletions, releasing, records)
    started = {  # the warm-start copies kept runs started from: a re-run of one reads it
        r.plan.warm_start.digest: r.run_id
        for r in records
        if r.run_id not in why_released and r.plan and r.plan.warm_start and r.plan.warm_start.digest
    }
    result.deletions += warm_start_prunes(store, released, releasing, live_runs, started, result.notes)
    if only_run is None:
        result.deletions += _sweeps(store, result.notes, now or _dt.datetime.now(_dt.UTC))
    if only_run is None and current_code:
        result.deletions += _superseded(store, current_code, live_runs, result.notes)
    return result


def _superseded(
    store: ArtifactStore, current: Mapping[str, Collection[str]], live: list[str], notes: list[str]
) -> list[Deletion]:
    found = superseded.superseded(store, current, notes)
    if found and live:
        notes.append(f"kept {len(found)} superseded base artifacts: run {live[0]} is live (it may read one)")
        return []
    return [Deletion("remove", m.dir, tree_bytes(m.dir), why, m.stage, m.key) for m, why in found]


def _delete_aside(store: ArtifactStore, folder: Path) -> int:
    """Rename ``folder`` into trash, then delete it (a crash in between leaves trash for the next
    sweep, never half a folder in place); the bytes freed."""
    aside = store.root / TRASH_DIR / f"gc-{folder.name}-{uuid.uuid4().hex[:8]}"
    os.replace(folder, aside)
    freed = tree_bytes(aside)
    shutil.rmtree(aside)
    return freed


def apply(work: str | Path, gc_plan: GcPlan) -> int:
    """Carry out ``gc_plan``; returns the bytes freed. Folders are renamed aside, then deleted."""
    store = ArtifactStore(Path(work) / STORE_DIR)
    freed = 0
    for d in gc_plan.deletions:
        if d.kind == "prune":
            freed += store.prune(d.stage, d.key, d.files, d.reason)
        elif d.kind == "trash":
            claimed = d.path.with_name(f"{d.path.name}.gc-{uuid.uuid4().hex[:8]}")
            try:  # claim it first: a second gc running at the same time skips what this one took
                os.replace(d.path, claimed)
            except FileNotFoundError:
                continue
            freed += tree_bytes(claimed)
            shutil.rmtree(claimed) if claimed.is_dir() else claimed.unlink()
        elif d.kind == "remove":  # a superseded artifact, whole; a build of its key waits for the lock
            with store.lock(f"{d.stage}-{d.key}"):
                if d.path.is_dir():
                    freed += _delete_aside(store, d.path)
                    store._journal(
                        {"stage": d.stage, "key": d.key, "event": "removed", "reason": d.reason}, GC_LOG
                    )
        elif d.kind == "tmp":
            with store.try_lock(d.key) as free:
                if free and d.path.exists():  # re-checked: a producer may have started since the plan
                    freed += _delete_aside(store, d.path)
        else:
            raise ValueError(f"unknown deletion kind {d.kind!r} for {d.path}")
    log.info("gc freed %s in %d deletions", human_bytes(freed), len(gc_plan.deletions))
    return freed


def prune_run(work: str | Path, run_id: str, policy: RetentionConfig | None = None) -> int:
    """Apply retention to one run's past steps (the flow calls this after each step); bytes freed.

    When gc cannot decide safely (another run's record or a register manifest is unreadable) this
    deletes nothing and logs a warning instead of failing the run: space is worth less than the run.
    The last run of an ablation to complete also prunes the other runs it lists, which their own
    final prunes left whole (see the module docstring), each by its own policy.
    """
    overrides = policy.model_dump(exclude_unset=True) if policy is not None else None
    try:
        freed = apply(work, plan(work, overrides=overrides, only_run=run_id))
        for sibling in released_siblings(Path(work), run_id):
            freed += apply(work, plan(work, only_run=sibling))
    except RetentionError as err:
        log.warning("retention skipped for run %s: %s", run_id, err)
        return 0
    return freed


def released_siblings(work: Path, run_id: str) -> list[str]:
    """The other runs of every ablation listing ``run_id`` whose listed runs have all completed."""
    runs = {r.run_id: r for r in load_runs(work)}
    out: list[str] = []
    for ablation in load_ablations(work, []):
        listed = [str(e.get("run_id")) for e in ablation["runs"] if isinstance(e, dict)]
        if run_id in listed and not unfinished_listed(ablation, runs):
            out += [r for r in listed if r != run_id and r in runs and r not in out]
    return out
