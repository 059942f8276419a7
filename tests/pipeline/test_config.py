"""Config machinery: YAML then --set overrides, unknown keys rejected with the valid ones listed."""

from __future__ import annotations

import pytest
from qerl.pipeline.config import (
    ConfigError,
    StrictModel,
    apply_overrides,
    config_hash,
    load_config,
    parse_overrides,
)


class Inner(StrictModel):
    lr: float = 1e-5
    targets: list[str] = ["q_proj"]


class Outer(StrictModel):
    name: str = "demo"
    steps: int = 4
    inner: Inner = Inner()


def test_defaults_yaml_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("name: run1\ninner:\n  lr: 0.001\n")
    cfg = load_config(Outer, path, ["inner.targets=[a, b]", "steps=7"])
    assert cfg.name == "run1" and cfg.steps == 7
    assert cfg.inner.lr == 0.001 and cfg.inner.targets == ["a", "b"]


def test_unknown_key_lists_valid_keys(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("inner:\n  learning_rate: 0.1\n")
    with pytest.raises(ConfigError, match=r"inner\.learning_rate.*valid keys here: lr, targets"):
        load_config(Outer, path)
    with pytest.raises(ConfigError, match="stepz.*inner, name, steps"):
        load_config(Outer, None, ["stepz=3"])


def test_type_errors_name_the_key():
    with pytest.raises(ConfigError, match="steps"):
        load_config(Outer, None, ["steps=many"])


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="section.key=value"):
        parse_overrides(["steps"])


def test_missing_file_and_non_mapping(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(Outer, tmp_path / "nope.yaml")
    bad = tmp_path / "list.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(Outer, bad)


def test_yaml_that_does_not_parse_is_a_config_error_naming_it(tmp_path):
    bad = tmp_path / "broken.yaml"
    bad.write_text("name: run1\ninner:\n  targets: [q_proj\n")
    with pytest.raises(
        ConfigError, match=r"config file .*broken.yaml is not valid YAML at line 4, column 1: expected"
    ):
        load_config(Outer, bad)
    with pytest.raises(
        ConfigError, match=r"the value of override 'inner.targets=\[a' is not valid YAML: expected"
    ):
        load_config(Outer, None, ["inner.targets=[a"])


def test_apply_overrides_and_hash_is_stable():
    cfg = Outer()
    changed = apply_overrides(cfg, ["inner.lr=0.5"])
    assert changed.inner.lr == 0.5 and cfg.inner.lr == 1e-5
    assert config_hash(cfg) == config_hash(Outer()) != config_hash(changed)


def test_configs_are_frozen():
    with pytest.raises(Exception, match="frozen"):
        Outer().steps = 3  # type: ignore[misc]


# ---- the run config's cross-checks (pipeline/planning/run_checks.py) ----------------------------------------


def _updates_run_by_the_trainer(cfg) -> int:
    """Optimizer updates of one RL step as the training loop itself groups them."""
    import torch
    from qerl.pipeline.rl.step import _update_groups

    samples = cfg.loop.prompts_per_step * cfg.rollout.n_samples
    return len(_update_groups(samples, cfg.train, torch.Generator().manual_seed(0)))


@pytest.mark.parametrize(
    "shape",
    [
        {},  # the defaults
        {"train.minibatch_size": 4, "train.grad_accum": 8},  # the 7B recipe's shape
        {"train.minibatch_size": 5, "train.grad_accum": 3, "train.mu": 2, "loop.prompts_per_step": 7},
        {"train.minibatch_size": 512, "rollout.n_samples": 3},
    ],
)
def test_schedule_length_is_derived_from_the_loop(shape):
    from qerl.pipeline.planning.run_config import load_run_config

    cfg = load_run_config(None, [f"{k}={v}" for k, v in {**shape, "train.total_steps": "null"}.items()])
    assert cfg.train.total_steps == cfg.loop.steps * _updates_run_by_the_trainer(cfg)


def test_every_preset_schedule_spans_its_loop():
    """The 7B preset had total_steps 500 for 2,000 updates: lr 0 for the last three quarters."""
    from qerl.pipeline.planning.run_config import load_run_config, preset_names

    for name in preset_names():
        cfg = load_run_config(name)
        assert cfg.train.total_steps >= cfg.loop.steps * _updates_run_by_the_trainer(cfg), name
    assert load_run_config("qwen2.5-7b-gsm8k").train.total_steps == 500 * 4


def test_a_schedule_shorter_than_the_loop_is_rejected_with_the_numbers():
    from qerl.pipeline.planning.run_config import load_run_config

    over = ["loop.steps=10", "loop.prompts_per_step=16", "rollout.n_samples=8", "train.minibatch_size=4"]
    over += ["train.grad_accum=8"]
    with pytest.raises(
        ConfigError, match=r"train\.total_steps \(39\) is shorter than the run's 40 optimizer"
    ):
        load_run_config(None, [*over, "train.total_steps=39"])
    assert load_run_config(None, [*over, "train.total_steps=60"]).train.total_steps == 60  # longer: allowed
    with pytest.raises(ConfigError, match=r"warmup_steps \(40\) must be < the schedule's 40 updates"):
        load_run_config(None, [*over, "train.warmup_steps=40"])


def test_an_evaluation_longer_than_the_engines_context_is_refused_at_load():
    """The paper's 4,096-token evaluation on the 7B preset (context 2,048) failed after the last step."""
    from qerl.pipeline.planning.run_config import load_run_config

    with pytest.raises(
        ConfigError, match=r"eval\.max_new_tokens \(4096\) leaves no room.*max_model_len 2048"
    ):
        load_run_config("qwen2.5-7b-gsm8k", ["eval.max_new_tokens=4096"])
    assert load_run_config("qwen2.5-7b-gsm8k", ["rollout.max_model_len=8192", "eval.max_new_tokens=4096"])


def test_the_twin_is_stored_in_the_trainers_dtype():
    """The demo served a bf16 twin beside an fp32 trainer: every nonzero weight differed."""
    from qerl.pipeline.planning.run_config import load_run_config

    for name in ("demo", "qwen2.5-7b-gsm8k"):
        cfg = load_run_config(name)
        assert cfg.quantize.twin_dtype == cfg.train.dtype, name
        assert cfg.rollout.dtype in ("auto", cfg.train.dtype), name
    assert (
        load_run_config(None, ["train.dtype=bfloat16", "rollout.dtype=auto"]).quantize.twin_dtype
        == "bfloat16"
    )
    with pytest.raises(
        ConfigError, match=r"quantize\.twin_dtype \(bfloat16\) must equal train\.dtype \(float32\)"
    ):
        load_run_config(None, ["quantize.twin_dtype=bfloat16"])
    with pytest.raises(ConfigError, match=r"rollout\.dtype \(bfloat16\) must be train\.dtype \(float32\)"):
        load_run_config(None, ["rollout.dtype=bfloat16"])
    with pytest.raises(ConfigError, match="vLLM serves a float32 checkpoint in bfloat16 under auto"):
        load_run_config(None, ["rollout.dtype=auto"])
    assert load_run_config(None, ["rollout.dtype=auto", "rollout.engine=hf"]).rollout.dtype == "auto"


def test_the_adapter_must_fit_the_engine():
    from qerl.pipeline.planning.run_config import load_run_config

    with pytest.raises(ConfigError, match=r"train\.lora_r \(32\) exceeds rollout\.max_lora_rank \(16\)"):
        load_run_config(None, ["train.lora_r=32"])
    with pytest.raises(ConfigError, match=r"rollout\.max_lora_rank \(24\) is not one vLLM accepts"):
        load_run_config(None, ["rollout.max_lora_rank=24"])
    with pytest.raises(ConfigError, match="rollout.enable_lora is false"):
        load_run_config(None, ["rollout.enable_lora=false"])
    assert load_run_config(None, ["train.lora_r=32", "rollout.max_lora_rank=32"]).train.lora_r == 32
    assert load_run_config(None, ["train.lora_r=64", "rollout.engine=hf"]).train.lora_r == 64  # no slots


def test_a_derived_config_round_trips():
    """A run record stores the derived values; loading it again (``qerl resume``) gives the same config."""
    from qerl.pipeline.planning.run_config import RunConfig, load_run_config

    cfg = load_run_config()
    assert RunConfig.model_validate(cfg.model_dump(mode="json")) == cfg


def test_eval_engine_caps_are_derived_and_configurable(tmp_path):
    """``qerl eval`` hard-coded a 2048 context and a rank-32 LoRA slot; both now follow the model and
    the adapter, and ``--set rollout.KEY=...`` overrides them."""
    import json

    from qerl.pipeline.evaluation.eval_config import EvalConfig
    from qerl.pipeline.planning.engine_setup import eval_rollout_config, vllm_lora_rank

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 512}))
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 48, "rank_pattern": {"q_proj": 80}}))
    cfg = eval_rollout_config(EvalConfig(), "vllm", model, adapter)
    assert (cfg.max_model_len, cfg.max_lora_rank, cfg.enable_lora, cfg.logprobs) == (512, 128, True, False)
    assert (cfg.temperature, cfg.top_p, cfg.n_samples) == (0.6, 0.95, 4)
    bare = eval_rollout_config(EvalConfig(greedy=True), "hf", model, None, ["max_model_len=300"])
    assert (bare.max_model_len, bare.enable_lora, bare.temperature, bare.n_samples) == (300, False, 0.0, 1)
    with pytest.raises(ConfigError, match="max_new_tokens 600 must be < max_model_len 512"):
        eval_rollout_config(EvalConfig(max_new_tokens=600), "vllm", model, None)
    with pytest.raises(
        ConfigError, match="max_model_len 1024 is longer than the model's max_position_embeddings 512"
    ):
        eval_rollout_config(EvalConfig(), "vllm", model, None, ["max_model_len=1024"])
    assert eval_rollout_config(EvalConfig(max_new_tokens=300), "vllm", model, None, ["max_model_len=400"])
    assert [vllm_lora_rank(r) for r in (1, 2, 8, 9, 32, 300, 512)] == [1, 8, 8, 16, 32, 320, 512]
    with pytest.raises(ValueError, match="exceeds vLLM's largest"):
        vllm_lora_rank(513)
    with pytest.raises(ConfigError, match="rollout.logprobs is false"):
        from qerl.pipeline.planning.run_config import load_run_config

        load_run_config(None, ["rollout.logprobs=false"])


def test_eval_benchmarks_read_the_runs_data_root(tmp_path, monkeypatch):
    """``data.root`` reached only the training data: a named eval benchmark without a root of its own
    went to $QERL_DATA_DIR or the hub. It is now derived into each named benchmark that has none; the
    environment variable needs nothing derived, every load without a root reads it."""
    import json

    from qerl.pipeline.data.datasets import load_problems
    from qerl.pipeline.planning.run_config import RunConfig

    monkeypatch.delenv("QERL_DATA_DIR", raising=False)
    shared, own = tmp_path / "shared", tmp_path / "own"
    for root, n in ((shared, 3), (own, 2)):
        (root / "gsm8k").mkdir(parents=True)
        rows = [{"question": f"{i} + 1?", "answer": f"#### {i + 1}"} for i in range(n)]
        (root / "gsm8k" / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = RunConfig.model_validate(
        {
            "data": {"root": str(shared)},
            "eval": {
                "benchmark": {"dataset": "gsm8k", "limit": 2},
                "also": [{"dataset": "gsm8k", "root": str(own)}, {"dataset": "arithmetic", "levels": [1]}],
            },
        }
    )
    bench, (mine, arith) = cfg.eval.benchmark, cfg.eval.also
    assert (bench.root, bench.limit, bench.split) == (str(shared), 2, "test")  # the rest untouched
    assert mine.root == str(own) and arith.root is None and arith.levels == [1]
    assert len(load_problems(bench)) == 2 and len(load_problems(mine)) == 2
    assert RunConfig.model_validate(cfg.model_dump(mode="json")) == cfg  # a resumed run's record
    assert RunConfig().eval.benchmark.root is None  # no data.root: nothing derived
    # $QERL_DATA_DIR instead of data.root: resolved when loading, for every benchmark without a root
    monkeypatch.setenv("QERL_DATA_DIR", str(shared))
    plain = RunConfig.model_validate({"eval": {"benchmark": {"dataset": "gsm8k"}}})
    assert plain.eval.benchmark.root is None and len(load_problems(plain.eval.benchmark)) == 3


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan"])
def test_non_finite_floats_are_rejected(value):
    with pytest.raises(
        ConfigError, match=r"inner\.lr: Input should be a finite number \(from --set inner\.lr="
    ):
        load_config(Outer, None, [f"inner.lr={value}"])


def test_a_bad_override_is_blamed_on_the_override_not_the_file(tmp_path):
    path = tmp_path / "preset.yaml"
    path.write_text("name: run1\n")
    with pytest.raises(ConfigError) as err:
        load_config(Outer, path, ["steps=many"])
    assert "steps: " in str(err.value) and "(from --set steps=many)" in str(err.value)
    assert str(path) not in str(err.value)
    path.write_text("steps: many\n")
    with pytest.raises(ConfigError, match=rf"steps: .*\(from {path}\)"):
        load_config(Outer, path, ["name=x"])


def test_a_section_override_is_named_with_its_section(tmp_path):
    """`qerl eval --set quantize.X` / `--set rollout.X` load one section's config alone: its errors
    still name the key as the user wrote it."""
    import json

    from qerl.pipeline.evaluation.eval_config import EvalConfig
    from qerl.pipeline.nvfp4.recipe import QuantizeConfig
    from qerl.pipeline.planning.engine_setup import eval_rollout_config

    with pytest.raises(ConfigError, match=r"unknown config key 'quantize\.methd'; valid keys here: .*method"):
        load_config(QuantizeConfig, None, ["methd=gptq"], prefix="quantize")
    with pytest.raises(ConfigError, match=r"quantize\.method: .*\(from --set quantize\.method=fast\)"):
        load_config(QuantizeConfig, None, ["method=fast"], prefix="quantize")
    with pytest.raises(ConfigError, match=r"unknown config key 'quantize\.calibration\.sorce'"):
        load_config(QuantizeConfig, None, ["calibration.sorce=gsm8k"], prefix="quantize")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 512}))
    with pytest.raises(ConfigError, match=r"unknown config key 'rollout\.temprature'"):
        eval_rollout_config(EvalConfig(), "hf", model, None, ["temprature=0.5"])
    with pytest.raises(
        ConfigError, match=r"rollout\.max_model_len: .*\(from --set rollout\.max_model_len=x\)"
    ):
        eval_rollout_config(EvalConfig(), "hf", model, None, ["max_model_len=x"])


def test_the_run_config_rejects_an_infinite_learning_rate():
    from qerl.pipeline.planning.run_config import load_run_config

    with pytest.raises(ConfigError, match=r"train\.lr: .*finite.*\(from --set train\.lr=\.inf\)"):
        load_run_config(None, ["train.lr=.inf"])
