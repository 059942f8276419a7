"""``qerl gc`` and the copies of the base model's artifacts that an older qerl built
(``qerl.pipeline.store.superseded``): removed whole when the installed qerl holds the same bytes."""

from __future__ import annotations

import datetime as _dt
import json
import shutil
from pathlib import Path

from qerl.pipeline.nvfp4.recipe import QuantizeConfig
from qerl.pipeline.store import retention
from qerl.pipeline.store.artifact_store import ArtifactStore
from qerl.pipeline.store.files import atomic_write_json
from qerl.pipeline.store.manifest import BuildResult, Manifest
from qerl.stages import quantize


def older_copy(store: ArtifactStore, current: Manifest, code: str, edit: bytes | None = None) -> Manifest:
    """``current``'s artifact as an older qerl (code version ``code``) built it: the same config,
    inputs and files (``edit``: appended to one file, for a change that moved the numbers)."""

    def build(tmp: Path) -> BuildResult:
        for name in current.files:
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(current.dir / name, tmp / name)
        if edit is not None:
            with open(tmp / "config.json", "ab") as fh:
                fh.write(edit)
        return BuildResult(mode=current.mode, extra=current.extra)

    return store.produce(current.stage, current.config, current.inputs, code, build)[0]


def test_gc_removes_an_older_qerls_copy_of_the_checkpoint_and_the_cache_still_hits(
    tiny_model_dir, tmp_path, capsys
):
    from qerl.flows.cli import main

    store = ArtifactStore(tmp_path / "store")
    current, _ = quantize.run_with_status(QuantizeConfig(), tiny_model_dir, store)
    old = older_copy(store, current, "0ld0ld0ld0ld0ld0")
    assert old.key != current.key and old.digest == current.digest
    assert main(["gc", "--dry-run", "--work-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"remove {old.dir}: whole folder" in out and f"{current.key} holds the same bytes" in out, out
    assert str(current.dir) not in out and old.dir.is_dir()  # a dry run touches nothing
    assert main(["gc", "--work-dir", str(tmp_path)]) == 0
    assert "freed" in capsys.readouterr().out
    assert not old.dir.exists() and not store.problems(Manifest.load(current.dir), full=True)
    (event,) = [json.loads(line) for line in (tmp_path / "store" / "gc.jsonl").read_text().splitlines()]
    assert (event["event"], event["stage"], event["key"]) == ("removed", "quantize", old.key)
    again, cached = quantize.run_with_status(QuantizeConfig(), tiny_model_dir, store)
    assert cached and again.key == current.key  # the installed qerl's lookup never needed the copy
    assert main(["gc", "--work-dir", str(tmp_path)]) == 0
    assert "nothing to delete" in capsys.readouterr().out


def fake_base(store: ArtifactStore, code: str, content: bytes) -> Manifest:
    def build(tmp: Path) -> BuildResult:
        (tmp / "model.safetensors").write_bytes(content)
        return BuildResult(mode="nvfp4/test")

    return store.produce("quantize", {"recipe": "rtn"}, {"base": "b" * 16}, code, build)[0]


def test_a_copy_is_kept_unless_a_whole_current_artifact_holds_its_bytes(tmp_path):
    store = ArtifactStore(tmp_path / "store")
    current = fake_base(store, "new", b"weights")
    other_bytes = fake_base(store, "older", b"weights moved by the code change")
    same_bytes = fake_base(store, "oldest", b"weights")
    found = retention.plan(tmp_path, current_code={"quantize": {"new"}}).deletions
    assert [(d.kind, d.key) for d in found] == [("remove", same_bytes.key)]
    assert other_bytes.key not in {d.key for d in found}  # the only record of what earlier runs trained on
    # a current artifact with pruned files holds nothing to fall back on
    store.prune("quantize", current.key, ["model.safetensors"], "test")
    assert not retention.plan(tmp_path, current_code={"quantize": {"new"}}).deletions
    # without the installed code versions (the flow's own prunes) nothing is superseded
    assert not retention.plan(tmp_path).deletions


def test_a_live_run_keeps_every_superseded_copy(tmp_path):
    store = ArtifactStore(tmp_path / "store")
    fake_base(store, "new", b"weights")
    old = fake_base(store, "old", b"weights")
    now = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    record = {"run_id": "night", "status": "running", "steps": [], "evaluations": [], "updated_at": now}
    atomic_write_json(tmp_path / "runs" / "night" / "run.json", record)
    gc_plan = retention.plan(tmp_path, current_code={"quantize": {"new"}})
    assert not gc_plan.deletions and old.dir.is_dir()
    assert any("superseded" in n and "run night is live" in n for n in gc_plan.notes), gc_plan.notes
    record["status"] = "failed"  # once it is over, the copy goes
    atomic_write_json(tmp_path / "runs" / "night" / "run.json", record)
    gc_plan = retention.plan(tmp_path, current_code={"quantize": {"new"}})
    assert retention.apply(tmp_path, gc_plan) > 0 and not old.dir.exists()
