"""Runs that share a prefix of artifacts with a run whose retention pruned them (issue 13's ablation:
the AQN arm equals the no-AQN arm while sigma is 0, then needs the checkpoint the other arm pruned).
The pruned checkpoint is rebuilt, checked against its recorded digests and put back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from qerl.pipeline.store.artifact_store import ArtifactStore
from qerl.pipeline.store.manifest import ArtifactError, BuildResult


def _produce(store: ArtifactStore, payload: bytes, heal: bool = False):
    def build(tmp: Path) -> BuildResult:
        (tmp / "state").mkdir()
        (tmp / "state" / "opt.bin").write_bytes(payload)
        (tmp / "adapter.bin").write_bytes(b"adapter")
        return BuildResult()

    return store.produce("train", {"x": 1}, {"prev": "none"}, "code", build, heal=heal)


def test_a_pruned_artifact_is_rebuilt_and_put_back_only_with_the_same_bytes(tmp_path):
    store = ArtifactStore(tmp_path / "store")
    made, cached = _produce(store, b"moments")
    assert not cached
    store.prune("train", made.key, ["state/opt.bin"], "older than its last step")
    hit, cached = _produce(store, b"moments")
    assert cached and "state/opt.bin" in hit.pruned  # without heal a lookup serves it as it is
    with pytest.raises(ArtifactError, match="not reproducible here"):
        _produce(store, b"other bytes", heal=True)
    assert "state/opt.bin" in store.get("train", made.key).pruned  # nothing changed
    healed, cached = _produce(store, b"moments", heal=True)
    assert not cached and healed.pruned == {}
    assert (healed.dir / "state" / "opt.bin").read_bytes() == b"moments"
    assert healed.digest == made.digest  # downstream keys stay valid
    events = [json.loads(line) for line in (tmp_path / "store" / "gc.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["pruned", "healed"]


@pytest.fixture(scope="module")
def flow_model(tiny_model_factory) -> Path:
    import torch

    return tiny_model_factory(arch="qwen2", dtype=torch.float32)


@pytest.mark.slow
def test_a_run_continues_from_a_checkpoint_another_run_pruned(flow_model, tmp_path):
    """Run A (AQN off, keep 1 optimizer state) prunes its step-1 checkpoint; run B (AQN on, sigma 0
    for steps 0-1) finds steps 0-1 cached, then must build step 2 from A's pruned step 1."""
    from test_flow import _journal, _qerl, tiny_run_config

    cfg = tiny_run_config(flow_model, engine="hf")
    cfg["loop"]["steps"] = 4
    cfg["train"]["total_steps"] = None
    cfg["aqn"] = {"num_stages": 2, "enabled": False}
    cfg["store"] = {"keep_optimizer_last": 1}
    work = tmp_path / "work"
    for name, aqn in (("a", False), ("b", True)):
        cfg["aqn"]["enabled"] = aqn
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
        proc = _qerl(["run", "--config", str(tmp_path / f"{name}.yaml")], work)
        assert proc.returncode == 0, (name, proc.stderr[-4000:])
    runs = {
        json.loads(p.read_text())["run_id"]: json.loads(p.read_text()) for p in work.glob("runs/*/run.json")
    }
    a, b = sorted(runs.values(), key=lambda r: r["config"]["aqn"]["enabled"])
    keys = [[s["manifests"]["train"] for s in r["steps"]] for r in (a, b)]
    assert keys[0][:2] == keys[1][:2] and keys[0][2:] != keys[1][2:]  # a shared prefix, then apart
    gc_events = [json.loads(line) for line in (work / "store" / "gc.jsonl").read_text().splitlines()]
    # A kept step 3's optimizer state only: B rebuilds steps 0 and 1 (same bytes), then builds on
    assert [e["key"] for e in gc_events if e["event"] == "healed"] == keys[0][:2], gc_events
    assert b["status"] == "completed"
    assert (
        max(__import__("collections").Counter((e["stage"], e["key"]) for e in _journal(work)).values()) == 1
    )
