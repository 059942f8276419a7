"""The typed run record (``qerl.pipeline.store.run_record``): every record a qerl wrote loads, and one
read and written back is unchanged where other stages hash it.

``tests/data/run_records/v0-*.json`` are records written by the qerl before the typed record (version
0): a completed plain run of the demo, a nightly run, a failed attempt and an ablation's arm."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from qerl.pipeline.store.run_record import (
    RECORD_VERSION,
    RecordError,
    RunRecord,
    load_record,
    parse_record,
    read_record,
    save_record,
)

RECORDS = Path(__file__).resolve().parents[1] / "data" / "run_records"


def _written_by_older_qerl() -> list[Path]:
    found = sorted(RECORDS.glob("v0-*.json"))
    assert found, f"no version-0 records under {RECORDS}"
    return found


@pytest.mark.parametrize("path", _written_by_older_qerl(), ids=lambda p: p.stem)
def test_every_record_an_older_qerl_wrote_loads_and_writes_back_what_it_read(path, tmp_path):
    original = json.loads(path.read_text())
    record = read_record(path)
    assert record.run_id == original["run_id"] and record.status == original["status"]
    assert len(record.steps) == len(original["steps"]) and len(record.evaluations) == len(
        original["evaluations"]
    )
    # the register stage's key hashes the step history: it must be the recorded entries, exactly
    assert record.history() == [{k: v for k, v in s.items() if k != "manifests"} for s in original["steps"]]
    kept = {k: v for k, v in original.items() if v is not None or k in ("night", "ablation")}
    assert record.to_json() == {**kept, "record_version": RECORD_VERSION}
    # saved and read again: the same record, now of this version
    save_record(tmp_path, record)
    again = load_record(tmp_path, record.run_id)
    assert again.to_json() == {**record.to_json(), "updated_at": again.updated_at}
    assert json.loads((tmp_path / "runs" / record.run_id / "run.json").read_text())["record_version"] == 1


def test_typed_views_of_a_completed_demo_run():
    record = read_record(RECORDS / "v0-plain-completed.json")
    assert record.loop["steps"] == len(record.steps) == 30
    assert record.plan is not None and record.plan.start_slot == 0 and record.warm_start_version is None
    assert record.quantize is not None and record.quantize.metrics["quantize_kl"] > 0
    assert record.registration is not None and record.registration.created is True
    assert record.earlier_registration() is None
    keys = record.train_keys()
    assert [s for s, _ in keys] == list(range(30)) and len({k for _, k in keys}) == 30
    assert record.steps[0].metrics["reward_mean"] == record.history()[0]["reward_mean"]


def test_a_record_that_is_not_one_is_refused_naming_the_file_and_the_field(tmp_path):
    path = tmp_path / "run.json"
    with pytest.raises(RecordError, match=f"{path}: record_version 2 is newer than this qerl reads"):
        parse_record({"run_id": "r", "record_version": RECORD_VERSION + 1}, path)
    with pytest.raises(RecordError, match=rf"{path}: not a valid run record \(status: "):
        parse_record({"run_id": "r", "status": "paused"}, path)
    with pytest.raises(RecordError, match=r"steps\.0\.step: "):
        parse_record({"run_id": "r", "steps": [{"sigma": 0.1}]}, path)
    with pytest.raises(RecordError, match="not a run record"):
        parse_record([], path)
    path.write_text("{")
    with pytest.raises(RecordError, match=f"{path} cannot be read as JSON"):
        read_record(path)
    # a version-0 record names its run by its folder when it does not say
    assert parse_record({"steps": []}, tmp_path / "runs" / "night-1" / "run.json").run_id == "night-1"


def test_what_was_set_is_what_is_written():
    record = RunRecord(run_id="r", status="running", steps=[])
    assert record.to_json() == {"run_id": "r", "status": "running", "steps": [], "record_version": 1}
    record.error = "boom"
    assert record.to_json()["error"] == "boom"
