"""What a run does before its first stage and around it: its record keeps the plan from the first
save on, a run without a console session (a scheduled night) still writes ``run.log``, the data is
read before anything is built (a malformed file is one line from ``qerl run``), and ``qerl schedule``
serves on the Prefect API it is given.

The flow runs in this process on Prefect's ephemeral server; ``prepare_base`` is replaced by a
failure where the test is about what happens before it, so no model is built.
"""

from __future__ import annotations

import datetime as dt
import http.server
import json
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

from tests.flows.test_flow import _qerl, tiny_run_config

NIGHT = dt.date(2026, 1, 2)
PLAN = {
    "stream": "0123456789abcdef", "start_slot": 6, "end_slot": 9, "epochs": [0],
    "warm_start": {"from": "champion", "version": "3", "digest": "d" * 64},
}  # fmt: skip


def _config(model_dir: Path, data: Path | None = None):
    from qerl.pipeline.planning.run_config import RunConfig

    cfg = tiny_run_config(model_dir)
    if data is not None:
        cfg["data"] = {"dataset": str(data), "template": "terse"}
    return RunConfig.model_validate(cfg)


def _record_path(work: Path, cfg, night: dt.date | None) -> Path:
    from qerl.pipeline.planning.runs import run_id_for
    from qerl.pipeline.store.run_record import run_dir

    return run_dir(work, run_id_for(cfg, night)) / "run.json"


def _crash_before_the_plan(monkeypatch, record_path: Path) -> list[dict]:
    """``prepare_base`` fails (a base fetch that dies); returns the record as it was on disk then."""
    from qerl.flows import run

    seen: list[dict] = []

    def base_fails(run, held_out):
        seen.append(json.loads(record_path.read_text()))
        raise RuntimeError("base fetch failed")

    monkeypatch.setattr(run, "prepare_base", base_fails)
    return seen


def test_an_attempt_that_dies_before_its_plan_keeps_the_plan(tiny_model_dir, tmp_path, monkeypatch):
    from prefect_home import run_here

    cfg, work = _config(tiny_model_dir), tmp_path / "work"
    path = _record_path(work, cfg, NIGHT)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"run_id": path.parent.name, "status": "failed", "steps": [], "plan": PLAN}))
    seen = _crash_before_the_plan(monkeypatch, path)
    with pytest.raises(RuntimeError, match="base fetch failed"):
        run_here(cfg, work, NIGHT)
    assert seen[0]["status"] == "running" and seen[0]["plan"] == PLAN  # the first save already has it
    record = json.loads(path.read_text())
    assert record["status"] == "failed" and record["plan"] == PLAN
    assert "base fetch failed" in record["error"]


def test_a_run_without_a_console_session_writes_its_run_log(tiny_model_dir, tmp_path, monkeypatch):
    """A scheduled night calls the flow with no console session (no CLI): run.log all the same."""
    from prefect_home import run_here

    cfg, work = _config(tiny_model_dir), tmp_path / "work"
    path = _record_path(work, cfg, NIGHT)
    _crash_before_the_plan(monkeypatch, path)
    with pytest.raises(RuntimeError, match="base fetch failed"):
        run_here(cfg, work, NIGHT)
    text = (path.parent / "run.log").read_text()
    assert f"run {path.parent.name}: started" in text
    assert "base fetch failed" in text  # the error that ended the night, with its traceback
    assert "Traceback" in text


def _malformed(path: Path) -> Path:
    rows = [{"problem": f"{a} + 1 =", "answer": str(a + 1)} for a in range(2)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"problem": "2 + 2 =", "answer": \n')
    return path


def _built_stages(work: Path) -> list[str]:
    objects = work / "store" / "objects"
    return sorted(p.name for p in objects.iterdir() if any(p.iterdir())) if objects.is_dir() else []


def test_malformed_data_fails_the_flow_before_anything_is_built(tiny_model_dir, tmp_path):
    from prefect_home import run_here

    data = _malformed(tmp_path / "data.jsonl")
    work = tmp_path / "work"
    with pytest.raises(ValueError, match=f"{data}:3: not valid JSON"):
        run_here(_config(tiny_model_dir, data), work)
    assert _built_stages(work) == []


def test_an_unreadable_benchmark_fails_the_flow_before_anything_is_built(tiny_model_dir, tmp_path):
    from prefect_home import run_here
    from qerl.pipeline.config import apply_overrides

    # level 1 has 120 test problems (11 pairs of digits in six phrasings, both orders)
    cfg = apply_overrides(
        _config(tiny_model_dir), ["eval.benchmark.levels=[1]", "eval.benchmark.arithmetic_size=500"]
    )
    work = tmp_path / "work"
    with pytest.raises(ValueError, match=r"only 120 distinct test problems found at levels \[1\]"):
        run_here(cfg, work)
    assert _built_stages(work) == []


def test_qerl_run_reports_malformed_data_in_one_error_line(tiny_model_dir, tmp_path):
    data = _malformed(tmp_path / "data.jsonl")
    cfg = tiny_run_config(tiny_model_dir)
    cfg["data"] = {"dataset": str(data), "template": "terse"}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    work = tmp_path / "work"
    proc = _qerl(["run", "--config", str(tmp_path / "run.yaml")], work)
    assert proc.returncode == 2
    starting, line = proc.stderr.strip().splitlines()  # the run's first console line, then the error
    assert starting.startswith("run tiny-") and line.startswith(f"qerl run: error: {data}:3: not valid JSON")
    assert _built_stages(work) == []


def test_a_context_longer_than_the_model_is_refused_before_the_quantize_stage(
    tiny_model_dir, tmp_path, monkeypatch
):
    """A local model is checked when the config loads; any other source (here the demo's, which is
    known only once the base stage has built it) right after the base stage, before quantizing."""
    from prefect_home import run_here
    from qerl.flows import tasks
    from qerl.pipeline.config import ConfigError
    from qerl.pipeline.planning.run_config import RunConfig, load_run_config

    cfg = tiny_run_config(tiny_model_dir)
    cfg["rollout"]["max_model_len"] = 2048  # the tiny model has 1024 positions
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    refused = r"rollout.max_model_len 2048 is longer than the model's max_position_embeddings 1024"
    with pytest.raises(ConfigError, match=refused):
        load_run_config(tmp_path / "run.yaml")
    cfg["model"] = {"source": "demo"}
    monkeypatch.setattr(tasks, "base_model", lambda **_: str(tiny_model_dir))  # the base stage's output
    work = tmp_path / "work"
    with pytest.raises(ConfigError, match=refused):
        run_here(RunConfig.model_validate(cfg), work)
    assert _built_stages(work) == []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_schedule_names_the_api_url_nothing_answers_at(tmp_path):
    url = f"http://127.0.0.1:{_free_port()}/api"
    proc = _qerl(["schedule", "--cron", "0 2 * * *", "--api-url", url], tmp_path)
    assert proc.returncode == 2 and url in proc.stderr and "prefect server start" in proc.stderr


SERVE = """
import os, sys
from pathlib import Path
from qerl.flows import orchestration
from qerl.pipeline.planning.run_config import load_run_config

os.environ["PREFECT_API_URL"] = sys.argv[2]  # what the command line sets from --api-url
orchestration.prepare_environment(Path(sys.argv[1]))
import prefect
from prefect.settings import PREFECT_API_URL

prefect.serve = lambda d, limit: print("SERVED", PREFECT_API_URL.value(), d.name, limit)
orchestration.schedule(load_run_config(), Path(sys.argv[1]), "0 2 * * *", None)
"""


def test_schedule_serves_on_the_api_url_it_is_given(tmp_path):
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the handler's name
            self.send_response(200 if self.path == "/api/health" else 404)
            self.end_headers()
            self.wfile.write(b"true")

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/api"
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("PREFECT_")}
    try:
        done = subprocess.run(
            [sys.executable, "-c", SERVE, str(tmp_path), url],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        server.shutdown()
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["SERVED", url, "nightly", "1"]


def test_schedule_refuses_an_invalid_cron_in_one_line(tmp_path):
    proc = _qerl(["schedule", "--cron", "61 2 * * *"], tmp_path)
    assert proc.returncode == 2 and "invalid cron expression '61 2 * * *'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_engine_start_up_is_counted_apart_from_the_step(monkeypatch):
    """What the step loop hands the console as start-up (left out of the ETA): the seconds the
    engine took to come up, once; a cached step or a plain engine counts none."""
    import time

    from qerl.pipeline.rollout import factory
    from qerl.pipeline.rollout.config import RolloutConfig
    from qerl.pipeline.rollout.lazy import LazyEngine

    class Engine:
        def __init__(self, mode: str):
            self.mode, self.info, self.tokenizer = mode, {}, None

        def generate(self, prompts, n, sampling, seed):
            return [["done"] * n for _ in prompts]

    def slow_build(cfg, quantized, twin, aqn=False):
        time.sleep(0.3)
        return Engine(engine.mode)

    monkeypatch.setattr(factory, "build_engine", slow_build)
    engine = LazyEngine(RolloutConfig(engine="hf"), None, None)
    assert engine.startup_s == 0.0 and not engine.started  # asking does not start it
    engine.generate(["p"], 2, None, 0)
    first = engine.startup_s
    assert first >= 0.3
    engine.generate(["p"], 2, None, 0)
    assert engine.startup_s == first  # started once
