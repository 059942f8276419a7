"""Live metrics (``qerl.pipeline.registry.live``): a run's steps reach its MLflow run as they end,
each once across resumes, and a registry failure never fails the run."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

from qerl.pipeline.registry import live
from qerl.pipeline.registry import tracking as reg
from qerl.pipeline.store.run_record import Evaluation, RunRecord, StepEntry


def _record(steps: int, done: int, evaluations: list[dict] | None = None, **more) -> RunRecord:
    return RunRecord.model_validate({
        "run_id": "tiny-abc", "flow_run_id": "flow-1", "config": {"loop": {"steps": steps}},
        "steps": [{"step": s, "reward_mean": 0.1 * s, "sigma": 0.01, "manifests": {"train": "k"}} for s in range(done)],
        "evaluations": evaluations or [], **more,
    })  # fmt: skip


def _steps(run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in reg.MlflowClient().get_metric_history(run_id, key))


def test_steps_and_interim_evaluations_are_logged_once_across_attempts(tmp_path):
    cfg = reg.RegistryConfig(model_name="live-steps")
    record = _record(4, 2)
    first = live.open_run(cfg, tmp_path, record, None, {"night": "2026-01-01"})
    assert live.log_record(first, record) == 6  # step, reward_mean, sigma of two steps
    assert live.log_record(first, record) == 0
    run = reg.MlflowClient().get_run(first.run_id)
    assert run.info.status == "RUNNING" and run.data.tags["run_id"] == "tiny-abc"
    assert run.data.tags["complete"] == "false" and "manifests" not in run.data.metrics
    live.end_run(first, failed=True)
    assert reg.MlflowClient().get_run(first.run_id).info.status == "FAILED"

    # the resumed attempt: a new record carrying the MLflow run id, its steps replayed from the store
    evaluations = [
        {"step": 0, "adapter": None, "accuracy": 0.1, "stderr": 0.05},  # the base: not a point
        {"step": 2, "adapter": "k", "accuracy": 0.25, "stderr": 0.1,
         "also": [{"name": "gsm8k_test", "accuracy": 0.5, "stderr": 0.2}]},
        {"step": 4, "adapter": "k", "accuracy": 0.5, "stderr": 0.1},  # the final: registration's
    ]  # fmt: skip
    resumed = _record(4, 4, evaluations, mlflow_run_id=first.run_id)
    second = live.open_run(cfg, tmp_path, resumed, resumed, {})
    assert second.run_id == first.run_id
    assert reg.MlflowClient().get_run(first.run_id).info.status == "RUNNING"
    live.log_record(second, resumed)
    assert _steps(first.run_id, "step") == [0, 1, 2, 3] == _steps(first.run_id, "reward_mean")
    assert _steps(first.run_id, "eval_accuracy") == [1]  # after two steps: step index 1
    metrics = reg.MlflowClient().get_run(first.run_id).data.metrics
    assert metrics["eval_gsm8k_test_accuracy"] == 0.5 and metrics["eval_accuracy_stderr"] == 0.1
    live.end_run(second, failed=False)
    assert reg.MlflowClient().get_run(first.run_id).info.status == "FINISHED"

    # a record whose MLflow run is gone (the database was reset): a new run
    reg.MlflowClient().delete_run(first.run_id)
    third = live.open_run(cfg, tmp_path, resumed.model_copy(deep=True), resumed, {})
    assert third.run_id not in (None, first.run_id)


def test_a_logging_failure_is_a_warning_and_the_next_step_logs_the_backlog(tmp_path, monkeypatch, caplog):
    cfg = reg.RegistryConfig(model_name="live-fail")
    record = _record(3, 1)
    opened = live.open_run(cfg, tmp_path, record, None, {})
    real = reg.log_step_metrics

    def broken(*args, **kwargs):
        raise OSError("disk I/O error")

    monkeypatch.setattr(reg, "log_step_metrics", broken)
    with caplog.at_level(logging.WARNING, logger="qerl.registry"):
        assert live.log_record(opened, record) == 0
        record.steps.append(StepEntry.model_validate({"step": 1, "reward_mean": 0.5}))
        assert live.log_record(opened, record) == 0
        monkeypatch.setattr(reg, "log_step_metrics", real)
        assert live.log_record(opened, record) == 5  # step 0: three points; step 1: two
    warnings = [r.getMessage() for r in caplog.records]
    assert sum("failed (OSError: disk I/O error)" in w for w in warnings) == 1, warnings
    assert any("logging again" in w for w in warnings)
    assert _steps(opened.run_id, "reward_mean") == [0, 1]


def test_a_dead_tracking_server_is_probed_not_retried(tmp_path):
    """While a server is down a step costs one refused probe, not MLflow's retries."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed once the block ends: nothing listens
    cfg = reg.RegistryConfig(tracking_uri=f"http://127.0.0.1:{port}", model_name="live-dead")
    dead = live.LiveRun(cfg, Path(tmp_path), "qerl-x", {}, failing=True)
    assert live.log_record(dead, _record(2, 2)) == 0 and dead.run_id is None


def test_open_run_never_raises(tmp_path, monkeypatch):
    def refused(*args, **kwargs):
        raise ConnectionError("refused")

    monkeypatch.setattr(reg, "connect", refused)
    record = _record(2, 0)
    opened = live.open_run(reg.RegistryConfig(model_name="live-open"), tmp_path, record, None, {})
    assert opened.run_id is None and opened.failing and record.mlflow_run_id is None
    monkeypatch.undo()
    record.steps = _record(2, 1).steps
    assert live.log_record(opened, record) == 3 and record.mlflow_run_id == opened.run_id


def test_interim_metrics_leave_out_absent_values():
    evaluation = Evaluation(step=1, adapter="k", accuracy=0.5, stderr=None)
    assert live.interim_metrics(evaluation) == {"eval_accuracy": 0.5}
