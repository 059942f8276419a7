"""One attempt at a time per run (``qerl.pipeline.store.run_lock``) and ``qerl runs``, which tells a
live attempt from an interrupted one by that lock. The holder is a real second process, killed with
SIGKILL as a crash would."""

from __future__ import annotations

import datetime as _dt
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from qerl.flows.cli import main
from qerl.pipeline.store import retention, run_lock
from qerl.pipeline.store.files import atomic_write_json

HOLD = """
import sys, time
from pathlib import Path
from qerl.pipeline.store import run_lock
with run_lock.hold(Path(sys.argv[1]), "held-run"):
    print("held", flush=True)
    time.sleep(600)
"""


def _holder(run_dir: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def _kill(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def _record(work: Path, run_id: str, status: str, **extra) -> None:
    now = _dt.datetime.now(_dt.UTC)
    record = {"run_id": run_id, "status": status, "steps": [{"step": 0}, {"step": 1}],
              "config": {"loop": {"steps": 4}}, "evaluations": [], **extra}  # fmt: skip
    record.setdefault("started_at", now.isoformat(timespec="seconds"))
    record.setdefault("updated_at", now.isoformat(timespec="seconds"))
    atomic_write_json(work / "runs" / run_id / "run.json", record)


def test_a_second_attempt_is_refused_while_the_first_lives_and_not_after_it_dies(tmp_path):
    run_dir = tmp_path / "runs" / "held-run"
    proc = _holder(run_dir)
    try:
        info = run_lock.holder(run_dir)
        assert info is not None and info["pid"] == proc.pid
        with pytest.raises(
            run_lock.RunLockedError, match=f"run held-run is already running \\(pid {proc.pid} on"
        ):
            with run_lock.hold(run_dir, "held-run"):
                pass
    finally:
        _kill(proc)  # the kernel drops the lock of a killed process: nothing stale is left
    assert run_lock.holder(run_dir) is None
    with run_lock.hold(run_dir, "held-run"):
        assert run_lock.holder(run_dir)["pid"] == os.getpid()
    assert run_lock.holder(run_dir) is None


def test_qerl_run_is_refused_before_it_touches_the_running_attempts_log(tmp_path, capsys):
    from qerl.pipeline.planning.run_config import load_run_config
    from qerl.pipeline.planning.runs import run_id_for

    run_id = run_id_for(load_run_config(None, []))  # the embedded demo's run
    run_dir = tmp_path / "runs" / run_id
    proc = _holder(run_dir)
    try:
        assert main(["run", "--work-dir", str(tmp_path)]) == 2
    finally:
        _kill(proc)
    err = capsys.readouterr().err
    assert f"qerl run: error: run {run_id} is already running (pid {proc.pid}" in err, err
    assert sorted(p.name for p in run_dir.iterdir()) == ["run.lock"]  # no run.log, no record


def test_qerl_runs_tells_running_from_interrupted(tmp_path, capsys):
    _record(tmp_path, "night-done", "completed", night="2026-11-16", final_accuracy=0.198,
            registration={"version": "1", "promoted": True}, started_at="2026-11-16T02:00:00+00:00")  # fmt: skip
    _record(tmp_path, "night-failed", "failed", night="2026-11-17", error="OutOfMemoryError: CUDA out of memory\nmore",
            started_at="2026-11-17T02:00:00+00:00")  # fmt: skip
    _record(tmp_path, "night-killed", "running", night="2026-11-18", started_at="2026-11-18T02:00:00+00:00")
    _record(tmp_path, "night-live", "running", night="2026-11-19", started_at="2026-11-19T02:00:00+00:00")
    (tmp_path / "runs" / "broken").mkdir()
    (tmp_path / "runs" / "broken" / "run.json").write_text("{")
    proc = _holder(tmp_path / "runs" / "night-live")
    try:
        assert main(["runs", "--work-dir", str(tmp_path)]) == 0
        out = capsys.readouterr().out.splitlines()
    finally:
        _kill(proc)
    assert out[0].endswith("4 runs and 1 unreadable record, newest first")
    assert [line.split()[0] for line in out[1:] if not line.startswith("      ")][:4] == [
        "night-live", "night-killed", "night-failed", "night-done"
    ]  # fmt: skip
    text = "\n".join(out)
    assert "night-live" in text and f"running (pid {proc.pid} on" in text
    assert "interrupted" in text and "resume: qerl resume night-killed" in text
    assert (
        "error: OutOfMemoryError: CUDA out of memory" in text and "resume: qerl resume night-failed" in text
    )
    assert "accuracy 0.198  v1 champion" in text and "step 2/4" in text and "night 2026-11-16" in text
    assert "broken" in text and "unreadable record" in text
    assert main(["resume", "broken", "--work-dir", str(tmp_path)]) == 2  # the error names the file
    assert f"{tmp_path / 'runs' / 'broken' / 'run.json'} cannot be read as JSON" in capsys.readouterr().err
    assert main(["runs", "--work-dir", str(tmp_path), "--limit", "1"]) == 0
    assert "the newest 1 shown (--all for every one)" in capsys.readouterr().out
    assert main(["runs", "--work-dir", str(tmp_path), "--limit", "0"]) == 2


def test_gc_keeps_a_locked_run_however_long_its_step(tmp_path):
    """A running record older than the live window is live while an attempt holds its lock."""
    from tests.pipeline.test_gc import fake_run, pruned_names

    steps = fake_run(tmp_path, "slow", 4, status="running", age_h=48)
    proc = _holder(tmp_path / "runs" / "slow")
    try:
        held_plan = retention.plan(tmp_path)
    finally:
        _kill(proc)
    assert any("live run slow (an attempt holds its lock)" in n for n in held_plan.notes), held_plan.notes
    assert not held_plan.deletions
    retention.apply(tmp_path, retention.plan(tmp_path))  # dead now: what its resume does not need goes
    assert [pruned_names(m) for m in steps] == [{"optimizer.safetensors"}] * 2 + [set()] * 2
