"""``loop.deadline_h``: an attempt past its deadline is stopped with its processes, recorded as
failed (exit status 124), and resumed with another deadline. A real ``qerl run`` on the tiny model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from qerl.pipeline.store import run_lock


def _qerl(args: list[str], work: Path, shared_server: bool = False) -> subprocess.CompletedProcess:
    """The CLI in its own session, not killed afterwards: the deadline itself must leave no process
    (its own Prefect temporary server included, unless ``shared_server``: the test process's)."""
    from prefect_home import seeded_env, shared_api_url

    env = seeded_env({**os.environ, "QERL_WORK_DIR": str(work)}, work)
    if shared_server:
        env["PREFECT_API_URL"] = shared_api_url()
    for name in ("QERL_FAULT", "TRITON_INTERPRET", "VLLM_ENABLE_V1_MULTIPROCESSING"):
        env.pop(name, None)
    return subprocess.run(
        [sys.executable, "-m", "qerl.flows.cli", *args], env=env, capture_output=True, text=True,
        timeout=900, start_new_session=True,
    )  # fmt: skip


def _left_behind(work: Path) -> list[str]:
    """Processes still alive that were started for this work dir (by their environment)."""
    import psutil

    found = []
    for proc in psutil.process_iter(["pid", "name"]):
        try:
            if proc.environ().get("QERL_WORK_DIR") == str(work):
                found.append(f"{proc.pid} {proc.info['name']}")
        except psutil.Error:
            continue
    return found


@pytest.mark.slow
def test_a_run_past_its_deadline_is_stopped_recorded_and_resumed(tiny_model_factory, tmp_path):
    import torch

    from tests.flows.test_flow import tiny_run_config

    cfg = tiny_run_config(tiny_model_factory(arch="qwen2", dtype=torch.float32))
    cfg["loop"]["deadline_h"] = 2 / 3600  # two seconds: it passes during the first stages
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    work = tmp_path / "work"

    stopped = _qerl(["run", "--config", str(path)], work)
    assert stopped.returncode == 124, (stopped.returncode, stopped.stderr[-3000:])
    assert "DeadlineExceeded: the attempt passed loop.deadline_h = 0.000555556 h" in stopped.stderr
    # the flow's thread printed nothing after the stop: it was parked, not left to run on
    assert stopped.stderr.strip().splitlines()[-1].endswith("exit status 124"), stopped.stderr[-2000:]
    assert _left_behind(work) == []  # the engine's, the workers' and Prefect's server processes too
    (record_path,) = (work / "runs").glob("*/run.json")
    record = json.loads(record_path.read_text())
    assert record["status"] == "failed" and record["error"].startswith("DeadlineExceeded")
    assert "registration" not in record and "cursor_after" not in record.get("plan", {})
    assert run_lock.holder(record_path.parent) is None

    resumed = _qerl(["resume", record["run_id"], "--set", "loop.deadline_h=1"], work, shared_server=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resume {record['run_id']}: kept: everything built so far" in resumed.stderr, resumed.stderr
    record = json.loads(record_path.read_text())
    assert record["status"] == "completed" and record["config"]["loop"]["deadline_h"] == 1
    assert _left_behind(work) == []


def test_no_deadline_arms_nothing():
    from qerl.flows import deadline

    before = {t.name for t in __import__("threading").enumerate()}
    deadline.arm(object(), None)()
    assert {t.name for t in __import__("threading").enumerate()} == before


def test_the_stop_records_first_and_parks_the_flows_thread(tmp_path, monkeypatch):
    """``_stop`` with its exit and its kills recorded instead of done: the record says why, and from
    then on the flow's thread waits at its next save or registration instead of running on."""
    import threading
    from types import SimpleNamespace

    from qerl.flows import deadline
    from qerl.flows.attempt import Run
    from qerl.flows.promotion import register
    from qerl.pipeline.store.run_record import RunRecord

    calls: list[str] = []
    monkeypatch.setattr(deadline, "_kill_children", lambda: calls.append("kill") or 2)
    monkeypatch.setattr(deadline.os, "_exit", lambda status: calls.append(f"exit {status}"))
    record = RunRecord.model_validate({"run_id": "slow-run", "status": "running", "steps": [{"step": 0}]})
    run = SimpleNamespace(run_id="slow-run", work=tmp_path, record=record, live=None, stopped=False)
    deadline._stop(run, 2.0, deadline._dt.datetime(2026, 11, 27, tzinfo=deadline._dt.UTC))
    assert calls == ["kill", "exit 124"] and run.stopped
    saved = json.loads((tmp_path / "runs" / "slow-run" / "run.json").read_text())
    assert saved["status"] == "failed" and saved["steps"] == [{"step": 0}]
    assert saved["error"].startswith(
        "DeadlineExceeded: the attempt passed loop.deadline_h = 2 h (started 2026-11-27"
    )

    record.status = "completed"  # what the flow's thread would write next
    run.park_if_stopped = lambda: Run.park_if_stopped(run)
    parked = [
        threading.Thread(target=Run.save, args=(run,), daemon=True),
        threading.Thread(target=register, args=(run, None, None, None, None, [], None), daemon=True),
    ]
    for thread in parked:
        thread.start()
    for thread in parked:
        thread.join(0.5)
        assert thread.is_alive()  # waiting for the exit that ends the process
    assert json.loads((tmp_path / "runs" / "slow-run" / "run.json").read_text())["status"] == "failed"


def test_the_stop_sets_the_flow_run_failed_and_the_workers_crash_report_does_not_overwrite_it():
    """On a real Prefect server: the stopped attempt's flow run ends FAILED with the reason (a fleet's
    janitor starts CRASHED nights again, not FAILED ones), and the CRASHED that the worker proposes
    when it sees the process exit is refused."""
    from prefect import flow, get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.states import Crashed, Pending, Running
    from prefect_home import shared_api_url
    from qerl.flows import deadline

    @flow(name="qerl-deadline-test")
    def night() -> None:
        pass

    with temporary_settings(updates={PREFECT_API_URL: shared_api_url()}):
        with get_client(sync_client=True) as client:
            flow_run = client.create_flow_run(night)
            client.set_flow_run_state(flow_run.id, Pending())
            client.set_flow_run_state(flow_run.id, Running())
            deadline._fail_flow_run(str(flow_run.id), "DeadlineExceeded: the attempt passed loop.deadline_h")
            state = client.read_flow_run(flow_run.id).state
            assert state.type.value == "FAILED" and state.message.startswith("DeadlineExceeded"), state
            refused = client.set_flow_run_state(flow_run.id, Crashed(message="process exited 124"))
            assert getattr(refused.status, "value", refused.status) == "ABORT"
            assert client.read_flow_run(flow_run.id).state.type.value == "FAILED"
