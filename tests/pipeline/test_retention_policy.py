"""Retention by default: a completed run keeps no optimizer state, adapters at the evaluation interval,
step tables per ``keep_step_tables``; the disk estimate before a run; 30 nights of the 7B preset."""

from __future__ import annotations

from pathlib import Path

import pytest
from qerl.pipeline.planning import disk_plan
from qerl.pipeline.planning.run_config import load_run_config
from qerl.pipeline.store import retention, retention_policy
from qerl.pipeline.store.artifact_store import ArtifactStore
from qerl.pipeline.store.files import atomic_write_json
from qerl.pipeline.store.manifest import BuildResult, Manifest
from qerl.pipeline.store.run_record import RunRecord

from tests.pipeline.test_gc import ADAPTER, fake_step, pruned_names

GB = 1e9


def table(store: ArtifactStore, stage: str, run: str, step: int) -> Manifest:
    def build(tmp: Path) -> BuildResult:
        (tmp / f"{stage}.parquet").write_bytes(b"t" * 500)
        return BuildResult()

    return store.produce(stage, {"run": run, "step": step}, {}, "code", build)[0]


def night(work: Path, run: str, steps: int, status: str, config: dict) -> list[dict[str, Manifest]]:
    """A run with rollout, score and train artifacts per step and its record."""
    store = ArtifactStore(work / "store")
    out: list[dict[str, Manifest]] = []
    for s in range(steps):
        t = fake_step(store, run, s, out[-1]["train"] if out else None)
        out.append(
            {"rollout": table(store, "rollout", run, s), "score": table(store, "score", run, s), "train": t}
        )
    record = {
        "run_id": run, "status": status, "config": config, "evaluations": [],
        "steps": [{"step": s, "manifests": {k: m.key for k, m in e.items()}} for s, e in enumerate(out)],
    }  # fmt: skip
    if status == "completed":
        record["final_adapter"] = str(out[-1]["train"].dir / "adapter")
    atomic_write_json(work / "runs" / run / "run.json", record)
    return out


def test_a_completed_run_keeps_no_optimizer_state_and_adapters_at_the_eval_interval(tmp_path):
    loop = {"steps": 6, "eval_every": 3}
    done = night(tmp_path, "done", 6, "completed", {"loop": loop, "store": {"keep_step_tables": False}})
    died = night(tmp_path, "died", 6, "failed", {"loop": loop, "store": {"keep_step_tables": False}})
    retention.prune_run(tmp_path, "done")
    retention.prune_run(tmp_path, "died")
    opt = {"optimizer.safetensors"}
    # completed: no optimizer state; adapters of steps 3 and 6 (the evaluation interval) stay
    assert [pruned_names(e["train"]) for e in done] == [opt | ADAPTER] * 2 + [opt] + [opt | ADAPTER] * 2 + [
        opt
    ]
    assert all(pruned_names(e[s]) == {f"{s}.parquet"} for e in done for s in ("rollout", "score"))
    # unfinished: its last 2 steps whole (a resume continues there); its tables stay
    assert [pruned_names(e["train"]) for e in died] == [opt | ADAPTER] * 2 + [opt] + [opt | ADAPTER] + [
        set()
    ] * 2
    assert all(pruned_names(e[s]) == set() for e in died for s in ("rollout", "score"))
    store = ArtifactStore(tmp_path / "store")
    assert store.get("rollout", done[0]["rollout"].key) is not None  # a re-run still finds every step


def test_no_run_an_ablation_lists_is_pruned_until_all_completed(tmp_path):
    """The arms share steps while sigma is 0: the first arm's retention must leave them for the
    other; the last arm to complete prunes every listed run by its own policy."""
    cfg = {"loop": {"steps": 3}}
    a = night(tmp_path, "arm-a", 3, "completed", cfg)
    runs = [{"arm": "a", "run_id": "arm-a"}, {"arm": "b", "run_id": "arm-b"}]
    atomic_write_json(tmp_path / "ablations" / "abl" / "ablation.json", {"id": "abl", "runs": runs})
    assert retention.prune_run(tmp_path, "arm-a") == 0
    assert all(pruned_names(e["train"]) == set() for e in a)
    b = night(tmp_path, "arm-b", 2, "running", cfg)  # b runs; a's steps still stay
    assert retention.prune_run(tmp_path, "arm-b") == 0 and all(pruned_names(e["train"]) == set() for e in a)
    night(tmp_path, "arm-b", 3, "completed", cfg)
    assert retention.prune_run(tmp_path, "arm-b") > 0
    assert all("optimizer.safetensors" in pruned_names(e["train"]) for e in a + b)  # a's too


def test_the_run_is_refused_when_its_estimate_does_not_fit(tmp_path, monkeypatch):
    cfg = load_run_config("qwen2.5-7b-gsm8k", [])
    monkeypatch.setattr(disk_plan, "free_bytes", lambda path: 3 * 10**9)
    with pytest.raises(disk_plan.DiskSpaceError) as err:
        disk_plan.check_disk(cfg, tmp_path / "work")
    text = str(err.value)
    assert "\n" not in text and f"work dir {tmp_path / 'work'}" in text and "3.0 GB is free" in text
    for part in ("adapters", "optimizer states", "rollouts", "quantized checkpoint", "registry copies"):
        assert part in text
    assert "store.check_disk=false" in text
    off = load_run_config("qwen2.5-7b-gsm8k", ["store.check_disk=false"])
    assert disk_plan.check_disk(off, tmp_path / "work")["adapters"] > 0  # estimated, not refused
    monkeypatch.setattr(disk_plan, "free_bytes", lambda path: 10**12)
    parts = disk_plan.check_disk(cfg, tmp_path / "work")
    assert parts["adapters"] == 4 * disk_plan.adapter_bytes(cfg, disk_plan.model_shape(cfg))
    assert parts["databases"] == disk_plan.DATABASES_BYTES and "base model" not in parts  # a hub model's
    # the demo: its base is built in the store, and counted until the store holds it
    demo = load_run_config("demo", [])
    built = disk_plan.check_disk(demo, tmp_path / "work")["base model"]
    assert built == 2 * sum(disk_plan.base_bytes(disk_plan.model_shape(demo), "bf16").values())
    (tmp_path / "work" / "store" / "objects" / "demo-base" / "k").mkdir(parents=True)
    (tmp_path / "work" / "mlflow.db").write_bytes(b"")
    later = disk_plan.check_disk(demo, tmp_path / "work")
    assert "base model" not in later and "databases" not in later


def test_the_7b_presets_nights_hold_the_store_under_30_gb_however_many(tmp_path, monkeypatch):
    """The retention arithmetic, no run: the policy's marks on 30 completed 500-step nights (what
    mark_run keeps) agree with the estimate's counts; with the preset's keep_versions the store stays
    under 30 GB for any number of nights, and a released night keeps no adapter."""
    monkeypatch.setattr(disk_plan, "needs_twin", lambda engine, scheme: False)  # vLLM on the GPU
    cfg = load_run_config("qwen2.5-7b-gsm8k", [])
    one = disk_plan.adapter_bytes(cfg, disk_plan.model_shape(cfg))
    assert one == pytest.approx(323e6, rel=0.01)  # r=32 on all seven projections of Qwen2.5-7B
    marks = retention_policy.Marks()
    steps = cfg.loop.steps
    for n in range(30):
        record = RunRecord.model_validate({
            "run_id": f"night-{n}", "status": "completed", "config": cfg.model_dump(mode="json"),
            "final_adapter": f"/s/objects/train/n{n}-s{steps - 1}/adapter",
            "steps": [{"step": s, "manifests": {k: f"n{n}-s{s}" for k in ("rollout", "score", "train")}}
                      for s in range(steps)],
        })  # fmt: skip
        retention_policy.mark_run(marks, record, retention_policy.policy_for(record), live=False)
    keys = {f"n{n}-s{s}" for n in range(30) for s in range(steps)}
    kept_opt = {k for k in keys if k not in marks.drop_opt or k in marks.keep_opt}
    kept_adapters = {k for k in keys if k not in marks.drop_adapter or k in marks.keep_adapter}
    kept_tables = {k for k in marks.keep_tables} | {k for k in marks.drop_tables if k in marks.keep_tables}
    assert kept_opt == set() and kept_tables == set()
    assert len(kept_adapters) == 30 * disk_plan.kept_adapters(cfg, finished=True) == 60
    released = retention_policy.Marks()
    retention_policy.mark_run(released, record, retention_policy.policy_for(record), False, "released")
    assert set(released.drop_adapter) == set(released.released) == {f"n29-s{s}" for s in range(steps)}
    assert released.keep_adapter == set()
    total = disk_plan.store_after_nights(cfg, 30)
    assert total < 30 * GB, total / GB
    # store.keep_versions bounds it: a year of nights holds what 15 do (14 kept and an older champion)
    assert disk_plan.store_after_nights(cfg, 365) == disk_plan.store_after_nights(cfg, 15) == total
    unbounded = load_run_config("qwen2.5-7b-gsm8k", ["store.keep_versions=null"])
    assert disk_plan.store_after_nights(unbounded, 30) > 40 * GB
    assert disk_plan.store_after_nights(unbounded, 365) > 300 * GB
    # the defaults alone (every adapter at the eval interval, the step tables kept) would not hold
    plain = load_run_config(
        "qwen2.5-7b-gsm8k",
        ["store.keep_adapters_every=null", "store.keep_step_tables=true", "store.keep_versions=null"],
    )
    assert disk_plan.store_after_nights(plain, 30) > 100 * GB


def test_a_finished_run_whose_tables_were_pruned_is_still_all_cache_hits(tiny_model_dir, tmp_path):
    """``keep_step_tables: false`` prunes the rollout and scored tables of a completed run; a re-run
    of it reads no table (score and train read theirs on a miss only)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from qerl.pipeline.data.rewards import RewardConfig
    from qerl.pipeline.nvfp4.recipe import QuantizeConfig
    from qerl.pipeline.rl.train_config import TrainConfig
    from qerl.stages import quantize, score, train

    from tests.stages.test_train import PROMPTS, TINY, _scored_manifest, sample_batch

    store = ArtifactStore(tmp_path / "store")

    def rollouts_build(tmp: Path) -> BuildResult:
        rows = {"group_id": [0, 0], "completion_text": ["<answer>4</answer>", "5"], "answer": ["4", "4"]}
        pq.write_table(pa.table(rows), tmp / "rollouts.parquet")
        return BuildResult()

    rollouts = store.produce("rollout", {"t": 1}, {}, "code", rollouts_build)[0]
    scored = score.run(RewardConfig(workers=1), rollouts, store)
    cfg = TrainConfig(**TINY, lr=1e-2)
    base = quantize.run(QuantizeConfig(), str(tiny_model_dir), store)
    from qerl.pipeline.rl.policy import init_state

    batch = sample_batch(init_state(base.dir, cfg).model, PROMPTS, 2, 3, 1, lambda c: c[0] % 2)
    train_in = _scored_manifest(store, batch, "s0")
    step0 = train.run(cfg=cfg, base=base, scored=train_in, prev=None, step=0, store=store)
    for m in (rollouts, scored, train_in):
        store.prune(m.stage, m.key, list(m.files), "run r completed (store.keep_step_tables: false)")
    n = len(store.builds())
    assert score.run(RewardConfig(workers=1), store.get("rollout", rollouts.key), store).key == scored.key
    pruned_in = store.get("score", train_in.key)
    assert train.run(cfg=cfg, base=base, scored=pruned_in, prev=None, step=0, store=store).key == step0.key
    assert len(store.builds()) == n


@pytest.mark.slow  # a Prefect flow run (about a minute)
def test_a_run_that_cannot_fit_is_refused_before_anything_is_built(tmp_path, monkeypatch):
    """The flow checks the estimate first: a failed run, its record naming the numbers, an empty store."""
    from prefect_home import run_here
    from qerl.pipeline.planning.run_config import RunConfig

    monkeypatch.setattr(disk_plan, "free_bytes", lambda path: 1000)
    work = tmp_path / "work"
    with pytest.raises(disk_plan.DiskSpaceError, match=r"only 1.0 KB is free"):
        run_here(RunConfig(), work)
    (record_path,) = (work / "runs").glob("*/run.json")
    record = __import__("json").loads(record_path.read_text())
    assert record["status"] == "failed" and "DiskSpaceError: work dir" in record["error"]
    assert not (work / "store" / "builds.jsonl").exists()
