"""Ablations: arms and seeds, the comparison statistics (hand-derived), the report, the unquantized
base (``quantize.scheme: none``), and ``qerl ablate`` end to end with its resumption."""

from __future__ import annotations

import json
import math
import signal
from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml
from qerl.pipeline.evaluation import arms as ablation_arms
from qerl.pipeline.evaluation import report as ablation_report
from qerl.pipeline.evaluation import statistics as stats


# ---- arms and seeds ------------------------------------------------------------------------------
def test_parse_arms_names_the_bad_input():
    assert ablation_arms.parse_arms("bf16-lora, nvfp4-aqn") == ["bf16-lora", "nvfp4-aqn"]
    with pytest.raises(ablation_arms.AblationError, match="unknown arm.*fp8"):
        ablation_arms.parse_arms("bf16-lora,fp8")
    with pytest.raises(ablation_arms.AblationError, match="distinct"):
        ablation_arms.parse_arms("nvfp4-aqn,nvfp4-aqn")
    with pytest.raises(ablation_arms.AblationError, match="at least two"):
        ablation_arms.parse_arms("nvfp4-aqn")


def test_an_arm_names_its_quantizer_and_aqn_objective():
    from typing import get_args

    from qerl.pipeline.planning.run_config import RunConfig
    from qerl.pipeline.rl.objective import GRPOConfig

    assert ablation_arms.AQN_OBJECTIVES == get_args(GRPOConfig.model_fields["aqn_objective"].annotation)

    over = ablation_arms.arm_overrides("nvfp4-aqn-gptq-on_policy")
    assert over["quantize"] == {"scheme": "nvfp4", "method": "gptq"}
    assert over["train"] == {"grpo": {"aqn_objective": "on_policy"}} and over["aqn"] == {"enabled": True}
    assert ablation_arms.arm_overrides("nvfp4-lora-mse")["quantize"]["method"] == "mse"
    assert ablation_arms.arm_overrides("nvfp4-lora") == ablation_arms.ARMS["nvfp4-lora"]  # user's method
    cfg = RunConfig.model_validate(
        ablation_arms.arm_config({"loop": {"name": "x"}}, "nvfp4-aqn-noisy_trainer", 0)
    )
    assert cfg.train.grpo.aqn_objective == "noisy_trainer" and cfg.loop.name == "x-nvfp4-aqn-noisy_trainer-s0"
    for bad, match in [
        ("bf16-lora-gptq", "'gptq' is not a variant of bf16-lora; its variants are none"),
        ("nvfp4-lora-on_policy", r"'on_policy' is not a variant of nvfp4-lora; its variants are \['rtn'"),
        ("nvfp4-aqn-gptq-rtn", "sets method twice"),
        ("nvfp4-aqn-gptq-on-policy", "'on' is not a variant"),
    ]:
        with pytest.raises(ablation_arms.AblationError, match=match):
            ablation_arms.parse_arms(f"bf16-lora,{bad}")


def test_arm_config_changes_only_the_arm_and_shifts_every_training_seed_alike():
    user = {
        "loop": {"name": "x", "seed": 5},
        "train": {"seed": 7},
        "aqn": {"num_stages": 3},
        "eval": {"seed": 9},
    }
    a = ablation_arms.arm_config(user, "bf16-lora", 1)
    b = ablation_arms.arm_config(user, "nvfp4-aqn", 1)
    assert user == {
        "loop": {"name": "x", "seed": 5},
        "train": {"seed": 7},
        "aqn": {"num_stages": 3},
        "eval": {"seed": 9},
    }
    assert a["quantize"] == {"scheme": "none"} and a["aqn"] == {"num_stages": 3, "enabled": False}
    assert b["quantize"] == {"scheme": "nvfp4"} and b["aqn"] == {"num_stages": 3, "enabled": True}
    for cfg in (a, b):  # replicate 1: every training seed + 1, the same in both arms; eval untouched
        assert (cfg["loop"]["seed"], cfg["rollout"]["seed"], cfg["train"]["seed"]) == (6, 1, 8)
        assert cfg["eval"] == {"seed": 9}
    assert a["loop"]["name"] == "x-bf16-lora-s1"
    assert {k: v for k, v in a.items() if k not in ("quantize", "aqn", "loop")} == {
        k: v for k, v in b.items() if k not in ("quantize", "aqn", "loop")
    }
    assert ablation_arms.ablation_id(user, ["a", "b"], 2) == ablation_arms.ablation_id(
        dict(user), ["a", "b"], 2
    )
    assert ablation_arms.ablation_id(user, ["a", "b"], 2) != ablation_arms.ablation_id(user, ["a", "b"], 3)


def test_a_seed_count_below_one_fails_before_prefect_starts(monkeypatch, capsys):
    """``qerl ablate --seeds 0`` used to start Prefect and fail late, in the flow's plan; the id the CLI
    computes first now checks the count."""
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ablation_arms.AblationError, match=r"--seeds must be a whole number >= 1"):
            ablation_arms.ablation_id({}, ["bf16-lora", "nvfp4-aqn"], bad)
    assert ablation_arms.check_seeds(2) == 2
    from qerl.flows import cli, orchestration

    def no_prefect(*args, **kwargs):
        raise AssertionError("a Prefect server was asked for")

    monkeypatch.setattr(orchestration, "prepare_environment", lambda work: None)  # no Prefect settings here
    monkeypatch.setattr(orchestration, "use_api", no_prefect)
    assert cli.main(["ablate", "--arms", "bf16-lora,nvfp4-aqn", "--seeds", "0"]) != 0
    assert "--seeds must be a whole number >= 1" in capsys.readouterr().err


# ---- statistics ----------------------------------------------------------------------------------
def test_t_interval_matches_hand_derived_values():
    # [1, 2, 3]: mean 2, sd 1, se 1/sqrt(3); t(0.975, 2) = 4.302653 -> half width 2.484138
    iv = stats.t_interval([1.0, 2.0, 3.0])
    assert iv.mean == pytest.approx(2.0)
    assert (iv.lo, iv.hi) == (pytest.approx(2 - 2.484138, abs=1e-5), pytest.approx(2 + 2.484138, abs=1e-5))
    # [0.5, 0.7]: sd 0.141421, se 0.1; t(0.975, 1) = 12.706205 -> half width 1.2706205
    iv = stats.t_interval([0.5, 0.7])
    assert (iv.lo, iv.hi) == (
        pytest.approx(0.6 - 1.2706205, abs=1e-6),
        pytest.approx(0.6 + 1.2706205, abs=1e-6),
    )
    one = stats.t_interval([0.4])
    assert one.mean == 0.4 and math.isnan(one.lo) and "no CI" in one.text()


def test_paired_bootstrap_matches_the_exact_distribution():
    # two items with differences 0.5 and -0.25: a resample's mean is 0.5 (p 1/4), 0.125 (1/2) or
    # -0.25 (1/4), so with 10000 resamples the 2.5% and 97.5% percentiles are exactly -0.25 and 0.5
    a, b = {"p": 1.0, "q": 0.25}, {"p": 0.5, "q": 0.5}
    res = stats.paired_bootstrap(a, b, ("x", "y"), n_boot=10_000, seed=3)
    assert res.diff == pytest.approx(0.125)
    assert (res.lo, res.hi) == (-0.25, 0.5)
    assert not res.significant and "x vs y: no significant difference" in res.verdict()
    assert stats.paired_bootstrap(a, b, ("x", "y"), n_boot=500, seed=1) == stats.paired_bootstrap(
        a, b, ("x", "y"), n_boot=500, seed=1
    )
    # the same difference on every item: the interval is that point, and it is significant
    same = stats.paired_bootstrap({"1": 0.75, "2": 0.5}, {"1": 0.5, "2": 0.25}, ("x", "y"), n_boot=200)
    assert (same.diff, same.lo, same.hi) == (0.25, 0.25, 0.25)
    assert same.significant and "x is better than y" in same.verdict()
    with pytest.raises(ablation_arms.AblationError, match="same items"):
        stats.paired_bootstrap({"1": 1.0}, {"2": 1.0})


def test_trainer_metrics_of_a_step_that_trained_nothing_are_left_out():
    history = [
        {"step": 0, "train_entropy": 0.0, "train_tokens_trained": 0, "reward_mean": 0.0},
        {"step": 1, "train_entropy": 2.0, "train_tokens_trained": 12, "reward_mean": 0.5},
        {"step": 2, "train_entropy": 1.0, "train_tokens_trained": 10, "reward_mean": float("nan")},
        {"step": 3, "train_entropy": 9.0, "train_tokens_trained": 10, "reward_mean": 1.0},
    ]
    assert ablation_report.step_values(history, ("train_entropy",)) == {1: 2.0, 2: 1.0, 3: 9.0}
    assert ablation_report.step_values(history, ("reward_mean",)) == {
        0: 0.0,
        1: 0.5,
        3: 1.0,
    }  # a 0 reward is a reward
    assert ablation_report.early_mean(history, ("train_entropy",), 3) == pytest.approx(
        1.5
    )  # steps 1, 2 of 0..2
    assert math.isnan(ablation_report.early_mean(history[:1], ("train_entropy",), 3))
    # two seeds: mean, min and max per step over the seeds that have the step
    curve = ablation_report.arm_curve(
        [history, [{"step": 1, "train_entropy": 4.0, "train_tokens_trained": 3}]], ("train_entropy",)
    )
    assert curve == [(1, 3.0, 2.0, 4.0), (2, 1.0, 1.0, 1.0), (3, 9.0, 9.0, 9.0)]


def test_steps_without_a_trained_token_are_null_and_the_report_counts_the_early_steps(tmp_path):
    """A step that trained no token records null entropy and mismatch (``qerl.pipeline.rl.step``), the run
    record keeps the null, the curves skip it, and the early-entropy comparison averages only the steps
    with a value, says how many per run, and leaves a run with none out of its arm's interval."""
    from types import SimpleNamespace

    from qerl.flows.report import step_entry

    def manifest(key: str, **metrics) -> SimpleNamespace:
        return SimpleNamespace(key=key, metrics=metrics)

    entry = step_entry(
        0, 0.0, manifest("r"), manifest("s", reward_mean=0.0),
        manifest("t", entropy=None, mismatch_kl=None, tokens_trained=0, loss=float("nan"), mode_note="x"),
    ).model_dump()  # fmt: skip
    assert entry["train_entropy"] is None and entry["train_mismatch_kl"] is None
    assert entry["train_tokens_trained"] == 0 and "train_mode_note" not in entry

    def run(entropies: list[float | None]) -> list[dict]:
        return [
            {
                "step": i,
                "reward_mean": 0.0,
                "train_entropy": e,
                "train_mismatch_kl": None if e is None else 1e-3,
            }
            for i, e in enumerate(entropies)
        ]

    items = {str(i): float(i % 2) for i in range(6)}
    arms = [
        ablation_report.ArmRuns("bf16-lora", ["a1", "a2"], [0.5, 0.5], [items, items], [run([1.0, 0.8, 0.6, 0.5])] * 2),
        ablation_report.ArmRuns(
            "nvfp4-aqn", ["b1", "b2", "b3"], [0.5] * 3, [items] * 3,
            [run([None, 1.2, None, 0.4]), run([None, None, None, 2.0]), run([1.0, 1.4, None, 0.4])],
        ),
    ]  # fmt: skip
    assert ablation_report.arm_curve(arms[1].histories, ablation_report.CURVES["mismatch_kl"])[0] == (
        0,
        1e-3,
        1e-3,
        1e-3,
    )
    assert [
        p[0] for p in ablation_report.arm_curve(arms[1].histories, ablation_report.CURVES["entropy"])
    ] == [0, 1, 3]
    result, report = ablation_report.write_report("abl-null", arms, tmp_path, n_boot=200)
    aqn = result["arms"]["nvfp4-aqn"]
    assert aqn["early_entropy_steps"] == [1, 0, 2]
    assert aqn["early_entropy"][0] == pytest.approx(1.2) and math.isnan(aqn["early_entropy"][1])
    assert aqn["early_entropy"][2] == pytest.approx(1.2)
    assert aqn["early_entropy_ci"].n == 2 and aqn["early_entropy_ci"].mean == pytest.approx(1.2)
    assert result["arms"]["bf16-lora"]["early_entropy_steps"] == [3, 3]
    text = report.read_text()
    assert "| 1.2000, n/a, 1.2000 | 1/3, 0/3, 2/3 |" in text and "| 3/3, 3/3 |" in text


def test_mean_items_averages_seeds_and_refuses_different_items():
    assert stats.mean_items([{"a": 1.0, "b": 0.0}, {"a": 0.5, "b": 0.5}]) == {"a": 0.75, "b": 0.25}
    with pytest.raises(ablation_arms.AblationError, match="different items"):
        stats.mean_items([{"a": 1.0}, {"b": 1.0}])


def _history(entropies: list[float], reward: float) -> list[dict]:
    return [
        {
            "step": i,
            "reward_mean": reward + 0.1 * i,
            "accuracy": reward,
            "train_entropy": e,
            "train_mismatch_kl": 1e-4,
        }
        for i, e in enumerate(entropies)
    ]


def test_report_from_hand_built_runs(tmp_path):
    items = {str(i): float(i % 2) for i in range(8)}
    arms = [
        ablation_report.ArmRuns("bf16-lora", ["r1", "r2"], [0.50, 0.60], [items, items], [_history([1.0, 0.9, 0.8, 0.5], 0.2)] * 2),
        ablation_report.ArmRuns(
            "nvfp4-aqn", ["r3", "r4"], [0.52, 0.58], [items, items],
            [_history([1.2, 1.1, 1.0, 0.5], 0.3), _history([1.4, 1.3, 1.2, 0.5], 0.3)],
        ),
    ]  # fmt: skip
    result, report = ablation_report.write_report("abl-test", arms, tmp_path, n_boot=300)
    # same items, same rates: zero difference, and the verdict says so
    (pair,) = result["pairs"]
    assert (pair.a, pair.b, pair.diff, pair.lo, pair.hi) == ("nvfp4-aqn", "bf16-lora", 0.0, 0.0, 0.0)
    text = report.read_text()
    assert "nvfp4-aqn vs bf16-lora: no significant difference" in text
    # early entropy: mean of the first 3 steps per run: bf16 0.9, 0.9; aqn 1.1 and 1.3
    assert result["arms"]["nvfp4-aqn"]["early_entropy"] == pytest.approx([1.1, 1.3])
    assert result["arms"]["bf16-lora"]["accuracy_ci"].mean == pytest.approx(0.55)
    for name in ("reward", "accuracy", "entropy", "mismatch_kl"):
        assert (tmp_path / "plots" / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"plots/{name}.png" in text
    rows = ablation_report.table_rows(result)
    assert rows[0]["arm"] == "bf16-lora" and rows[0]["seeds"] == 2
    # each arm's base, where its runs evaluated it (the same for every seed: printed once)
    assert "| bf16-lora | not evaluated | 0.550 " in text
    arms[1].base_accuracy = [0.25, 0.25]
    _, report = ablation_report.write_report("abl-test", arms, tmp_path, n_boot=300)
    assert "| nvfp4-aqn | 0.250 | 0.550 " in report.read_text()
    assert "before training" not in report.read_text()  # no run recorded its quantized base
    # each arm's quantized base, from the run records: its quantizer and what it cost before training
    arms[0].quantize = [{"method": None, "mode": "unquantized"}] * 2
    arms[1].quantize = [{}, {"method": "gptq", "quantize_kl": 0.0341, "quantize_top1": 0.9237,
                             "quantize_ppl_base": 4.432, "quantize_ppl_quant": 4.491}]  # fmt: skip
    _, report = ablation_report.write_report("abl-test", arms, tmp_path, n_boot=300)
    text = report.read_text()
    assert "| bf16-lora | none (the base itself) | 0 | 1 | |" in text
    assert "| nvfp4-aqn | gptq | 0.034 | 0.924 | 4.43 -> 4.49 |" in text


# ---- the unquantized base ------------------------------------------------------------------------
def test_scheme_none_is_the_base_in_the_twin_dtype_and_engines_serve_it(tiny_model_factory, tmp_path):
    from qerl.pipeline.nvfp4.recipe import UNQUANTIZED_MODE, QuantizeConfig
    from qerl.pipeline.nvfp4.safetensors_io import read_tensor, safetensors_index
    from qerl.pipeline.planning.engine_setup import needs_twin
    from qerl.pipeline.rollout.config import RolloutConfig
    from qerl.pipeline.rollout.factory import build_engine
    from qerl.pipeline.rollout.lazy import LazyEngine
    from qerl.pipeline.store.artifact_store import ArtifactStore
    from qerl.pipeline.store.manifest import ArtifactError
    from qerl.stages import dequantize, quantize

    src = tiny_model_factory(arch="qwen2", dtype=torch.float32)
    store = ArtifactStore(tmp_path / "store")
    cfg = QuantizeConfig(scheme="none", twin_dtype="bfloat16")
    man = quantize.run(cfg, src, store)
    assert man.mode == UNQUANTIZED_MODE and "quantization_config" not in json.loads(
        man.file("config.json").read_text()
    )
    before, after = safetensors_index(src), safetensors_index(man.dir)
    assert set(before) == set(after)
    for name, spec in before.items():
        assert after[name].dtype == "BF16"
        assert torch.equal(read_tensor(after[name]), read_tensor(spec).to(torch.bfloat16)), name
    assert quantize.run(cfg, src, store).key == man.key  # cached
    assert quantize.run(QuantizeConfig(), src, store).mode.startswith("nvfp4/")  # nvfp4 still the default
    with pytest.raises(ArtifactError, match="unquantized base"):
        dequantize.run(cfg, man, store)
    rollout = RolloutConfig(engine="hf", dtype="bfloat16", max_model_len=64, max_new_tokens=4)
    assert not needs_twin(rollout.engine, "none") and needs_twin(rollout.engine, "nvfp4")
    assert LazyEngine(rollout, man, None).mode == "hf-unquantized"
    vllm = rollout.model_copy(update={"engine": "vllm"})
    assert LazyEngine(vllm, man, None).mode == "vllm-unquantized"  # on CUDA too: no NVFP4 to load
    assert LazyEngine(vllm, None, None).mode != "vllm-unquantized"
    engine = build_engine(rollout, man, None)
    try:
        assert engine.mode == "hf-unquantized" and Path(engine.model_dir) == man.dir
    finally:
        engine.close()


# ---- qerl ablate end to end ----------------------------------------------------------------------
def tiny_ablation_config(model: Path, tmp_path: Path) -> Path:
    """The CI-sized ablation config (2 steps, 8 eval items) on the learner model, written as YAML;
    its path."""
    from learning import learning_run_config

    cfg = learning_run_config(model, engine="hf")
    cfg["loop"].update(steps=2)
    cfg["eval"]["benchmark"]["arithmetic_size"] = 8
    path = tmp_path / "ablate.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.slow
def test_ablate_two_arms_two_seeds_killed_and_resumed_builds_no_stage_twice(learner_model_dir, tmp_path):
    from learning import _object, assert_trained

    from tests.flows.test_flow import _journal, _qerl

    path = tiny_ablation_config(learner_model_dir, tmp_path)
    work = tmp_path / "work"
    args = [
        "ablate",
        "--config",
        str(path),
        "--arms",
        "qlora,nvfp4-aqn",
        "--seeds",
        "2",
        "--bootstrap",
        "500",
    ]
    # killed inside the third run's second train step (the 6th train build), then the same command again
    killed = _qerl(args, work, fault="train:6")
    assert killed.returncode == -signal.SIGKILL, (killed.returncode, killed.stderr[-3000:])
    (record_path,) = (work / "ablations").glob("*/ablation.json")
    parent = json.loads(record_path.read_text())["parent_run_id"]
    proc = _qerl(args, work)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    record = json.loads(record_path.read_text())
    assert record["status"] == "completed", record.get("error")
    assert record["parent_run_id"] == parent  # one MLflow parent across the kill
    runs = {r["run_id"]: r for r in record["runs"]}
    assert len(runs) == 4 and {r["arm"] for r in runs.values()} == {"qlora", "nvfp4-aqn"}
    for run_id, r in runs.items():
        rec = json.loads((work / "runs" / run_id / "run.json").read_text())
        assert rec["status"] == "completed" and rec["ablation"]["arm"] == r["arm"]
        assert rec["engine_mode"] == ("hf-nf4-emulated" if r["arm"] == "qlora" else "hf-nvfp4-emulated")
        assert rec["registration"]["promoted"] is False
        assert all("train_mismatch_kl" in s for s in rec["steps"])
        assert_trained(work, rec)  # every arm and seed learned: the comparison compares something
        train = json.loads(
            (_object(work, "train", rec["steps"][-1]["manifests"]["train"]) / "manifest.json").read_text()
        )
        assert train["mode"] == (
            "nf4-bitsandbytes-float32" if r["arm"] == "qlora" else "nvfp4-torch-reference"
        )
        assert rec["quantize"]["quantize_kl"] > 0  # each 4-bit base's cost, measured before training
    report = (record_path.parent / "report.md").read_text()
    assert "## Verdict" in report and "qlora" in report
    assert "| qlora | nf4 (bitsandbytes) | 0." in report and "| nvfp4-aqn | rtn | 0." in report
    assert (record_path.parent / "plots" / "reward.png").is_file()
    # tokens were trained, so the report compares the arms' entropy rather than saying there is none
    assert "n/a (no step trained a token)" not in report
    assert (record_path.parent / "plots" / "entropy.png").is_file()
    _assert_registry(work, record, runs)
    built = Counter((e["stage"], e["key"]) for e in _journal(work))
    assert max(built.values()) == 1, [k for k, n in built.items() if n > 1]  # the resume rebuilt nothing
    assert Counter(s for s, _ in built)["train"] == 8 and Counter(s for s, _ in built)["register"] == 4


def _assert_registry(work: Path, record: dict, runs: dict) -> None:
    """Every run registered with arm and ablation tags, as a child of the parent; no alias set."""
    import mlflow
    from mlflow import MlflowClient

    uri = f"sqlite:///{work / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)  # an earlier test's registry URI may linger
    versions = client.search_model_versions("name='qerl-adapter'")
    assert len(versions) == 4
    assert {v.tags["arm"] for v in versions} == {"qlora", "nvfp4-aqn"}
    assert {v.tags["ablation_id"] for v in versions} == {record["id"]}
    assert not any(v.aliases for v in versions)
    children = {client.get_run(v.run_id).data.tags.get("mlflow.parentRunId") for v in versions}
    assert children == {record["parent_run_id"]}
    assert client.get_run(record["parent_run_id"]).info.status == "FINISHED"


def test_an_ablation_run_is_registered_as_a_child_and_never_moves_an_alias(tmp_path):
    from qerl.pipeline.registry import promotion
    from qerl.pipeline.registry import tracking as reg
    from qerl.pipeline.store.artifact_store import ArtifactStore
    from qerl.stages import register

    from tests.stages.test_register import HISTORY, LINEAGE, fake_eval, fake_train

    store, cfg = ArtifactStore(tmp_path / "store"), reg.RegistryConfig(model_name="abl-adapter")
    register.run(
        cfg, fake_train(store, "champ"), fake_eval(store, 0.5), LINEAGE, HISTORY, tmp_path, True, store
    )
    parent = reg.start_run(cfg, run_name="abl-x")  # the tracking store the register stage opened
    lineage = {**LINEAGE, "ablation_id": "abl-x", "arm": "nvfp4-aqn"}
    better = register.run(
        cfg, fake_train(store, "abl"), fake_eval(store, 0.9), lineage, HISTORY, tmp_path, True, store,
        promote=False, run_tags={"mlflow.parentRunId": parent},
    )  # fmt: skip
    record = json.loads(better.file("registration.json").read_text())
    assert (record["version"], record["promoted"], record["aliases"]) == ("2", False, [])
    assert str(promotion.alias_version(cfg, "champion").version) == "1"
    assert str(promotion.alias_version(cfg, "challenger").version) == "1"
    info = promotion.version_info(cfg, "2")
    assert (info["tags"]["arm"], info["tags"]["ablation_id"]) == ("nvfp4-aqn", "abl-x")
    assert "ablation" in info["tags"]["promotion"]
    assert reg.MlflowClient().get_run(record["run_id"]).data.tags["mlflow.parentRunId"] == parent
    # the same adapter registered by an ordinary run would have been promoted: the keyword is what holds it
    ordinary = register.run(
        cfg, fake_train(store, "ord"), fake_eval(store, 0.9), LINEAGE, HISTORY, tmp_path, True, store
    )
    assert ordinary.metrics["promoted"]
