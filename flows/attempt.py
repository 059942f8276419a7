"""One attempt's context, as the flow's phases pass it on (``qerl.flows.run``): the config, where the
run works, its typed record, console and MLflow run; a stage's clock; the base the run serves."""

from __future__ import annotations

import datetime as _dt
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qerl.flows import console
from qerl.pipeline.planning.run_config import RunConfig
from qerl.pipeline.registry import live
from qerl.pipeline.rollout.lazy import LazyEngine
from qerl.pipeline.store.artifact_store import ArtifactStore
from qerl.pipeline.store.manifest import Manifest
from qerl.pipeline.store.run_record import Ablation, RunRecord, save_record
from qerl.pipeline.store.shared import publish_record


@dataclass
class Run:
    """One attempt's context: the config, where it works, its record, console and MLflow run."""

    cfg: RunConfig
    work: Path
    store: ArtifactStore
    record: RunRecord
    previous: RunRecord | None  # what the last attempt left
    ui: console.RunConsole
    logger: Any
    since: str = field(default_factory=lambda: _dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat())
    live: live.LiveRun | None = None
    stopped: bool = False  # set by the deadline (``qerl.flows.deadline``)

    @property
    def run_id(self) -> str:
        return self.record.run_id

    def cached(self, manifest: Manifest | None) -> bool:
        """Built before this attempt started: a store hit (ISO timestamps in UTC compare as text)."""
        return manifest is not None and manifest.created_at < self.since

    def save(self) -> None:
        """The record, on this machine and, on a fleet, in the shared store (where ``qerl runs`` and
        another machine's attempt read it); a run that lost its lease publishes nothing more."""
        self.park_if_stopped()
        save_record(self.work, self.record)
        if self.store.shared is not None:
            publish_record(
                self.store.shared, self.run_id, json.dumps(self.record.to_json(), indent=2).encode()
            )

    def park_if_stopped(self) -> None:
        """Past its deadline the attempt's thread waits here for the exit: the record is the
        deadline's, and nothing is registered or advanced after it."""
        if self.stopped:
            threading.Event().wait()

    def show(self, name: str, detail: str, clock: Clock, built: Manifest | None = None) -> None:
        """A stage's console line: what it made, how long it took (its start-up apart), cached or not."""
        self.ui.stage(name, detail, clock.seconds, self.cached(built), startup=clock.startup)


@dataclass
class Clock:
    """A stage's wall time, and the engine start-up it paid (not its own work)."""

    engine: LazyEngine | None = None
    started: float = field(default_factory=time.perf_counter)
    engine_s: float = 0.0

    def __post_init__(self) -> None:
        self.engine_s = self.engine.startup_s if self.engine else 0.0

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.started

    @property
    def startup(self) -> float:
        return (self.engine.startup_s if self.engine else 0.0) - self.engine_s


@dataclass(frozen=True)
class Base:
    """The run's base: the model it came from, the quantized checkpoint and the engine's twin."""

    src: str
    quantized: Manifest
    twin: Manifest | None


def parent_tags(ablation: Ablation) -> dict[str, str]:
    """An ablation arm's MLflow run nests under the ablation's parent run."""
    return {"mlflow.parentRunId": ablation.parent_run_id} if ablation.parent_run_id else {}
