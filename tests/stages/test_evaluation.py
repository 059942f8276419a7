"""Evaluation statistics against independent references, and the evaluate stage's bookkeeping."""

from __future__ import annotations

import itertools
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from qerl.pipeline.config import ConfigError, apply_overrides
from qerl.pipeline.data.datasets import DataConfig, load_problems
from qerl.pipeline.data.rewards import RewardConfig
from qerl.pipeline.evaluation import eval_config, statistics
from qerl.pipeline.rollout.protocol import Completion, RolloutEngine, SamplingSpec
from qerl.pipeline.store.artifact_store import ArtifactStore
from qerl.pipeline.store.manifest import BuildResult


# ---- statistics --------------------------------------------------------------------------------
def test_avg_at_k_and_stderr_match_numpy():
    rng = np.random.default_rng(0)
    matrix = rng.random((37, 4)) < rng.random((37, 1))  # items of varying difficulty
    rows = matrix.tolist()
    assert statistics.avg_at_k(rows) == pytest.approx(matrix.mean())
    rates = matrix.mean(axis=1)
    assert statistics.item_rates(rows) == pytest.approx(rates.tolist())
    assert statistics.stderr(rates.tolist()) == pytest.approx(rates.std(ddof=1) / math.sqrt(len(rates)))
    s = statistics.summarize(rows)
    assert s["n_items"] == 37 and s["k"] == 4 and s["n_samples"] == 148
    assert s["n_correct"] == int(matrix.sum())
    lo, hi = s["ci95"]
    assert lo == pytest.approx(max(0, s["accuracy"] - 1.96 * s["stderr"]))
    assert hi == pytest.approx(min(1, s["accuracy"] + 1.96 * s["stderr"]))
    # pass@k with k = all samples is "any sample correct"
    assert s["pass@4"] == pytest.approx(matrix.any(axis=1).mean())
    assert statistics.stderr([0.5]) == 0.0
    assert statistics.confidence_interval(0.99, 0.1) == (pytest.approx(0.794), 1.0)


def test_pass_at_k_matches_enumeration():
    for n in range(1, 7):
        for c in range(n + 1):
            for k in range(1, n + 1):
                samples = [1] * c + [0] * (n - c)
                subsets = list(itertools.combinations(samples, k))
                brute = sum(any(s) for s in subsets) / len(subsets)
                assert statistics.pass_at_k(n, c, k) == pytest.approx(brute), (n, c, k)
    with pytest.raises(ValueError, match="pass@k"):
        statistics.pass_at_k(3, 4, 1)


def test_per_item_and_bad_input():
    items = statistics.per_item(["a", "b"], [[True, False], [True, True]])
    assert items == [
        {"id": "a", "n_samples": 2, "n_correct": 1, "rate": 0.5},
        {"id": "b", "n_samples": 2, "n_correct": 2, "rate": 1.0},
    ]
    with pytest.raises(ValueError, match="2 ids for 1 items"):
        statistics.per_item(["a", "b"], [[True]])
    with pytest.raises(ValueError, match="item 1 has no samples"):
        statistics.avg_at_k([[True], []])
    with pytest.raises(ValueError, match="no items"):
        statistics.avg_at_k([])


def test_eval_config():
    cfg = eval_config.EvalConfig()
    assert (cfg.k, cfg.temperature, cfg.top_p, cfg.benchmark.split) == (4, 0.6, 0.95, "test")
    assert (cfg.n_samples, cfg.sampling_temperature) == (4, 0.6)
    greedy = apply_overrides(cfg, ["greedy=true", "benchmark.dataset=gsm8k"])
    assert (greedy.n_samples, greedy.sampling_temperature, greedy.sampling_top_p) == (1, 0.0, 1.0)
    assert greedy.benchmark.dataset == "gsm8k"
    # a nested override keeps the evaluation defaults of the other benchmark fields
    from qerl.pipeline.config import load_config

    loaded = load_config(eval_config.EvalConfig, None, ["benchmark.limit=3"])
    assert (loaded.benchmark.split, loaded.benchmark.limit, loaded.benchmark.arithmetic_size) == (
        "test",
        3,
        100,
    )
    with pytest.raises(ConfigError, match="valid keys here"):
        apply_overrides(cfg, ["benchmark.nope=1"])
    with pytest.raises(ConfigError, match="greedy"):
        apply_overrides(cfg, ["temperature=0"])
    assert eval_config.benchmark_id(DataConfig(dataset="/x/y/aime24.jsonl", split="test"), "ab" * 32) == (
        "aime24/test@" + "ab" * 6
    )
    # a publisher's file named by split (was "test/test@..."): the folder names the dataset
    assert eval_config.benchmark_id(DataConfig(dataset="/d/gsm8k/test.jsonl", split="test"), "cd" * 32) == (
        "gsm8k/test@" + "cd" * 6
    )
    assert (
        eval_config.benchmark_id(DataConfig(dataset="amc23", split="test"), "ef" * 32)
        == "amc23/test@" + "ef" * 6
    )


# ---- the stage with a test double of the engine -------------------------------------------------
class FakeEngine:
    """Implements the RolloutEngine protocol; answers item i correctly on samples j < i % (n+1)."""

    mode = "fake-test-double"

    def __init__(self, answers: dict[str, str], tokenizer):
        self.info: dict = {}
        self.tokenizer = tokenizer
        self.answers = answers  # question text -> gold
        self.calls: list[tuple] = []

    def set_adapter(self, path, digest):
        self.calls.append(("adapter", path, digest))

    def set_noise(self, sigma, seed):
        self.calls.append(("noise", sigma, seed))

    def generate(self, prompts, n, sampling, seed):
        self.calls.append(("generate", len(prompts), n, sampling, seed))
        out = []
        for i, prompt in enumerate(prompts):
            gold = next(a for q, a in self.answers.items() if q in prompt)
            group = []
            for j in range(n):
                text = f"so <answer>{gold}</answer>" if j < i % (n + 1) else "so <answer>-12345</answer>"
                group.append(Completion([1, 2], [3, 4, 5], text, [-0.1] * 3, "stop" if j else "length"))
            out.append(group)
        return out

    def close(self):
        pass


def tokenizer_base(tiny_model_dir: Path, store_dir: Path):
    """A store with a "quantize" artifact that holds the tiny model's tokenizer and config, no weights
    (the fake engines generate without them); returns (store, manifest, tokenizer)."""
    from transformers import AutoTokenizer

    store = ArtifactStore(store_dir)

    def build(tmp: Path) -> BuildResult:
        for f in tiny_model_dir.iterdir():
            if f.is_file() and not f.name.endswith(".safetensors"):
                shutil.copy(f, tmp / f.name)
        return BuildResult(mode="test-base")

    manifest, _ = store.produce("quantize", {"test": 1}, {}, "code", build)
    return store, manifest, AutoTokenizer.from_pretrained(manifest.dir)


@pytest.fixture
def base(tiny_model_dir, tmp_path):
    return tokenizer_base(tiny_model_dir, tmp_path / "store")


def test_evaluate_stage(base, tmp_path):
    from qerl.stages import evaluate

    store, base_manifest, tokenizer = base
    cfg = apply_overrides(eval_config.EvalConfig(), ["benchmark.limit=6", "k=3"])
    problems = load_problems(cfg.benchmark)
    engine = FakeEngine({p["question"]: p["answer"] for p in problems}, tokenizer)
    assert isinstance(engine, RolloutEngine)
    adapter = tmp_path / "adapter"
    manifest = evaluate.run(cfg, base_manifest, adapter, "digest-a", store, engine, RewardConfig(workers=1))

    assert ("noise", 0.0, 0) in engine.calls and ("adapter", adapter, "digest-a") in engine.calls
    gen = next(c for c in engine.calls if c[0] == "generate")
    assert gen[1:3] == (6, 3) and gen[3] == SamplingSpec(
        temperature=0.6, top_p=0.95, max_new_tokens=256, logprobs=False
    )

    # independent expectation: item i has min(i % 4, 3) of 3 samples correct
    expected = [min(i % 4, 3) / 3 for i in range(6)]
    summary = json.loads(manifest.file("summary.json").read_text())
    assert summary["accuracy"] == pytest.approx(sum(expected) / 6)
    assert summary["stderr"] == pytest.approx(np.std(expected, ddof=1) / math.sqrt(6))
    assert summary["n_items"] == 6 and summary["k"] == 3 and summary["adapter_digest"] == "digest-a"
    assert summary["benchmark"].startswith("arithmetic/test@")
    assert summary["truncated_fraction"] == pytest.approx(1 / 3)
    assert manifest.metrics["accuracy"] == summary["accuracy"] and manifest.mode == "fake-test-double"

    rows = pq.read_table(manifest.file("results.parquet")).to_pylist()
    assert len(rows) == 18
    by_item = {}
    for r in rows:
        by_item.setdefault(r["id"], []).append(r["correct"])
        assert r["extracted"] == (r["answer"] if r["correct"] else "-12345")
    assert [sum(v) / 3 for v in by_item.values()] == pytest.approx(expected)
    assert {r["id"] for r in rows} == {p["id"] for p in problems}
    items = pq.read_table(manifest.file("items.parquet")).to_pylist()
    assert [i["rate"] for i in items] == pytest.approx(expected)

    # cached: the engine is not asked again; another adapter is a new evaluation
    n_calls = len(engine.calls)
    again = evaluate.run(cfg, base_manifest, adapter, "digest-a", store, engine, RewardConfig(workers=1))
    assert again.key == manifest.key and len(engine.calls) == n_calls
    greedy = apply_overrides(cfg, ["greedy=true"])
    other = evaluate.run(greedy, base_manifest, None, None, store, engine, RewardConfig(workers=1))
    assert other.key != manifest.key and ("adapter", None, None) in engine.calls
    assert json.loads(other.file("summary.json").read_text())["k"] == 1
    assert engine.calls[-1][3].temperature == 0.0

    with pytest.raises(ValueError, match="together"):
        evaluate.run(cfg, base_manifest, adapter, None, store, engine, RewardConfig(workers=1))


def test_evaluate_also_reports_further_benchmarks(base, tmp_path):
    """eval.also: a second benchmark (a local GSM8K-layout file) is scored and reported beside the main
    one, whose accuracy alone stays the artifact's."""
    from qerl.stages import evaluate

    store, base_manifest, tokenizer = base
    (tmp_path / "gsm8k").mkdir()
    rows = [
        {"question": f"Ann has {i} pens. How many?", "answer": f"She has {i}.\n#### {i}"} for i in range(4)
    ]
    (tmp_path / "gsm8k" / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = apply_overrides(
        eval_config.EvalConfig(),
        {"benchmark": {"limit": 3}, "k": 2, "also": [{"dataset": "gsm8k", "root": str(tmp_path)}]},
    )
    problems = load_problems(cfg.benchmark) + load_problems(cfg.also[0])
    engine = FakeEngine({p["question"]: p["answer"] for p in problems}, tokenizer)
    manifest = evaluate.run(cfg, base_manifest, None, None, store, engine, RewardConfig(workers=1))
    summary = json.loads(manifest.file("summary.json").read_text())
    main = [min(i % 3, 2) / 2 for i in range(3)]  # FakeEngine: item i right on samples j < i % (n+1)
    assert summary["accuracy"] == pytest.approx(sum(main) / 3) and summary["benchmark"].startswith(
        "arithmetic/"
    )
    (other,) = summary["also"]
    assert other["benchmark"].startswith("gsm8k/test@") and other["n_items"] == 4
    assert other["accuracy"] == pytest.approx(sum(min(i % 3, 2) / 2 for i in range(4)) / 4)
    assert manifest.metrics["accuracy_gsm8k_test"] == other["accuracy"]
    assert manifest.metrics["accuracy"] == summary["accuracy"]
    assert len(pq.read_table(manifest.file("also/gsm8k-test/results.parquet"))) == 8

    # the run record's entry (issue 11): benchmark id, accuracy +- stderr, items, k and the also benchmarks
    from qerl.flows import report
    from qerl.pipeline.store.run_record import RunRecord

    typed = report.evaluation_entry(3, None, manifest)
    entry = typed.model_dump(exclude_none=True)
    assert entry["benchmark"] == summary["benchmark"] and entry["benchmark"].startswith("arithmetic/test@")
    assert entry["accuracy"] == summary["accuracy"] and entry["n_items"] == 3 and entry["k"] == 2
    rates = pq.read_table(manifest.file("items.parquet")).column("rate").to_pylist()
    assert entry["stderr"] == pytest.approx(np.std(rates, ddof=1) / math.sqrt(3)) and entry["stderr"] > 0
    assert entry["also"] == [
        {"benchmark": other["benchmark"], "name": "gsm8k_test", "accuracy": other["accuracy"],
         "stderr": other["stderr"], "n_items": 4}
    ]  # fmt: skip
    json.dumps(entry, allow_nan=False)  # plain JSON in run.json
    text = report.eval_text(typed)
    assert text.startswith(
        f"accuracy {entry['accuracy']:.3f} ± {entry['stderr']:.3f} ({entry['benchmark']}, 3 items)"
    )
    assert f"; gsm8k_test {other['accuracy']:.3f} ± {other['stderr']:.3f}" in text
    row = report.table_row(typed)
    assert row["gsm8k_test_accuracy"] == other["accuracy"] and "also" not in row and "manifest" not in row
    markdown = report.summary_markdown(RunRecord(run_id="r", status="completed", evaluations=[typed]))
    assert f"{entry['accuracy']:.3f} ± {entry['stderr']:.3f}" in markdown and "gsm8k_test" in markdown


def test_evaluate_drops_items_longer_than_the_context_and_counts_them(base, tmp_path):
    """An item whose prompt leaves less than eval.max_new_tokens of the engine's context is dropped and
    counted, as a training prompt is; the benchmark id names the items evaluated."""
    from qerl.stages import evaluate

    store, base_manifest, tokenizer = base
    (tmp_path / "gsm8k").mkdir()
    rows = [{"question": f"Ann has {i} pens. How many?", "answer": f"#### {i}"} for i in range(3)]
    rows.append(
        {"question": "Ann has 7 pens. " + "Bob has more pens. " * 60 + "How many?", "answer": "#### 7"}
    )
    (tmp_path / "gsm8k" / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = apply_overrides(
        eval_config.EvalConfig(),
        {
            "benchmark": {"dataset": "gsm8k", "root": str(tmp_path)},
            "k": 1,
            "greedy": True,
            "max_new_tokens": 64,
        },  # fmt: skip
    )
    problems = load_problems(cfg.benchmark)
    engine = FakeEngine({p["question"]: p["answer"] for p in problems}, tokenizer)
    manifest = evaluate.run(
        cfg, base_manifest, None, None, store, engine, RewardConfig(workers=1), max_model_len=256
    )
    summary = json.loads(manifest.file("summary.json").read_text())
    assert summary["n_items"] == 3 and [c[1] for c in engine.calls if c[0] == "generate"] == [3]
    prompts = summary["prompts"]
    assert (prompts["loaded"], prompts["kept"], prompts["dropped_too_long"]) == (4, 3, 1)
    assert prompts["prompt_token_limit"] == 256 - 64 and prompts["dropped_examples"][0]["tokens"] > 192
    from qerl.flows import report

    assert report.evaluation_entry(1, None, manifest).dropped_too_long == 1
    # a context that holds every item evaluates all four
    whole = evaluate.run(
        cfg, base_manifest, None, None, store, engine, RewardConfig(workers=1), max_model_len=2048
    )
    assert whole.metrics["n_items"] == 4 and whole.extra["benchmark"] != manifest.extra["benchmark"]


def test_evaluate_rejects_short_engine_output(base):
    from qerl.stages import evaluate

    store, base_manifest, tokenizer = base
    cfg = apply_overrides(eval_config.EvalConfig(), ["benchmark.limit=2", "k=2"])

    class Short(FakeEngine):
        def generate(self, prompts, n, sampling, seed):
            return super().generate(prompts, n, sampling, seed)[:1]

    problems = load_problems(cfg.benchmark)
    with pytest.raises(RuntimeError, match="1 groups for 2 prompts"):
        evaluate.run(
            cfg,
            base_manifest,
            None,
            None,
            store,
            Short({p["question"]: p["answer"] for p in problems}, tokenizer),
            RewardConfig(),
        )


def test_evaluate_reports_progress_over_chunks(base, monkeypatch):
    """A long evaluation generates in chunks and reports the items done after each (the console's
    progress line); each chunk after the first samples with a seed of its own."""
    from qerl.stages import evaluate

    monkeypatch.setattr(evaluate, "MIN_CHUNK_SEQUENCES", 8)  # 20 items x k=2: chunks of 4 items
    store, base_manifest, tokenizer = base
    cfg = apply_overrides(eval_config.EvalConfig(), ["benchmark.limit=20", "k=2"])
    problems = load_problems(cfg.benchmark)
    engine = FakeEngine({p["question"]: p["answer"] for p in problems}, tokenizer)
    seen: list[tuple[int, int]] = []

    def evaluate_it():
        reward = RewardConfig(workers=1)
        return evaluate.run(
            cfg, base_manifest, None, None, store, engine, reward, progress=lambda *a: seen.append(a)
        )

    manifest = evaluate_it()
    assert seen == [(4, 20), (8, 20), (12, 20), (16, 20), (20, 20)]
    gens = [c for c in engine.calls if c[0] == "generate"]
    assert [g[1] for g in gens] == [4] * 5 and gens[0][4] == cfg.seed
    assert len({g[4] for g in gens}) == 5  # no two chunks share a sample seed
    rows = pq.read_table(manifest.file("results.parquet")).to_pylist()
    assert [r["id"] for r in rows[::2]] == [p["id"] for p in problems] and len(rows) == 40

    seen.clear()  # a cached evaluation generates nothing and reports nothing
    evaluate_it()
    assert seen == []


@pytest.mark.slow
def test_cli_eval_end_to_end(tiny_model_dir, tmp_path, capsys):
    """``qerl quantize`` then ``qerl eval`` on the tiny model with the transformers engine."""
    from qerl.flows.cli import main

    work, ckpt = tmp_path / "work", tmp_path / "ckpt"
    assert main(["quantize", str(tiny_model_dir), "--out", str(ckpt), "--work-dir", str(work)]) == 0
    argv = ["eval", "--base", str(ckpt), "--adapter", "none", "--benchmark", "arithmetic", "--engine", "hf",
            "--work-dir", str(work), "--set", "greedy=true", "--set", "benchmark.limit=3",
            "--set", "max_new_tokens=8"]  # fmt: skip
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (
        summary["n_items"] == 3 and summary["k"] == 1 and summary["benchmark"].startswith("arithmetic/test@")
    )
    assert 0.0 <= summary["accuracy"] <= 1.0
    [manifest_dir] = (work / "store" / "objects" / "evaluate").iterdir()
    rows = pq.read_table(manifest_dir / "results.parquet").to_pylist()
    assert len(rows) == 3 and all(r["completion_tokens"] <= 8 for r in rows)
    assert json.loads((manifest_dir / "manifest.json").read_text())["mode"] == "hf-nvfp4-emulated"

    # a benchmark that cannot be read fails before the base is quantized or an engine is built
    fresh, missing = tmp_path / "fresh-work", tmp_path / "missing.jsonl"
    argv = ["eval", "--base", str(tiny_model_dir), "--adapter", "none", "--benchmark", str(missing),
            "--engine", "hf", "--work-dir", str(fresh)]  # fmt: skip
    assert main(argv) == 2
    assert str(missing) in capsys.readouterr().err and not (fresh / "store" / "objects").exists()


@pytest.mark.slow
def test_cli_eval_on_the_default_vllm_engine(tiny_model_dir, tmp_path, capsys):
    """``qerl eval`` with its default engine (vLLM) and sampling (T 0.6, top_p 0.95) and an adapter.

    vLLM cannot record un-renormalised logprobs under T != 1 with top-p, and the engine used to demand
    an exact logprob mode even though evaluation records none, so this command always failed.
    """
    from qerl.flows.cli import main

    from tests.pipeline.test_engines import make_adapter

    work, ckpt = tmp_path / "work", tmp_path / "ckpt"
    assert main(["quantize", str(tiny_model_dir), "--out", str(ckpt), "--work-dir", str(work)]) == 0
    adapter = make_adapter(tiny_model_dir, tmp_path / "adapter", rank=12)  # vLLM's LoRA slot: 16
    argv = ["eval", "--base", str(ckpt), "--adapter", str(adapter), "--benchmark", "arithmetic",
            "--work-dir", str(work), "--set", "k=2", "--set", "benchmark.limit=3", "--set", "max_new_tokens=8",
            "--set", "rollout.in_process=true", "--set", "rollout.enforce_eager=true",
            "--set", "rollout.kv_cache_gib=0.25"]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["n_items"] == 3 and summary["k"] == 2
    [manifest_dir] = (work / "store" / "objects" / "evaluate").iterdir()
    manifest = json.loads((manifest_dir / "manifest.json").read_text())
    assert manifest["mode"] == "vllm-nvfp4-emulated"
    saved = json.loads((manifest_dir / "summary.json").read_text())
    assert saved["sampling"] == {"temperature": 0.6, "top_p": 0.95, "greedy": False}
    rows = pq.read_table(manifest_dir / "results.parquet").to_pylist()
    assert len(rows) == 6 and all(r["completion_tokens"] <= 8 for r in rows)


def test_cli_eval_refuses_an_adapter_of_another_base(tiny_model_dir, tiny_model_factory, tmp_path, capsys):
    """An adapter trained on a smaller model (hidden 64, 2 layers) on the tiny base (hidden 128): refused
    before any engine starts, naming the mismatch; an adapter of the base itself passes the check."""
    from qerl.flows.cli import main
    from qerl.pipeline.rollout.adapter_fit import adapter_mismatches, check_adapter_fits
    from qerl.pipeline.rollout.protocol import EngineError

    from tests.pipeline.test_engines import make_adapter

    other = tiny_model_factory(hidden_size=64, num_layers=2, intermediate_size=128)
    wrong = make_adapter(other, tmp_path / "wrong", rank=8)
    right = make_adapter(tiny_model_dir, tmp_path / "right", rank=8)
    work, ckpt = tmp_path / "work", tmp_path / "ckpt"
    assert main(["quantize", str(tiny_model_dir), "--out", str(ckpt), "--work-dir", str(work)]) == 0
    assert adapter_mismatches(right, ckpt) == [] and adapter_mismatches(right, tiny_model_dir) == []
    problems = adapter_mismatches(wrong, ckpt)
    assert "model.layers.0.self_attn.q_proj.lora_A: 64 inputs, the base's linear has 128" in problems
    with pytest.raises(EngineError, match="was not trained for the base"):
        check_adapter_fits(wrong, tiny_model_dir)
    # an adapter of a shallower model of the same width fits every shape it has, and misses layers
    shallow = make_adapter(tiny_model_factory(num_layers=1), tmp_path / "shallow", rank=8)
    missing = adapter_mismatches(shallow, ckpt)
    assert missing and all("has no LoRA pair" in p and ".layers.0." not in p for p in missing), missing
    assert any(
        p.startswith("model.layers.1.self_attn.q_proj: the base's linear has no LoRA pair") for p in missing
    )
    capsys.readouterr()
    argv = ["eval", "--base", str(ckpt), "--adapter", str(wrong), "--benchmark", "arithmetic", "--engine", "hf",
            "--work-dir", str(work), "--set", "benchmark.limit=2"]  # fmt: skip
    assert main(argv) == 2  # the CLI's exit status for a refused input
    err = capsys.readouterr().err
    assert "was not trained for the base" in err and "lora_A: 64 inputs" in err
    assert not (work / "store" / "objects" / "evaluate").exists()


def test_eval_quantizes_a_plain_base_with_the_recipe_it_is_given(tiny_model_dir, tmp_path, capsys):
    """``qerl eval --set quantize.method=mse`` on an HF model dir evaluates that recipe's checkpoint; on a
    checkpoint that is quantized already the recipe is refused, naming it, before anything runs."""
    from qerl.flows.cli import main
    from qerl.pipeline.nvfp4.recipe import QuantizeConfig
    from qerl.pipeline.store.artifact_store import ArtifactStore
    from qerl.pipeline.store.manifest import ArtifactError
    from qerl.stages.base import base_artifacts

    store = ArtifactStore(tmp_path / "store")
    mse, _ = base_artifacts(tiny_model_dir, store, need_twin=False, recipe=QuantizeConfig(method="mse"))
    rtn, _ = base_artifacts(tiny_model_dir, store, need_twin=False)
    assert (mse.config["method"], rtn.config.get("method", "rtn")) == ("mse", "rtn") and mse.key != rtn.key
    with pytest.raises(
        ArtifactError, match=r"is a quantized checkpoint \(method mse\); quantize\.\* settings"
    ):
        base_artifacts(mse.dir, store, need_twin=False, recipe=QuantizeConfig(method="gptq"))
    argv = ["eval", "--base", str(mse.dir), "--adapter", "none", "--engine", "hf", "--work-dir", str(tmp_path),
            "--set", "quantize.method=gptq", "--set", "benchmark.limit=1"]  # fmt: skip
    assert main(argv) == 2
    assert "quantize.* settings apply to a model to quantize" in capsys.readouterr().err
    assert not (tmp_path / "store" / "objects" / "evaluate").exists()


def test_eval_base_may_be_a_stored_model_directory(tiny_model_dir, tmp_path, capsys):
    """``qerl eval --base smollm2-135m-instruct`` resolves to the catalogue model's ``fetch-model``
    artifact, a HF directory with a store manifest beside its files: it is quantized like any model
    directory (it used to be refused as "not a 'quantize' checkpoint"). An artifact that is no model
    is refused, naming its stage."""
    from qerl.flows.cli import main
    from qerl.pipeline.store.manifest import ArtifactError
    from qerl.stages import fetch_model, quantize
    from qerl.stages.base import base_artifacts

    store = ArtifactStore(tmp_path / "store")

    def copy_model(tmp: Path) -> BuildResult:
        for f in tiny_model_dir.iterdir():
            shutil.copy2(f, tmp / f.name)
        return BuildResult(mode="test")

    fetched, _ = store.produce(fetch_model.STAGE, {"model": "tiny"}, {}, "code", copy_model)
    quantized, twin = base_artifacts(fetched.dir, store, need_twin=False)
    assert twin is None and quantized.stage == quantize.STAGE
    assert quantized.key == quantize.run(quantize.QuantizeConfig(), fetched.dir, store).key
    argv = ["eval", "--base", str(fetched.dir), "--adapter", "none", "--engine", "hf", "--work-dir", str(tmp_path),
            "--set", "greedy=true", "--set", "benchmark.limit=1", "--set", "max_new_tokens=4"]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err

    other, _ = store.produce("train", {"tag": "x"}, {}, "code", lambda tmp: BuildResult(mode="test"))
    with pytest.raises(
        ArtifactError, match=r"holds a 'train' artifact, not a model: pass a 'quantize' checkpoint"
    ):
        base_artifacts(other.dir, store, need_twin=False)
