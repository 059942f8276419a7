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


@pytest.fixture(autouse=True)
def _machines_end_with_their_test(fleet):
    yield
    fleet.stop_workers()


@pytest.fixture(scope="module")
def reference(fleet, learner_model_dir, tmp_path_factory):
    """A four-step night on one machine, uninterrupted: what every fleet night is compared with."""
    from learning import assert_trained

    base = tmp_path_factory.mktemp("reference")
    cfg = night_config(learner_model_dir, base / "data.jsonl", "nightly", steps=4)
    work, record, seconds = _reference(fleet, cfg, base)
    assert_trained(work, record)  # it learned: an identical adapter elsewhere means something
    return cfg, work, record, seconds


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
    """The sha256 of the night's final LoRA weights. (The adapter's ``adapter_config.json`` names the
    machine's own path of the quantized base, so it differs between work dirs by design.)"""
    key = record["steps"][-1]["manifests"]["train"]
    files = json.loads((work / "store" / "objects" / "train" / key / "manifest.json").read_text())["files"]
    return files["adapter/adapter_model.safetensors"]["sha256"]


def _reference(fleet: Fleet, cfg: dict, tmp_path: Path) -> tuple[Path, dict, float]:
    """The same night on one machine, uninterrupted: no fleet database, a local store and registry."""
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


def _attempt_s(record: dict) -> float:
    import datetime as dt

    started, ended = (dt.datetime.fromisoformat(record[k]) for k in ("started_at", "updated_at"))
    return (ended - started).total_seconds()


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


def test_a_night_killed_with_machine_a_finishes_on_machine_b_logical_gpus(fleet, reference):
    """Machine A (GPU 0) is SIGKILLed, whole session, after two training steps; its night is crashed by
    the janitor of machine B (GPU 1) once A's lease is gone, started again, and finished on B from the
    shared store: no finished stage rebuilt, the adapter identical to one machine's uninterrupted
    night, one registered version."""
    cfg, ref_work, ref_record, ref_s = reference
    cfg = {**cfg, "loop": {**cfg["loop"], "name": "killed"}}  # its own line: its own deployment
    deployment = fleet.deploy(fleet.write_config(cfg, "killed", store="killed", model="qerl-killed"))
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
    assert record["status"] == "completed" and record["night"] == NIGHT, record.get("error")
    assert [s["step"] for s in record["steps"]] == [0, 1, 2, 3]
    assert all(s["train_tokens_trained"] > 0 for s in record["steps"])
    b_built = set(built(b.work))
    assert b_built and not (a_built & b_built), f"B rebuilt finished stages: {sorted(a_built & b_built)}"
    assert len(built(b.work, "train")) == 4 - len(built(a.work, "train"))
    assert _adapter_digest(b.work, record) == _adapter_digest(ref_work, ref_record)
    versions = _registered(fleet, "qerl-killed")
    assert len(versions) == 1 and versions[0]["run_id"] == record["registration"]["run_id"], versions
    a_train = len(built(a.work, "train"))
    print(
        f"\nFLEET-TIMING remainder on B after the kill ({4 - a_train} of 4 steps, evaluation, registration, "
        f"janitor grace and worker start included): {remainder_s:.1f} s; the whole night on one machine: "
        f"{ref_s:.1f} s; B's attempt: {_attempt_s(record):.1f} s"
    )


def _champions(registrations: list[dict]) -> list[tuple[int, str, bool]]:
    """(version, the champion it was judged against, promoted) for each registration, by version."""
    import re

    out = []
    for reg in registrations:
        against = re.search(r"vs (champion v\d+|the base model)", reg["promotion"])
        out.append((int(reg["version"]), against.group(1) if against else "?", bool(reg["promoted"])))
    return sorted(out)


def test_three_nights_and_a_hand_started_run_on_two_logical_gpus_never_share_one_and_promotions_serialise(
    fleet, learner_model_dir, tmp_path
):
    """Two nightly lines, three scheduled nights, two machines (GPU 0 and GPU 1), and a night started by
    hand on machine 0's GPU while its worker runs one: no GPU's lock intervals overlap (the hand-started
    run waits, saying whose the GPU is); every night completes; the registrations, some finishing about
    together, go through the promotion rule one after the other (each judged against the champion the
    one before it left)."""
    from qerl.pipeline.fleet.gpu_lock import intervals

    deps, configs = {}, {}
    for seed, line in enumerate(("line-a", "line-b")):  # the same data, each line its own order of it
        (tmp_path / line).mkdir()
        cfg = night_config(learner_model_dir, tmp_path / line / "data.jsonl", line, steps=3)
        cfg["loop"]["seed"] = seed
        configs[line] = fleet.write_config(cfg, line, store="lines", model="qerl-lines")
        deps[line] = fleet.deploy(configs[line])
    m0, m1 = fleet.worker("machine-0", gpu="0"), fleet.worker("machine-1", gpu="1")
    fleet.start_night(deps["line-a"], "2026-12-02")
    fleet.start_night(deps["line-b"], "2026-12-02")
    fleet.start_night(deps["line-a"], "2026-12-03")  # waits for line-a's first (deployment limit 1)
    _wait_for(lambda: len(built(m0.work, "train")) >= 1, 300, "a training step on machine 0", fleet)
    by_hand = subprocess.run(  # a night of line-b typed on machine 0, on its GPU
        [
            str(BIN / "qerl"),
            "run",
            "--night",
            "2026-12-04",
            "--config",
            str(configs["line-b"]),
            "--work-dir",
            str(m0.work),
        ],
        env={**fleet.env, "QERL_GPU_ID": "0"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert by_hand.returncode == 0, by_hand.stdout[-3000:] + by_hand.stderr[-3000:]
    said = (
        by_hand.stdout + by_hand.stderr + "".join(p.read_text() for p in (m0.work / "runs").glob("*/run.log"))
    )
    assert "GPU 0 is held by run" in said, "the hand-started run never waited for GPU 0"

    runs = {
        line: fleet.wait_completed(dep, nights=2 if line == "line-a" else 1, timeout_s=600)
        for line, dep in deps.items()
    }
    for line, flow_runs in runs.items():
        assert [r["state_type"] for r in flow_runs] == ["COMPLETED"] * len(flow_runs), (line, flow_runs)
    gpu_dir = Path(fleet.env["QERL_GPU_LOCK_DIR"])
    held = {
        gpu: [(h["acquired"], h["released"], h["run_id"]) for h in intervals(gpu, gpu_dir)] for gpu in "01"
    }
    for gpu, spans in held.items():
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False)), (gpu, spans)
    assert any(run.endswith("20261204") for _, _, run in held["0"]), held

    records = [json.loads(p.read_text()) for w in (m0, m1) for p in (w.work / "runs").glob("line-*/run.json")]
    records = {r["run_id"]: r for r in records if r["status"] == "completed"}
    assert len(records) == 4, sorted(records)
    judged = _champions([r["registration"] for r in records.values()])
    champion = None
    for version, against, promoted in judged:  # each judged against the champion the one before left
        if champion is not None:
            assert against == f"champion v{champion}", judged
        if promoted:
            champion = version


def test_every_server_restarted_mid_night_and_the_night_completes(fleet, reference):
    """PostgreSQL, then the Prefect server, then MLflow, then the S3 server are restarted while one
    machine runs a night (one after each training step): the night completes in its first flow run,
    with the uninterrupted night's adapter and one registered version."""
    cfg, ref_work, ref_record, _ = reference
    cfg = {**cfg, "loop": {**cfg["loop"], "name": "restarts"}}  # its own line: its own deployment
    deployment = fleet.deploy(fleet.write_config(cfg, "restarts", store="restarts", model="qerl-restarts"))
    m = fleet.worker("machine-r", gpu="0")
    fleet.start_night(deployment, NIGHT)
    restarts = [fleet.postgres.restart, fleet.prefect.restart, fleet.mlflow.restart, fleet.s3.restart]
    for step, restart in enumerate(restarts, 1):
        _wait_for(
            lambda n=step: len(built(m.work, "train")) >= min(n, 4), 300, f"training step {step}", fleet
        )
        restart()
    runs = fleet.wait_completed(deployment, nights=1, timeout_s=400)
    assert [r["state_type"] for r in runs] == ["COMPLETED"], runs
    record = _record(m.work)
    assert record["status"] == "completed" and len(record["steps"]) == 4
    assert _adapter_digest(m.work, record) == _adapter_digest(ref_work, ref_record)
    versions = _registered(fleet, "qerl-restarts")
    assert len(versions) == 1 and versions[0]["run_id"] == record["registration"]["run_id"], versions


def test_no_secret_is_written_anywhere(fleet):
    """Run records, manifests, logs and the workers' files of every scenario hold no password or key."""
    found = []
    for path in fleet.base.rglob("*"):
        if not path.is_file() or path.name in ("fleet.env", "mlflow-auth.ini") or path.stat().st_size > 50e6:
            continue
        if path.parts[len(fleet.base.parts)] in ("s3", "prefect-server"):
            continue  # the servers' own data and configs (the S3 server's identities file)
        data = path.read_bytes()
        found += [f"{path}: {s[:4]}..." for s in fleet.secrets() if s.encode() in data]
    assert not found, found
    assert os.environ.get("QERL_FLEET_DB") is None
