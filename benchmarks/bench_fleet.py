"""Benchmark: the remainder of a night killed mid-way, resumed on another machine of a fleet, against
the same remainder resumed on the machine it started on.

Both sides run the same four-step night of the fleet suite's learner model (tests/fleet; the
conftest's learner, built here the same way) and lose it after two training steps:

* fleet: PostgreSQL, Prefect, MLflow and S3 (SeaweedFS) servers on loopback; machine A (a ``qerl
  worker`` process session, logical GPU 0) is SIGKILLed whole after its second training step;
  machine B (GPU 1) is started then, its janitor crashes A's night once A's lease is gone and starts
  it again, and B finishes it from the shared store. Measured: B's attempt (its run record, start
  to last update) and the wall time from the kill to the completed flow run (janitor grace, worker
  poll, process start included).
* one machine: ``qerl run --night`` killed inside its third training step (``QERL_FAULT=train:3``,
  a SIGKILL), then ``qerl resume``; measured: the resumed attempt (its record, start to last update).

Goal: B's attempt at most 1.3x the one-machine resume's. Run: ``qerl bench fleet`` (writes
``benchmarks/results/fleet.md``).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "fleet")]
OUT = ROOT / "benchmarks" / "results" / "fleet.md"
GOAL = 1.3
NIGHT = "2026-12-01"


def _attempt_s(record: dict) -> float:
    start, end = (dt.datetime.fromisoformat(record[k]) for k in ("started_at", "updated_at"))
    return (end - start).total_seconds()


def _learner(base: Path) -> Path:
    from qerl.pipeline.demo.base_model import DemoBaseConfig, build_demo_base

    cfg = DemoBaseConfig(
        levels=[1], n_train=400, sft_steps=110, hidden_size=64, intermediate_size=192, num_layers=2
    )
    out = base / "learner"
    build_demo_base(out, cfg)
    return out


def _one_machine(cfg: dict, base: Path, env: dict[str, str]) -> float:
    import yaml

    config, work = base / "one.yaml", base / "one"
    config.write_text(yaml.safe_dump(cfg))
    qerl = str(Path(sys.executable).parent / "qerl")
    args = ["--config", str(config), "--work-dir", str(work)]
    killed = subprocess.run(
        [qerl, "run", "--night", NIGHT, *args], env={**env, "QERL_FAULT": "train:3"}, capture_output=True
    )
    assert killed.returncode != 0, "the fault did not kill the run"
    (record_path,) = list((work / "runs").glob("*/run.json"))
    run_id = record_path.parent.name
    resumed = subprocess.run(
        [qerl, "resume", run_id, "--work-dir", str(work)], env=env, capture_output=True, text=True
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    return _attempt_s(json.loads(record_path.read_text()))


def _fleet(cfg: dict, base: Path) -> tuple[float, float, int]:
    from fleet_kit import built, start_fleet
    from postgres import start_postgres
    from seaweed import start_seaweed

    fleet = start_fleet(base / "fleet", start_postgres, start_seaweed)
    try:
        deployment = fleet.deploy(fleet.write_config(cfg, "bench"))
        a = fleet.worker("machine-a", gpu="0")
        fleet.start_night(deployment, NIGHT)
        deadline = time.monotonic() + 600
        while len(built(a.work, "train")) < 2:
            assert time.monotonic() < deadline, fleet.logs()
            time.sleep(0.5)
        a.kill()
        killed = time.monotonic()
        b = fleet.worker("machine-b", gpu="1")
        fleet.wait_completed(deployment, nights=1, timeout_s=600)
        wall = time.monotonic() - killed
        (record_path,) = list((b.work / "runs").glob("*/run.json"))
        return _attempt_s(json.loads(record_path.read_text())), wall, len(built(a.work, "train"))
    finally:
        fleet.stop()


def main() -> int:
    import torch

    from tests.flows.test_nightly import _dataset, _night_config

    with tempfile.TemporaryDirectory(prefix="qerl-bench-fleet-") as tmp:
        base = Path(tmp)
        cfg = _night_config(_learner(base), _dataset(base / "data.jsonl"))
        cfg["loop"].update(name="bench", steps=4)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("QERL_FLEET", "PREFECT_API"))}
        one = _one_machine(cfg, base, env)
        b_attempt, wall, a_steps = _fleet(cfg, base)
    ratio = b_attempt / one
    lines = [
        "## Fleet: a night's remainder on another machine",
        "",
        "Command: `qerl bench fleet`. Goal: the remainder resumed on machine B at most "
        f"{GOAL}x the same remainder resumed on the machine it started on.",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}; servers "
        "and machines on loopback (tests/fleet); the fleet suite's learner model, a four-step night, "
        f"lost after {a_steps} training steps; one run each.",
        "",
        "| what | seconds |",
        "|---|---|",
        f"| one machine: `qerl resume` after a SIGKILL in the third training step (the attempt) | {one:.1f} |",
        f"| fleet: machine B's attempt after machine A was SIGKILLed whole | {b_attempt:.1f} |",
        f"| fleet: from A's kill to the completed flow run (janitor grace 5 s, worker poll 2 s, start) | {wall:.1f} |",
        "",
        f"Ratio B / one machine **{ratio:.2f}x** (goal <= {GOAL}x): B fetches the finished stages and the "
        "last checkpoint from the shared store (each file's sha256 checked) where one machine has them on disk.",
    ]
    OUT.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if ratio <= GOAL else 1


if __name__ == "__main__":
    raise SystemExit(main())
