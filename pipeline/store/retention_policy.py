"""What retention keeps: the policy (``RetentionConfig``) and the marks it sets on train artifacts.

Each run record (``<work>/runs/<id>/run.json``) lists its steps' rollout, score and train keys;
its policy (the run config's ``store`` section) marks which optimizer states, adapters and step
tables of those steps may go and which stay. Protections add to the keep marks and always win:
every artifact of a live run, an unfinished run's last ``keep_optimizer_last`` steps, its final
adapter, each ablation's final evaluated adapters, every artifact of every run an unfinished
ablation lists (another of its runs may continue from them), and (in
``qerl.pipeline.store.retention``) every registered adapter. A completed run whose registered
version was released (``keep_versions``) keeps no adapter at all, unless a protection keeps one.
The reasons are written in that module's docstring; ``qerl.pipeline.store.retention`` turns the
marks into a plan of deletions and carries it out.
"""

from __future__ import annotations

import datetime as _dt
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ConfigDict, Field, ValidationError, field_validator
from qerl.pipeline.config import StrictModel, resource_field
from qerl.pipeline.store.artifact_store import ArtifactStore
from qerl.pipeline.store.layout import (
    ABLATION_DIR,
    ABLATION_RECORD,
    MANIFEST,
    OBJECTS_DIR,
    REGISTER_STAGE,
    TRAIN_STAGE,
)
from qerl.pipeline.store.manifest import ArtifactError, Manifest
from qerl.pipeline.store.run_record import RunRecord, read_records
from qerl.pipeline.store.shared import check_uri

TABLE_STAGES = ("rollout", "score")  # a step's tables: what ``keep_step_tables`` is about


class RetentionConfig(StrictModel):
    """A run's ``store`` section: what ``qerl gc`` (and the flow, after each step and at the end) may
    delete from the store, and whether the run checks its disk estimate first
    (``qerl.pipeline.planning.disk_plan``); and ``uri``, the fleet's shared store
    (``qerl.pipeline.store.shared``)."""

    model_config = ConfigDict(hide_input_in_errors=True)  # a rejected uri may hold a credential

    keep_optimizer_last: int = Field(
        2,
        ge=1,
        description="optimizer states kept per unfinished run: those of its last K steps (resume needs 1); "
        "a completed run keeps none",
    )
    keep_adapters_every: int | None = Field(
        None,
        ge=0,
        description="keep every E-th step's adapter (unset: the run's loop.eval_every; 0: all); "
        "final and registered adapters always kept",
    )
    keep_step_tables: bool = Field(
        True,
        description="keep a completed run's rollout and scored tables (false: they go; the run record "
        "and MLflow keep every step's metrics)",
    )
    check_disk: bool = Field(
        True,
        description="refuse to start a run whose estimated writes do not fit the work dir's free space",
    )
    live_window_h: float = Field(
        24.0, gt=0, description="a run 'running' and updated within this many hours is live: gc skips it"
    )
    keep_versions: int | None = Field(
        None,
        ge=1,
        description="keep the adapters of the newest N versions this work dir registered (and of any "
        "holding an alias); older ones are released: their MLflow and store copies go (unset: keep all)",
    )
    uri: str | None = resource_field(
        None,
        description="the fleet's shared store, of which the local store is a cache: s3://bucket[/prefix] "
        "(credentials and endpoint from AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL) or "
        "an absolute path / file:///path on a shared mount (unset: the store is this machine's only)",
    )

    @field_validator("uri")
    @classmethod
    def _shared_uri(cls, uri: str | None) -> str | None:
        return None if uri is None else check_uri(uri)


class RetentionError(RuntimeError):
    """gc cannot decide safely (an unreadable run record or register manifest); names the file."""


def load_runs(work: Path) -> list[RunRecord]:
    """Every run record under ``work/runs``; an unreadable one stops gc (its references are unknown)."""
    records, unreadable = read_records(work)
    if unreadable:
        path, why = unreadable[0]
        raise RetentionError(f"cannot read run record {path} ({why}): refusing to collect")
    return records


def policy_for(record: RunRecord, overrides: dict[str, Any] | None = None) -> RetentionConfig:
    """The run's own ``store`` section (defaults for records that predate it) with ``overrides``."""
    own = record.config.get("store") or {}
    try:
        return RetentionConfig.model_validate({**own, **(overrides or {})})
    except ValidationError as err:
        raise RetentionError(f"run {record.run_id}: bad store retention settings: {err}") from err


def is_live(record: RunRecord, window_h: float, now: _dt.datetime | None = None) -> bool:
    """Status running and touched within ``window_h`` (a record without a time counts as live)."""
    if record.status != "running":
        return False
    stamp = record.updated_at or record.started_at
    if not stamp:
        return True
    try:
        when = _dt.datetime.fromisoformat(str(stamp))
    except ValueError:
        return True
    if when.tzinfo is None:
        when = when.replace(tzinfo=_dt.UTC)
    now = now or _dt.datetime.now(_dt.UTC)
    return (now - when).total_seconds() < window_h * 3600


def table_keys(record: RunRecord) -> set[tuple[str, str]]:
    """(stage, key) of the run's rollout and scored tables."""
    return {(stage, key) for stage in TABLE_STAGES for _, key in record.train_keys(stage)}


def adapter_interval(record: RunRecord, policy: RetentionConfig) -> int:
    """``keep_adapters_every``, or when unset the run's evaluation interval (``loop.eval_every``)."""
    if policy.keep_adapters_every is not None:
        return policy.keep_adapters_every
    loop = record.loop
    # no interim evaluations: the run's last step is the only one at the interval
    return int(loop.get("eval_every") or loop.get("steps") or 1)


def load_ablations(work: Path, notes: list[str]) -> list[dict[str, Any]]:
    """Every readable ablation record ``<work>/ablations/<id>/ablation.json`` (an unreadable one is
    noted and skipped: see the module docstring)."""
    records = []
    for path in sorted((work / ABLATION_DIR).glob(f"*/{ABLATION_RECORD}")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            notes.append(f"skipped ablation record {path} ({err}): its runs' own records still protect them")
            continue
        if not isinstance(record, dict) or not isinstance(record.get("runs"), list):
            notes.append(f"skipped ablation record {path}: no 'runs' list")
            continue
        record.setdefault("id", path.parent.name)
        records.append(record)
    return records


def ablation_adapters(record: RunRecord) -> set[str]:
    """Train keys of a run's final evaluated adapter: what an ablation compares (``qerl.flows.ablate``
    reads the evaluation of the adapter after ``loop.steps``), and the run's ``final_adapter``."""
    steps = int(record.loop.get("steps") or 0)
    keys = {str(e.adapter) for e in record.evaluations if e.adapter and e.step == steps}
    if record.final_adapter:
        keys.add(Path(record.final_adapter).parent.name)
    return keys


def unfinished_listed(ablation: dict[str, Any], by_id: dict[str, RunRecord]) -> list[str]:
    """The runs ``ablation`` lists that have not completed (not started, running or failed)."""
    listed = [str(e.get("run_id")) for e in ablation["runs"] if isinstance(e, dict)]
    return [r for r in listed if r not in by_id or by_id[r].status != "completed"]


def mark_ablations(
    marks: Marks, ablations: list[dict[str, Any]], runs: list[RunRecord], notes: list[str]
) -> None:
    """Keep each listed run's final evaluated adapter (a run not started yet has nothing to keep);
    while any listed run is unfinished, keep every artifact of every listed run: runs of one
    ablation share their steps up to where their configs part (the arms while sigma is 0), and the
    unfinished one may still continue from any of them."""
    by_id = {r.run_id: r for r in runs}
    for ablation in ablations:
        listed = [str(e.get("run_id")) for e in ablation["runs"] if isinstance(e, dict)]
        waiting = unfinished_listed(ablation, by_id)
        if waiting:
            for record in (by_id[r] for r in listed if r in by_id):
                keys = [k for _, k in record.train_keys()]
                marks.keep_opt.update(keys)
                marks.keep_adapter.update(keys)
                marks.keep_tables.update(table_keys(record))
            notes.append(
                f"kept every artifact of the runs of ablation {ablation['id']}: "
                f"{len(waiting)} of its {len(listed)} runs have not completed"
            )
        finals = [ablation_adapters(by_id[r]) for r in listed if r in by_id]
        marks.keep_adapter.update(*finals)
        if any(finals):
            done = sum(1 for f in finals if f)
            notes.append(
                f"kept the final adapters of ablation {ablation['id']}: {done} of its {len(listed)} runs"
            )


def registered_train_digests(store: ArtifactStore) -> set[str]:
    """Digests of the train artifacts whose adapters were registered from this store."""
    digests = set()
    for directory in sorted((store.root / OBJECTS_DIR / REGISTER_STAGE).glob("*")):
        if not (directory / MANIFEST).is_file():
            continue
        try:
            manifest = Manifest.load(directory)
        except (ValueError, ArtifactError) as err:
            raise RetentionError(f"cannot read register manifest in {directory} ({err})") from err
        if TRAIN_STAGE in manifest.inputs:
            digests.add(manifest.inputs[TRAIN_STAGE])
    return digests


@dataclass
class Marks:
    keep_opt: set[str] = field(default_factory=set)
    keep_adapter: set[str] = field(default_factory=set)
    drop_opt: dict[str, str] = field(default_factory=dict)  # key -> reason
    drop_adapter: dict[str, str] = field(default_factory=dict)
    keep_tables: set[tuple[str, str]] = field(default_factory=set)  # (rollout|score, key)
    drop_tables: dict[tuple[str, str], str] = field(default_factory=dict)
    released: set[str] = field(default_factory=set)  # train keys of runs whose version was released


def mark_run(
    marks: Marks, record: RunRecord, policy: RetentionConfig, live: bool, released: str | None = None
) -> None:
    """Set ``record``'s marks under ``policy``. ``released``: why the version this completed run
    registered was released (``store.keep_versions``); then none of its adapters stays, the final
    one included (other protections, an ablation's above all, still win)."""
    steps = record.train_keys()
    keys = [k for _, k in steps]
    rid = record.run_id
    finished = record.status == "completed"
    released = released if finished else None
    if live or not keys:
        marks.keep_opt.update(keys)
        marks.keep_adapter.update(keys)
        marks.keep_tables.update(table_keys(record))
        return
    # a completed run is never continued (a re-run finds every step): no optimizer state to keep
    last_k = [] if finished else keys[-policy.keep_optimizer_last :]
    marks.keep_opt.update(last_k)
    marks.keep_adapter.update(last_k)  # a resume from a kept optimizer state needs its adapter too
    if released:
        marks.released.update(keys)
    elif record.final_adapter:
        marks.keep_adapter.add(Path(record.final_adapter).parent.name)
    every = adapter_interval(record, policy)
    if not every and not released:
        marks.keep_adapter.update(keys)
    why = "the run completed" if finished else f"older than its last {policy.keep_optimizer_last} steps"
    for step, key in steps:
        if key not in last_k:
            marks.drop_opt.setdefault(key, f"run {rid} step {step}: {why}")
        if released:
            marks.drop_adapter[key] = f"run {rid} step {step}: {released}"
        elif every and (step + 1) % every:
            marks.drop_adapter.setdefault(key, f"run {rid} step {step}: not a multiple of {every} steps")
    if finished and not policy.keep_step_tables:
        for stage, key in sorted(table_keys(record)):
            marks.drop_tables.setdefault((stage, key), f"run {rid} completed (store.keep_step_tables: false)")
    else:
        marks.keep_tables.update(table_keys(record))
