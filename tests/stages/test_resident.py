"""The train stage's resident policy: reused only when it is exactly the previous checkpoint, and then
bit-identical to reloading that checkpoint from the store."""

from __future__ import annotations

import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from qerl.pipeline.rl.train_config import TrainConfig
from qerl.pipeline.store.artifact_store import ArtifactStore
from qerl.pipeline.store.manifest import BuildResult, Manifest

CFG = dict(
    lora_r=4,
    lora_alpha=8,
    dtype="float32",
    max_grad_norm=1.0,
    seed=3,
    lr=1e-2,
    minibatch_size=3,
    lora_dropout=0.1,
)
FILES = ("adapter/adapter_model.safetensors", "optimizer.safetensors", "trainer_state.json")


@pytest.fixture(scope="module")
def nvfp4_base(tiny_model_dir, tmp_path_factory) -> Path:
    from qerl.pipeline.nvfp4.recipe import QuantizeConfig
    from qerl.stages.quantize import run as quantize

    return quantize(QuantizeConfig(), str(tiny_model_dir), ArtifactStore(tmp_path_factory.mktemp("q"))).dir


@pytest.fixture(autouse=True)
def no_resident_policy():
    from qerl.stages.train import drop_resident_policy

    drop_resident_policy()
    yield
    drop_resident_policy()


def _scored(store: ArtifactStore, step: int) -> Manifest:
    """Two GRPO groups of three completions with rewards that differ within each group."""
    gen = torch.Generator().manual_seed(100 + step)

    def build(tmp: Path) -> BuildResult:
        rows = {k: [] for k in ("prompt_id", "group_id", "sample_idx", "prompt_ids", "completion_ids")}
        rows.update(logprobs=[], finish_reason=[], reward=[], temperature=[])
        for i in range(6):
            n = 2 + i % 3
            rows["prompt_id"].append(f"p{i // 3}")
            rows["group_id"].append(i // 3)
            rows["sample_idx"].append(i)
            rows["prompt_ids"].append([5 + i // 3, 17, 33])
            rows["completion_ids"].append(torch.randint(3, 200, (n,), generator=gen).tolist())
            rows["logprobs"].append((-torch.rand(n, generator=gen) * 3).tolist())
            rows["finish_reason"].append("stop")
            rows["reward"].append(float(i % 3 == step % 3))
            rows["temperature"].append(1.0)
        pq.write_table(pa.table(rows), tmp / "scored.parquet")
        return BuildResult()

    return store.produce("score", {"step": step}, {}, "test", build)[0]


def _chain(base: Manifest, store: ArtifactStore, steps: int, reload_each_step: bool) -> list[Manifest]:
    from qerl.stages.train import drop_resident_policy, run

    cfg = TrainConfig(**CFG)
    out: list[Manifest] = []
    for step in range(steps):
        if reload_each_step:
            drop_resident_policy()
        torch.rand(7)  # other stages draw from the global RNG between train steps
        out.append(
            run(
                cfg=cfg,
                base=base,
                scored=_scored(store, step),
                prev=out[-1] if out else None,
                step=step,
                store=store,
            )
        )
    return out


def test_resident_policy_equals_reloading_every_step(nvfp4_base, tmp_path, caplog):
    base = Manifest.load(nvfp4_base)
    with caplog.at_level(logging.INFO, logger="qerl.stages.train"):
        resident = _chain(base, ArtifactStore(tmp_path / "a"), 3, reload_each_step=False)
    assert [m.extra["policy"] for m in resident] == ["loaded", "resident", "resident"]
    assert sum("resident policy reused" in r.getMessage() for r in caplog.records) == 2
    reloaded = _chain(base, ArtifactStore(tmp_path / "b"), 3, reload_each_step=True)
    assert [m.extra["policy"] for m in reloaded] == ["loaded"] * 3
    for a, b in zip(resident, reloaded, strict=True):
        for name in FILES:  # adapter, AdamW moments and step counts, scheduler, RNG, counters
            assert (a.dir / name).read_bytes() == (b.dir / name).read_bytes(), (a.extra["step"], name)
        assert a.digest == b.digest


def test_resident_policy_is_reused_only_for_its_own_checkpoint(nvfp4_base, tmp_path, caplog):
    from qerl.stages.train import run

    base, store = Manifest.load(nvfp4_base), ArtifactStore(tmp_path / "s")
    cfg = TrainConfig(**CFG)
    m0 = run(cfg=cfg, base=base, scored=_scored(store, 0), prev=None, step=0, store=store)
    other = ArtifactStore(tmp_path / "other")
    o0 = run(
        cfg=cfg, base=base, scored=_scored(other, 5), prev=None, step=0, store=other
    )  # now o0 is resident, not m0
    with caplog.at_level(logging.INFO, logger="qerl.stages.train"):
        m1 = run(cfg=cfg, base=base, scored=_scored(store, 1), prev=m0, step=1, store=store)
    assert m1.extra["policy"] == "loaded" and "policy reloaded from the store" in caplog.text
    assert o0.digest[:12] in caplog.text  # the log says which checkpoint was resident
    changed = TrainConfig(**{**CFG, "lr": 2e-2})  # m1 is resident, but under another config
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="qerl.stages.train"):
        m2 = run(cfg=changed, base=base, scored=_scored(store, 2), prev=m1, step=2, store=store)
    assert m2.extra["policy"] == "loaded" and "different train" in caplog.text
    # a step that fails mid-way leaves no half-updated policy behind
    m3 = run(cfg=changed, base=base, scored=_scored(store, 3), prev=m2, step=3, store=store)
    assert m3.extra["policy"] == "resident"
    with pytest.raises(Exception, match="after 4 steps"):
        run(cfg=changed, base=base, scored=_scored(store, 4), prev=m3, step=5, store=store)
    m4 = run(cfg=changed, base=base, scored=_scored(store, 4), prev=m3, step=4, store=store)
    assert m4.extra["policy"] == "loaded"
