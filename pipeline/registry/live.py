"""Live metrics: each step of a run in its MLflow run as the step ends, not only at registration.

What: before its first step the flow opens the training run's MLflow run (``open_run``: the one its
run record names, else a new one tagged with the run's id, night, ablation and ``complete=false``)
and after every step logs what the record holds that the MLflow run does not yet (``log_record``):
each step's metrics, and each interim evaluation as ``eval_accuracy`` (its standard error and the
``eval.also`` benchmarks beside it) at the index of the last step it saw, the point where
registration logs the final evaluation, so the evaluations form one curve. Registration
(``qerl.stages.register``) completes this same MLflow run (params, the final evaluation, plots, the
adapter) and registers it: one MLflow run holds a training run from its first step to its version.
A run that fails is left FAILED (``end_run``); its resume sets it back to RUNNING.

What is logged is read back from MLflow when the run is opened, not carried in the record: a step
counts as logged when the run's ``step`` metric has it, an evaluation when ``eval_accuracy`` has its
step; the ``LiveRun`` then adds what it logs. So a resumed run, a re-run, and a run registered
before live metrics existed log each point once (``new_steps``, ``logged_steps``: the register stage
reads them too, for the points a live run already has).

A failure to log never fails the run: it is logged as a warning (once until logging works again) and
the next step logs the backlog. While a tracking server is down, each step asks it once
(``qerl.pipeline.registry.health``, a 2 s probe) before trying, so the run does not pay MLflow's
retries every step. The registry was reachable when the run started (the flow checks), so this is
for an outage during a run.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlflow.tracking import MlflowClient
from qerl.pipeline.registry import health, tracking
from qerl.pipeline.registry.lock import backend_kind
from qerl.pipeline.store.run_record import Evaluation, RunRecord

log = logging.getLogger("qerl.registry")

PROBE_S = 2.0


@dataclass
class LiveRun:
    """One training run's MLflow run as the flow logs into it; ``run_id`` None until it is open."""

    cfg: tracking.RegistryConfig
    work: Path
    name: str
    tags: dict[str, Any]
    run_id: str | None = None
    failing: bool = False
    known: dict[str, set[int]] = field(default_factory=dict)  # steps logged, by metric key


def logged_steps(run_id: str, key: str) -> set[int]:
    """The steps at which the MLflow run ``run_id`` has metric ``key``."""
    return {int(m.step) for m in MlflowClient().get_metric_history(run_id, key)}


def new_steps(run_id: str, history: Sequence[Mapping[str, Any]]) -> int:
    """Log the entries of a per-step ``history`` whose step the run has not logged; returns the
    number of metric points logged."""
    done = logged_steps(run_id, "step")
    entries = [(int(e.get("step", i)), e) for i, e in enumerate(history)]
    return sum(tracking.log_step_metrics(run_id, s, e) for s, e in entries if s not in done)


def interim_metrics(evaluation: Evaluation) -> dict[str, float]:
    """A run record's evaluation entry as the metrics registration logs for the final one:
    ``eval_accuracy``, ``eval_accuracy_stderr`` and ``eval_<name>_accuracy`` per ``eval.also``."""
    out = {"eval_accuracy": evaluation.accuracy, "eval_accuracy_stderr": evaluation.stderr}
    for other in evaluation.also:
        out[f"eval_{other.name}_accuracy"] = other.accuracy
        out[f"eval_{other.name}_accuracy_stderr"] = other.stderr
    return {k: float(v) for k, v in out.items() if v is not None}


def _evaluations(record: RunRecord) -> Iterable[tuple[int, dict[str, float]]]:
    """(step index, metrics) of the record's interim evaluations of an adapter: an evaluation after
    k steps sits at index k - 1. The final one (after ``loop.steps``) is registration's to log."""
    steps = int(record.loop["steps"])
    for entry in record.evaluations:
        if entry.adapter and 0 < entry.step < steps:
            yield entry.step - 1, interim_metrics(entry)


def reusable(run_id: str | None) -> str | None:
    """``run_id`` when the MLflow run exists (not deleted), set back to RUNNING if it had failed."""
    if not run_id:
        return None
    client = MlflowClient()
    try:
        run = client.get_run(run_id)
    except Exception:  # noqa: BLE001  (MLflow raises its own error, or the store's, for a missing run)
        return None
    if run.info.lifecycle_stage != "active":
        return None
    if run.info.status in ("FAILED", "KILLED"):
        client.update_run(run_id, status="RUNNING")
    return run_id


def _open(live: LiveRun, previous: RunRecord | None) -> None:
    tracking.connect(live.cfg, live.work)
    before = None
    if previous is not None:
        before = previous.mlflow_run_id or (previous.registration.run_id if previous.registration else None)
    live.run_id = reusable(before) or tracking.start_run(live.cfg, run_name=live.name, tags=live.tags)
    live.known = {"step": logged_steps(live.run_id, "step")}
    live.known["eval_accuracy"] = logged_steps(live.run_id, "eval_accuracy")


def _reachable(live: LiveRun) -> bool:
    """After a failure: whether a tracking server answers a short probe (a database is just tried)."""
    uri = tracking.resolve_uris(live.cfg, live.work)[0]
    if backend_kind(uri) != "server":
        return True
    try:
        health.check_reachable(uri, timeout_s=PROBE_S)
    except Exception:  # noqa: BLE001
        return False
    return True


def _failed(live: LiveRun, what: str, err: BaseException) -> None:
    if not live.failing:
        log.warning(
            "live metrics: %s failed (%s: %s); the next step tries again", what, type(err).__name__, err
        )
    live.failing = True


def open_run(
    cfg: tracking.RegistryConfig,
    work: Path,
    record: RunRecord,
    previous: RunRecord | None,
    tags: Mapping[str, Any],
) -> LiveRun:
    """The run's MLflow run, opened (reused when the previous attempt's record names one) and its id
    written to ``record.mlflow_run_id``; on failure a ``LiveRun`` that ``log_record`` opens later."""
    name = f"qerl-{record.flow_run_id or record.run_id}"
    live = LiveRun(cfg, work, name, {**tags, "run_id": record.run_id, "complete": "false"})
    try:
        _open(live, previous)
        record.mlflow_run_id = live.run_id
    except Exception as err:  # noqa: BLE001  (never fails the run)
        _failed(live, "opening the MLflow run", err)
    return live


def log_record(live: LiveRun, record: RunRecord) -> int:
    """Log the record's steps and interim evaluations that the MLflow run lacks; returns the number
    of points logged (0 when logging failed: see the module docstring)."""
    if live.failing and not _reachable(live):
        return 0
    try:
        if live.run_id is None:
            _open(live, record)
            record.mlflow_run_id = live.run_id
        assert live.run_id is not None
        n = 0
        for entry, logged in zip(record.steps, record.history(), strict=True):
            if entry.step not in live.known["step"]:  # its non-numeric keys are not metrics
                n += tracking.log_step_metrics(live.run_id, entry.step, logged)
                live.known["step"].add(entry.step)
        for step, metrics in _evaluations(record):
            if step not in live.known["eval_accuracy"]:
                n += tracking.log_step_metrics(live.run_id, step, metrics)
                live.known["eval_accuracy"].add(step)
    except Exception as err:  # noqa: BLE001  (never fails the run)
        _failed(live, "logging the steps", err)
        return 0
    if live.failing:
        log.warning("live metrics: logging again, the backlog is in MLflow run %s", live.run_id)
        live.failing = False
    return n


def end_run(live: LiveRun, failed: bool) -> None:
    """A run still RUNNING ends FAILED when the flow failed, else FINISHED (registration has ended
    it already unless it reused an earlier version registered from another MLflow run)."""
    if live.run_id is None:
        return
    try:
        client = MlflowClient()
        if client.get_run(live.run_id).info.status == "RUNNING":
            client.set_terminated(live.run_id, status="FAILED" if failed else "FINISHED")
    except Exception as err:  # noqa: BLE001  (never fails the run)
        log.warning("live metrics: ending MLflow run %s failed (%s)", live.run_id, err)
