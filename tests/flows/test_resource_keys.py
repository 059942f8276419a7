"""Results and resources: cache keys and the run id hold what changes results, never what only
changes resources (``qerl.pipeline.config.resource_field``); a run resumed with other resources
rebuilds nothing it finished."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from qerl.pipeline.config import StrictModel, apply_overrides, config_hash, key_payload, resource_field
from qerl.pipeline.planning.config_reference import reference_rows
from qerl.pipeline.planning.run_config import RunConfig, load_run_config
from qerl.pipeline.store.artifact_store import ArtifactStore
from qerl.pipeline.store.manifest import BuildResult, Manifest

# the split, setting by setting (the config reference's "in keys" column); ``store.*`` is all resource
RESOURCE_SETTINGS = {
    "quantize.max_shard_mb": 1.0,
    "rollout.max_lora_rank": 64,
    "rollout.kv_cache_gib": 3.0,
    "rollout.gpu_memory_utilization": 0.85,
    "rollout.max_num_seqs": 7,
    "rollout.max_num_batched_tokens": 4096,
    "rollout.kv_block_size": 64,
    "rollout.enforce_eager": "flip",
    "rollout.in_process": "flip",
    "rollout.hf_batch_size": 3,
    "rollout.tensor_parallel_size": 2,
    "reward.timeout_s": 30.0,
    "reward.workers": 9,
    "reward.chunk_size": 2,
    "reward.worker_memory_mb": 8192,
    "reward.startup_timeout_s": 300.0,
    "reward.fast_path": "flip",
    "train.minibatch_size": None,  # with grad_accum: the update size is keyed (below)
    "train.grad_accum": None,
    "train.gradient_checkpointing": "flip",
    "train.deterministic": "flip",
    "registry.lock_timeout_s": 5.0,
    "loop.deadline_h": 20.0,
    # the quality report's settings: its own key holds them, no checkpoint, twin or adapter depends on them
    "quantize.quality.enabled": "flip",
    "quantize.quality.source": "arithmetic",
    "quantize.quality.data_root": "/data",
    "quantize.quality.texts": 8,
    "quantize.quality.prompt": "chat",
    "quantize.quality.max_tokens": 512,
    "quantize.quality.dtype": "bfloat16",
}
RESULT_SETTINGS = {
    "rollout.n_samples": 3,
    "rollout.max_new_tokens": 17,
    "rollout.template": "boxed",
    "reward.correct_reward": 2.0,
    "train.lr": 3e-4,
    "train.lora_r": 8,
    "eval.max_new_tokens": 33,
    "quantize.targets": ["q_proj", "k_proj", "v_proj"],
    "aqn.sigma_start": 0.02,
    "data.limit": 5,
}


def _get(cfg: object, dotted: str) -> object:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _set(cfg: RunConfig, dotted: str, value: object) -> RunConfig:
    if value == "flip":
        value = not _get(cfg, dotted)
    *path, key = dotted.split(".")
    extra: dict = {key: value}
    if dotted == "rollout.tensor_parallel_size":
        extra["in_process"] = False  # an in-process engine has one worker
    for part in reversed(path):
        extra = {part: extra}
    changed = apply_overrides(cfg, extra)
    assert _get(changed, dotted) != _get(cfg, dotted), dotted
    return changed


def _keys(cfg: RunConfig) -> dict[str, str]:
    """Every key part a stage builds from the config, and the run id."""
    from qerl.pipeline.planning.runs import run_id_for
    from qerl.stages import quantize, train

    base = Manifest(
        stage="quantize", key="k", config={}, inputs={}, code_version="c", files={}, created_at=""
    )
    scored = Manifest(stage="score", key="s", config={}, inputs={}, code_version="c", files={}, created_at="")
    train_key, _, _ = train._key_parts(cfg.train, base, scored, None, 0, None)
    keys = {
        s: config_hash(getattr(cfg, s)) for s in RunConfig.model_fields if s != "store"
    }  # no stage keys it
    keys.update(
        run_id=run_id_for(cfg),
        train=config_hash(train_key),
        quantize=config_hash(quantize._recipe_key(cfg.quantize)),
        rollout=config_hash({"rollout": cfg.rollout, "sigma": 0.0, "step": 0, "engine_mode": "m"}),
    )
    return keys


def test_the_split_is_the_declared_one():
    """Every leaf setting is in keys or not as declared; the reference table says which."""
    rows = {key: keyed for key, _, _, keyed, _ in reference_rows()}
    resource = {k for k, keyed in rows.items() if not keyed and not k.startswith("store.")}
    assert resource == set(RESOURCE_SETTINGS)
    assert all(not keyed for k, keyed in rows.items() if k.startswith("store."))
    assert all(rows[k] for k in RESULT_SETTINGS)


@pytest.mark.parametrize("dotted", [k for k, v in RESOURCE_SETTINGS.items() if v is not None])
def test_a_resource_change_keeps_every_key_and_the_run_id(dotted):
    cfg = load_run_config()
    assert _keys(_set(cfg, dotted, RESOURCE_SETTINGS[dotted])) == _keys(cfg)


def test_the_retention_policy_and_the_minibatch_split_keep_the_keys():
    cfg = load_run_config()
    keys = _keys(cfg)
    assert _keys(apply_overrides(cfg, {"store": {"keep_optimizer_last": 5}})) == keys
    mb, acc = cfg.train.minibatch_size, cfg.train.grad_accum
    assert mb % 2 == 0
    split = apply_overrides(cfg, {"train": {"minibatch_size": mb // 2, "grad_accum": acc * 2}})
    assert _keys(split) == keys  # the same update, cut into smaller minibatches (qerl plan's advice)
    bigger = apply_overrides(cfg, {"train": {"grad_accum": acc * 2}})  # twice the update: a result
    assert _keys(bigger)["train"] != keys["train"] and _keys(bigger)["run_id"] != keys["run_id"]
    # bnpo normalises each minibatch by its own tokens: there the split is a result
    bnpo = apply_overrides(cfg, {"train": {"grpo": {"loss_type": "bnpo"}}})
    bnpo_split = apply_overrides(bnpo, {"train": {"minibatch_size": mb // 2, "grad_accum": acc * 2}})
    assert _keys(bnpo_split)["train"] != _keys(bnpo)["train"]


@pytest.mark.parametrize("dotted", list(RESULT_SETTINGS))
def test_a_result_change_changes_the_run_id_and_its_section(dotted):
    cfg = load_run_config()
    before, after = _keys(cfg), _keys(_set(cfg, dotted, RESULT_SETTINGS[dotted]))
    section = dotted.split(".")[0]
    assert after["run_id"] != before["run_id"] and after[section] != before[section]


class _Sizing(StrictModel):
    rate: float = 1.0
    batch: int = resource_field(4, ge=1)


class _Stage(StrictModel):
    inner: _Sizing = _Sizing()
    many: list[_Sizing] = [_Sizing()]
    workers: int = resource_field(2)


def test_the_manifest_records_resources_the_key_leaves_them_out(tmp_path):
    store = ArtifactStore(tmp_path)
    cfg = _Stage()
    assert key_payload({"s": cfg, "step": 1}) == {
        "s": {"inner": {"rate": 1.0}, "many": [{"rate": 1.0}]},
        "step": 1,
    }
    built = []

    def build(tmp: Path) -> BuildResult:
        built.append(1)
        (tmp / "out.txt").write_text("x")
        return BuildResult()

    first, cached = store.produce("s", {"s": cfg}, {}, "c", build)
    assert not cached and first.config["s"]["workers"] == 2 and first.config["s"]["inner"]["batch"] == 4
    other = _Stage(inner=_Sizing(batch=9), many=[_Sizing(batch=7)], workers=8)
    again, cached = store.produce("s", {"s": other}, {}, "c", build)
    assert cached and again.key == first.key and built == [1]
    changed, cached = store.produce("s", {"s": _Stage(inner=_Sizing(rate=2.0))}, {}, "c", build)
    assert not cached and changed.key != first.key


def _builds(work: Path) -> list[dict]:
    path = work / "store" / "builds.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


@pytest.mark.slow
def test_a_run_resumed_with_other_resources_rebuilds_nothing_before_its_crash(
    tiny_model_factory, tmp_path, monkeypatch
):
    """Crash in train step 1 of 2, resume with every kind of resource changed: only step 1's train
    (and what follows it) is built; the record keeps the new resources."""
    import torch
    from prefect_home import run_here
    from qerl.pipeline.planning.runs import run_id_for
    from qerl.stages import train

    from tests.flows.test_flow import tiny_run_config

    raw = tiny_run_config(tiny_model_factory(arch="qwen2", dtype=torch.float32))
    raw["loop"]["steps"] = 2
    cfg = RunConfig.model_validate(raw)
    work = tmp_path / "work"
    real = train.run

    def crash(**kwargs):
        if kwargs["step"] == 1:
            raise RuntimeError("killed in train step 1")
        return real(**kwargs)

    monkeypatch.setattr(train, "run", crash)
    with pytest.raises(Exception, match="killed in train step 1"):
        run_here(cfg, work)
    monkeypatch.setattr(train, "run", real)
    done = len(_builds(work))
    assert Counter(e["stage"] for e in _builds(work))["train"] == 1

    resources = {
        "rollout": {"max_num_seqs": 5, "hf_batch_size": 3, "kv_cache_gib": 0.5, "enforce_eager": False},
        "reward": {"workers": 2, "timeout_s": 20.0, "chunk_size": 2},
        "train": {"minibatch_size": 4, "grad_accum": 2, "gradient_checkpointing": True},
        "quantize": {"max_shard_mb": 1.0},
        "registry": {"lock_timeout_s": 30.0},
        "store": {"keep_optimizer_last": 1},
    }
    changed = apply_overrides(cfg, resources)
    assert run_id_for(changed) == run_id_for(cfg)
    record = run_here(changed, work)
    assert record["status"] == "completed" and record["run_id"] == run_id_for(cfg)
    rebuilt = Counter(e["stage"] for e in _builds(work)[done:] if e.get("event") == "built")
    assert rebuilt["train"] == 1, rebuilt  # step 1 only
    assert set(rebuilt) <= {"train", "evaluate", "register"}, rebuilt  # no base, rollout or score again
    assert record["config"]["rollout"]["max_num_seqs"] == 5 and record["config"]["train"]["grad_accum"] == 2


def test_resume_set_takes_resource_settings_only(tmp_path):
    """``qerl resume RUN --set``: a resource setting keeps the run; a result setting is refused,
    named, before anything starts."""
    from qerl.pipeline.planning.runs import run_id_for, with_resources

    from tests.flows.test_flow import _qerl

    cfg = load_run_config()
    kept = with_resources(
        cfg, None, ["rollout.gpu_memory_utilization=0.7", "train.gradient_checkpointing=true"]
    )
    assert kept.rollout.gpu_memory_utilization == 0.7 and run_id_for(kept) == run_id_for(cfg)
    with pytest.raises(ValueError, match=r"--set train\.lr=0\.1 changes results"):
        with_resources(cfg, None, ["reward.workers=2", "train.lr=0.1"])
    # plan's advice, a smaller minibatch with grad_accum raised to match, with an explicit
    # total_steps: valid only as a pair (found refusing when the overrides were checked one by one)
    fixed = cfg.model_copy(update={"train": cfg.train.model_copy(update={"total_steps": 240})})
    mb = fixed.train.minibatch_size
    halved = with_resources(
        fixed, None, [f"train.minibatch_size={mb // 2}", f"train.grad_accum={2 * fixed.train.grad_accum}"]
    )
    assert halved.train.minibatch_size == mb // 2 and run_id_for(halved) == run_id_for(fixed)

    rid = run_id_for(cfg)
    record = {"run_id": rid, "config": cfg.model_dump(mode="json"), "night": None, "status": "failed"}
    (tmp_path / "runs" / rid).mkdir(parents=True)
    (tmp_path / "runs" / rid / "run.json").write_text(json.dumps(record))
    proc = _qerl(["resume", rid, "--set", "rollout.n_samples=4"], tmp_path)
    assert proc.returncode == 2 and "--set rollout.n_samples=4 changes results" in proc.stderr, proc.stderr
