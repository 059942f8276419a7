"""An upgrade night: a run killed mid-step, qerl upgraded, ``qerl resume``. What the upgrade did not
change is kept, and the resume says what changed before it starts."""

from __future__ import annotations

import json
import signal
from collections import Counter

import pytest
import yaml


@pytest.mark.slow
def test_a_resume_after_an_upgrade_keeps_every_step_and_names_what_changed(learner_model_dir, tmp_path):
    from learning import learning_run_config
    from qerl.pipeline.store.code_version import dependency_versions
    from test_code_version import upgraded_qerl
    from test_flow import _final_adapter, _journal, _qerl

    cfg_path = tmp_path / "run.yaml"
    cfg_path.write_text(yaml.safe_dump(learning_run_config(learner_model_dir)))
    work = tmp_path / "work"
    killed = _qerl(["run", "--config", str(cfg_path)], work, fault="train:3")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    (record_path,) = (work / "runs").glob("*/run.json")
    record = json.loads(record_path.read_text())
    assert [s["step"] for s in record["steps"]] == [0, 1] and record["steps"][1]["train_updates"] > 0
    record["versions"]["torch"] = "2.0.0"  # as if torch had been upgraded since the attempt began
    record_path.write_text(json.dumps(record))
    built_before = Counter((e["stage"], e["key"]) for e in _journal(work))

    resumed = _qerl(["resume", record["run_id"]], work, source=upgraded_qerl(tmp_path / "upgraded"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    said = resumed.stderr
    assert f"torch 2.0.0 -> {dependency_versions()['torch']}" in said, said[-3000:]
    assert "kept: the base and all 2 built steps" in said, said[-3000:]
    built = Counter((e["stage"], e["key"]) for e in _journal(work))
    assert max(built.values()) == 1, [k for k, n in built.items() if n > 1]  # nothing built twice
    new = {stage for stage, _ in built - built_before}
    assert new == {"train", "evaluate", "register"}, new  # step 2's train (its rollout and score were
    # built before the kill), the evaluations and the registration
    assert _final_adapter(work)
    record = json.loads(record_path.read_text())
    assert record["versions"]["torch"] == dependency_versions()["torch"]  # the new attempt's
