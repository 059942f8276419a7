"""Nights on a fleet: real PostgreSQL, Prefect, MLflow (basic-auth, proxied artifacts on S3) and S3
(SeaweedFS) servers on loopback, and "machines" that are ``qerl worker`` process sessions with their
own cache directories and logical GPU ids (no GPU is used: the ids name locks and slots).

The night trains the learner model (tests/learning.py) for real; each scenario asserts that it
learned before it asserts that anything is identical.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml
from fleet_kit import Fleet, built, start_fleet
from servers import BIN

pytestmark = pytest.mark.fleet

NIGHT = "2026-12-01"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, learner_model_dir: Path):
    from postgres import start_postgres
    from seaweed import start_seaweed

    started = time.monotonic()
    fleet = start_fleet(tmp_path_factory.mktemp("fleet"), start_postgres, start_seaweed)
    print(f"fleet up in {time.monotonic() - started:.1f} s")
    try:
        yield fleet
    finally:
        fleet.stop()


def night_config(learner: Path, data: Path, name: str, steps: int) -> dict:
    from tests.flows.test_nightly import _dataset, _night_config

    cfg = _night_config(learner, _dataset(data))
    cfg["loop"].update(name=name, steps=steps)
    cfg["store"]["keep_adapters_every"] = 1  # every step's adapter stays, for assert_trained
    return cfg


def _record(work: Path) -> dict:
    (path,) = list((work / "runs").glob("*/run.json"))
    return json.loads(path.read_text())


def _adapter_digest(work: Path, record: dict) -> str:
    key = record["steps"][-1]["manifests"]["train"]
    files = json.loads((work / "store" / "objects" / "train" / key / "manifest.json").read_text())["files"]
    return {name: f["sha256"] for name, f in files.items() if name.startswith("adapter/")}


def _reference(fleet: Fleet, cfg: dict, tmp_path: Path) -> tuple[Path, dict, float]:
    """The same night on one machine, uninterrupted: no fleet database, a local store and registry."""
    from fleet_kit import POOL  # noqa: F401  (the fleet's pool is not used here)

    cfg = json.loads(json.dumps(cfg))
    config = tmp_path / "reference.yaml"
    config.write_text(yaml.safe_dump(cfg))
    work = tmp_path / "reference"
    env = {k: v for k, v in fleet.env.items() if not k.startswith(("QERL_FLEET", "MLFLOW_TRACKING"))}
    started = time.monotonic()
    proc = subprocess.run(
        [str(BIN / "qerl"), "run", "--night", NIGHT, "--config", str(config), "--work-dir", str(work)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return work, _record(work), time.monotonic() - started


def _registered(fleet: Fleet, model: str) -> list[dict]:
    got = httpx.get(
        f"{fleet.tracking_uri}/api/2.0/mlflow/model-versions/search",
        params={"filter": f"name='{model}'"},
        auth=("admin", fleet.secrets()[2]),
        timeout=10,
    )
    got.raise_for_status()
    return got.json().get("model_versions", [])


def _wait_for(condition, timeout_s: float, what: str, fleet: Fleet) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(1)
    raise AssertionError(f"{what} did not happen in {timeout_s:g} s\n{fleet.logs()}")


def test_a_night_killed_with_machine_a_finishes_on_machine_b_logical_gpus(fleet, learner_model_dir, tmp_path):
    """Machine A (GPU 0) is SIGKILLed, whole session, after two training steps; its night is crashed by
    the janitor of machine B (GPU 1) once A's lease is gone, started again, and finished on B from the
    shared store: no finished stage rebuilt, the adapter identical to one machine's uninterrupted
    night, one registered version."""
    from learning import assert_trained

    cfg = night_config(learner_model_dir, tmp_path / "data.jsonl", "killed", steps=4)
    ref_work, ref_record, ref_s = _reference(fleet, cfg, tmp_path)
    assert_trained(ref_work, ref_record)

    deployment = fleet.deploy(fleet.write_config(cfg, "killed"))
    a = fleet.worker("machine-a", gpu="0")
    fleet.start_night(deployment, NIGHT)
    _wait_for(lambda: len(built(a.work, "train")) >= 2, 300, "two training steps on A", fleet)
    a.kill()
    killed_at = time.monotonic()
    a_built = set(built(a.work))

    b = fleet.worker("machine-b", gpu="1")
    runs = fleet.wait_completed(deployment, nights=1, timeout_s=400)
    remainder_s = time.monotonic() - killed_at
    assert [r["state_type"] for r in runs] == ["CRASHED", "COMPLETED"], runs
    assert "lease" in runs[0]["state"]["message"], runs[0]["state"]

    record = _record(b.work)
    assert record["status"] == "completed" and record["run_id"] == ref_record["run_id"].replace(
        ref_record["run_id"].split("-")[1], record["run_id"].split("-")[1]
    )
    assert [s["step"] for s in record["steps"]] == [0, 1, 2, 3]
    assert all(s["train_tokens_trained"] > 0 for s in record["steps"])
    b_built = set(built(b.work))
    assert b_built and not (a_built & b_built), f"B rebuilt finished stages: {sorted(a_built & b_built)}"
    assert len(built(b.work, "train")) == 4 - len(built(a.work, "train"))
    assert _adapter_digest(b.work, record) == _adapter_digest(ref_work, ref_record)
    versions = _registered(
        fleet, cfg["registry"].get("model_name", "qerl-adapter") if "registry" in cfg else "qerl-adapter"
    )
    assert len([v for v in versions if v["run_id"] == record["registration"]["run_id"]]) == 1, versions
    print(f"remainder on B: {remainder_s:.1f} s; the whole night on one machine: {ref_s:.1f} s")


def test_no_secret_is_written_anywhere(fleet):
    """Run records, manifests, logs and the workers' files of every scenario hold no password or key."""
    found = []
    for path in fleet.base.rglob("*"):
        if not path.is_file() or path.name in ("fleet.env", "mlflow-auth.ini") or path.stat().st_size > 50e6:
            continue
        if any(part in ("postgres", "pgdata", "seaweed") for part in path.parts[len(fleet.base.parts) :]):
            continue  # the servers' own data
        data = path.read_bytes()
        found += [f"{path}: {s[:4]}..." for s in fleet.secrets() if s.encode() in data]
    assert not found, found
    assert os.environ.get("QERL_FLEET_DB") is None
