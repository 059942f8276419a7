"""Stage rollout on a tiny fp32 model whose EOS is likely, so rows both stop and hit the length limit."""

from __future__ import annotations

import pytest
import torch
from qerl.pipeline.data.prompts import Problem, render_prompt
from qerl.pipeline.rollout.config import RolloutConfig
from qerl.pipeline.rollout.factory import build_engine
from qerl.pipeline.rollout.protocol import SamplingSpec
from qerl.pipeline.store.artifact_store import ArtifactStore
from qerl.pipeline.store.files import sha256_file
from qerl.stages import rollout

from tests.pipeline.test_engines import fake_manifest, make_adapter

PROBLEMS = [
    Problem("p0", "What is 2 + 3?", "5", source="test"),
    Problem("p1", "Tom has 5 apples and buys 7 more.", "12", source="test"),
    Problem("p2", "12 * 4 = ?", "48", source="test"),
]


def run_rollout(cfg, store, engine, base, *, step=0, sigma=0.0, adapter=None, digest=None, problems=PROBLEMS):
    """The rollout stage with this file's defaults: the test problems, no adapter, no noise, step 0."""
    return rollout.run(
        cfg=cfg,
        problems=problems,
        base=base,
        adapter_dir=adapter,
        adapter_digest=digest,
        sigma=sigma,
        step=step,
        store=store,
        engine=engine,
    )


@pytest.fixture(scope="module")
def eos_model_dir(tiny_model_factory):
    """A tiny model whose EOS logit has a large spread, so some completions end early."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_model_factory(dtype=torch.float32, norm_jitter=0.05, seed=1)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    eos = AutoTokenizer.from_pretrained(path).convert_tokens_to_ids("<|im_end|>")
    with torch.no_grad():
        model.lm_head.weight[eos] *= 8.0
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def cfg():
    return RolloutConfig(
        dtype="float32", enforce_eager=True, n_samples=3, temperature=1.0, max_new_tokens=16,
        max_model_len=256, kv_cache_gib=0.25, template="terse", max_lora_rank=8, in_process=True, seed=7,
    )  # fmt: skip


@pytest.fixture(scope="module")
def engine(cfg, eos_model_dir):
    engine = build_engine(cfg, None, fake_manifest(eos_model_dir))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def base(eos_model_dir):
    return fake_manifest(eos_model_dir)


def test_rollout_table(cfg, engine, base, tmp_path):
    store = ArtifactStore(tmp_path / "store")
    manifest = run_rollout(cfg, store, engine, base)
    assert manifest.stage == "rollout" and manifest.mode == "vllm-nvfp4-emulated"
    table = rollout.read_rollouts(manifest)
    assert table.schema == rollout.SCHEMA
    rows = table.to_pylist()
    assert len(rows) == 9
    assert [(r["group_id"], r["sample_idx"]) for r in rows] == [(g, s) for g in range(3) for s in range(3)]
    eos = engine.tokenizer.convert_tokens_to_ids("<|im_end|>")
    for r in rows:
        problem = PROBLEMS[r["group_id"]]
        assert r["prompt_id"] == problem["id"] and r["answer"] == problem["answer"]
        assert r["prompt_text"] == render_prompt(engine.tokenizer, problem["question"], "terse")
        assert len(r["logprobs"]) == len(r["completion_ids"]) > 0
        assert all(lp <= 0.0 for lp in r["logprobs"])
        assert (r["engine_mode"], r["sigma"], r["step"], r["temperature"]) == (
            "vllm-nvfp4-emulated",
            0.0,
            0,
            1.0,
        )
        if r["finish_reason"] == "stop":
            assert r["completion_ids"][-1] == eos  # the EOS is kept, with its logprob
        else:
            assert r["finish_reason"] == "length" and len(r["completion_ids"]) == 16
    reasons = {r["finish_reason"] for r in rows}
    assert reasons == {"stop", "length"}
    m = manifest.metrics
    assert m["tokens_generated"] == sum(len(r["completion_ids"]) for r in rows)
    assert m["truncation_rate"] == pytest.approx(sum(r["finish_reason"] == "length" for r in rows) / 9)
    assert m["tokens_per_s"] > 0
    assert manifest.extra["engine"]["logprobs_mode"] == "processed_logprobs"


def test_seeded_cached_and_keyed(cfg, engine, base, tmp_path, eos_model_dir):
    store_a, store_b = ArtifactStore(tmp_path / "a"), ArtifactStore(tmp_path / "b")
    first = run_rollout(cfg, store_a, engine, base, step=1)
    # The same inputs in a fresh store: the same bytes (seeded sampling on CPU).
    second = run_rollout(cfg, store_b, engine, base, step=1)
    assert sha256_file(first.file("rollouts.parquet")) == sha256_file(second.file("rollouts.parquet"))
    again = run_rollout(cfg, store_a, engine, base, step=1)
    assert again.key == first.key and again.created_at == first.created_at  # cache hit

    rows = lambda m: rollout.read_rollouts(m).to_pylist()  # noqa: E731
    other_step = run_rollout(cfg, store_a, engine, base, step=2)
    assert other_step.key != first.key
    assert [r["completion_ids"] for r in rows(other_step)] != [r["completion_ids"] for r in rows(first)]

    noisy = run_rollout(cfg, store_a, engine, base, step=1, sigma=0.02)
    assert noisy.key != first.key and rows(noisy)[0]["sigma"] == 0.02

    adapter = make_adapter(eos_model_dir, tmp_path / "adapter")
    digest = store_a.source_digest(adapter)
    with_lora = run_rollout(cfg, store_a, engine, base, step=1, adapter=adapter, digest=digest)
    assert with_lora.key != first.key and with_lora.inputs["adapter"] == digest
    assert rows(with_lora)[0]["adapter_digest"] == digest
    # Same sampling seed, different policy: the first token's logprob differs.
    assert rows(with_lora)[0]["logprobs"][0] != rows(first)[0]["logprobs"][0]
    engine.set_adapter(None, None)
    engine.set_noise(0.0, 0)


def test_eos_semantics_match_transformers(cfg, engine, eos_model_dir):
    """Greedy on the EOS-prone model: completions that stop agree token for token with generate."""
    hf = build_engine(cfg.model_copy(update={"engine": "hf"}), None, fake_manifest(eos_model_dir))
    prompts = [render_prompt(hf.tokenizer, p["question"], "terse") for p in PROBLEMS]
    greedy = SamplingSpec(temperature=0.0, max_new_tokens=16)
    a, b = engine.generate(prompts, 1, greedy, 0), hf.generate(prompts, 1, greedy, 0)
    for x, y in zip(a, b, strict=True):
        assert (x[0].completion_ids, x[0].finish_reason) == (y[0].completion_ids, y[0].finish_reason)
        assert max(abs(p - q) for p, q in zip(x[0].logprobs, y[0].logprobs, strict=True)) < 1e-4


def test_bad_problems_are_named(cfg, engine, base, tmp_path):
    store = ArtifactStore(tmp_path / "s")
    bad = [PROBLEMS[0], {"id": "x", "question": "q"}]
    with pytest.raises(ValueError, match=r"problem row 1 \(id 'x'\) lacks \['answer'\]"):
        run_rollout(cfg, store, engine, fake_manifest(tmp_path), problems=bad)
    with pytest.raises(ValueError, match="appears more than once"):
        run_rollout(cfg, store, engine, fake_manifest(tmp_path), problems=[PROBLEMS[0], PROBLEMS[0]])
    with pytest.raises(ValueError, match="together"):
        run_rollout(cfg, store, engine, fake_manifest(tmp_path), adapter=tmp_path)


def test_derived_seeds_are_unchanged_by_the_shared_helper():
    """The three seed derivations (request, RL step, AQN layer) now share ``derive_seed``; their values
    are pinned to what the earlier per-module copies returned, so cached rollouts stay valid."""
    import hashlib

    from qerl.pipeline.rollout.aqn import layer_generator
    from qerl.pipeline.rollout.protocol import sample_seed
    from qerl.pipeline.runtime.seeds import derive_seed

    assert [sample_seed(0, 0, 0), sample_seed(7, 3, -1), sample_seed(123456789, 15, 7)] == [
        325866218452587183, 6032442204645994562, 4083698714882082309,
    ]  # fmt: skip
    assert [rollout.step_seed(0, 0, "sample"), rollout.step_seed(0, 0, "aqn"), rollout.step_seed(5, 41, "aqn")] == [
        7658977552007426748, 3730921702872399293, 4582322104590523621,
    ]  # fmt: skip
    assert [layer_generator(s, layer).initial_seed() for s, layer in ((0, 0), (7, 3), (2**40, 27))] == [
        2153666824003493438, 512293655783918615, 2353801540498084249,
    ]  # fmt: skip

    def by_hand(text: str) -> int:  # the construction the copies spelled out
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & ((1 << 63) - 1)

    assert derive_seed("qerl-sample", 3, 1, 2) == by_hand("qerl-sample:3:1:2")
    assert derive_seed("qerl-rollout", 9, 4, "aqn") == by_hand("qerl-rollout:9:4:aqn")
    assert 0 <= derive_seed("x", 2**70) < 2**63


def test_an_engine_without_logprobs_takes_any_sampling():
    """Evaluation samples at T 0.6 / top_p 0.95 and records no logprobs: no exact mode is needed."""
    from qerl.pipeline.rollout.protocol import EngineError
    from qerl.pipeline.rollout.vllm_engine import _compatible, logprobs_mode_for

    truncated = SamplingSpec(temperature=0.6, top_p=0.95, logprobs=False)
    assert logprobs_mode_for(truncated) == "processed_logprobs"
    with pytest.raises(EngineError, match="temperature 0.6 with top_p=0.95"):
        logprobs_mode_for(SamplingSpec(temperature=0.6, top_p=0.95))
    # an evaluation engine still refuses a later request for logprobs it cannot record exactly
    assert not _compatible("processed_logprobs", SamplingSpec(temperature=0.6, top_p=0.95))
    assert RolloutConfig(logprobs=False, temperature=0.6, top_p=0.95).sampling() == truncated
