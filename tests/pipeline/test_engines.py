"""Rollout engines on a tiny fp32 model (CPU): vLLM against transformers, LoRA, AQN, seeds.

One vLLM engine is built for the module (seconds to start) and reused: each test restores the
engine state it changes (adapter none, sigma 0).
"""

from __future__ import annotations

import os

import pytest
import torch
from qerl.pipeline.data.prompts import render_prompt
from qerl.pipeline.rollout.aqn import layer_noise
from qerl.pipeline.rollout.config import RolloutConfig
from qerl.pipeline.rollout.factory import build_engine
from qerl.pipeline.rollout.protocol import EngineError, SamplingSpec
from qerl.pipeline.store.manifest import Manifest

QUESTIONS = ["What is 2 + 3?", "Tom has 5 apples and buys 7 more. How many apples?", "12 * 4 = ?"]
GREEDY = SamplingSpec(temperature=0.0, max_new_tokens=12)


def fake_manifest(path, stage="dequantize", mode="nvfp4-dequantized-twin") -> Manifest:
    """Tests only: a plain model dir standing in for a stage artifact."""
    return Manifest(
        stage=stage, key="test", config={}, inputs={}, code_version="test", files={}, created_at="",
        mode=mode, path=str(path),
    )  # fmt: skip


def make_adapter(model_dir, out_dir, rank: int = 8, seed: int = 0):
    """A peft LoRA adapter on all seven projections with random, nonzero lora_B."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    peft_model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory(dtype=torch.float32, norm_jitter=0.05)


@pytest.fixture(scope="module")
def adapter_dir(model_dir, tmp_path_factory):
    return make_adapter(model_dir, tmp_path_factory.mktemp("adapter"))


@pytest.fixture(scope="module")
def cfg():
    return RolloutConfig(
        dtype="float32", enforce_eager=True, max_new_tokens=12, max_model_len=256, kv_cache_gib=0.25,
        template="terse", max_lora_rank=8, in_process=True, hf_batch_size=8,
    )  # fmt: skip


@pytest.fixture(scope="module")
def vllm_engine(cfg, model_dir):
    engine = build_engine(cfg, None, fake_manifest(model_dir))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def hf_engine(cfg, model_dir):
    engine = build_engine(cfg.model_copy(update={"engine": "hf"}), None, fake_manifest(model_dir))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def prompts(hf_engine):
    return [render_prompt(hf_engine.tokenizer, q, "terse") for q in QUESTIONS]


def assert_agree(a, b, tol=1e-4):
    for row_a, row_b in zip(a, b, strict=True):
        for x, y in zip(row_a, row_b, strict=True):
            assert x.prompt_ids == y.prompt_ids
            assert x.completion_ids == y.completion_ids
            assert x.completion_text == y.completion_text
            assert x.finish_reason == y.finish_reason
            assert len(x.logprobs) == len(x.completion_ids)
            assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs, strict=True)) < tol


def flat_logprobs(result):
    return [lp for row in result for c in row for lp in c.logprobs]


def test_modes_are_explicit(vllm_engine, hf_engine):
    assert vllm_engine.mode == "vllm-nvfp4-emulated"  # CPU: vLLM serves the dequantized twin
    assert hf_engine.mode == "hf-nvfp4-emulated"
    assert vllm_engine.info["logprobs_mode"] == "processed_logprobs"
    assert "UnquantizedLinearMethod" in vllm_engine.info["linear_methods"]


def test_build_engine_refuses_missing_or_wrong_twin(cfg, model_dir):
    with pytest.raises(EngineError, match="no twin was given"):
        build_engine(cfg, fake_manifest(model_dir, stage="quantize", mode="nvfp4"), None)
    with pytest.raises(EngineError, match="expected 'nvfp4-dequantized-twin'"):
        build_engine(cfg, None, fake_manifest(model_dir, mode="something-else"))
    with pytest.raises(EngineError, match="no twin"):
        build_engine(cfg.model_copy(update={"engine": "hf"}), None, None)


def test_greedy_vllm_matches_transformers(vllm_engine, hf_engine, prompts):
    a = vllm_engine.generate(prompts, 1, GREEDY, seed=0)
    b = hf_engine.generate(prompts, 1, GREEDY, seed=0)
    assert_agree(a, b)
    assert all(len(c.completion_ids) > 0 for row in a for c in row)


def test_greedy_with_lora_matches_and_differs_from_base(vllm_engine, hf_engine, prompts, adapter_dir):
    base = vllm_engine.generate(prompts, 1, GREEDY, seed=0)
    try:
        vllm_engine.set_adapter(adapter_dir, "d1" * 32)
        hf_engine.set_adapter(adapter_dir, "d1" * 32)
        a = vllm_engine.generate(prompts, 1, GREEDY, seed=0)
        b = hf_engine.generate(prompts, 1, GREEDY, seed=0)
    finally:
        vllm_engine.set_adapter(None, None)
        hf_engine.set_adapter(None, None)
    assert_agree(a, b)
    assert flat_logprobs(a) != flat_logprobs(base)  # the adapter reached the engine
    assert_agree(vllm_engine.generate(prompts, 1, GREEDY, seed=0), base, tol=1e-6)  # and left it


def test_sampled_logprobs_are_temperature_scaled_full_softmax(vllm_engine, model_dir, prompts):
    """Reference: teacher-force a fresh transformers model on vLLM's samples, log_softmax(logits / T)."""
    from transformers import AutoModelForCausalLM

    spec = SamplingSpec(temperature=0.7, max_new_tokens=10)
    result = vllm_engine.generate(prompts[:2], 2, spec, seed=3)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for row in result:
        for c in row:
            ids = torch.tensor([c.prompt_ids + c.completion_ids])
            with torch.no_grad():
                logits = model(ids).logits[0, len(c.prompt_ids) - 1 : -1].float()
            ref = torch.log_softmax(logits / 0.7, dim=-1).gather(-1, torch.tensor(c.completion_ids)[:, None])[
                :, 0
            ]
            assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-4)


def test_sampling_is_seeded(vllm_engine, hf_engine, prompts):
    spec = SamplingSpec(temperature=1.0, max_new_tokens=8)
    a = vllm_engine.generate(prompts, 3, spec, seed=5)
    b = vllm_engine.generate(prompts, 3, spec, seed=5)
    c = vllm_engine.generate(prompts, 3, spec, seed=6)
    ids = lambda r: [x.completion_ids for row in r for x in row]  # noqa: E731
    assert ids(a) == ids(b) and ids(a) != ids(c)
    assert len({tuple(x.completion_ids) for x in a[0]}) > 1  # samples of one prompt differ
    h1, h2 = hf_engine.generate(prompts, 2, spec, seed=5), hf_engine.generate(prompts, 2, spec, seed=5)
    assert ids(h1) == ids(h2)


def test_aqn_reaches_vllm_exact_restore_no_accumulation(vllm_engine, hf_engine, prompts):
    clean = vllm_engine.generate(prompts, 1, GREEDY, seed=0)
    clean_weights = vllm_engine.norm_weights()
    try:
        vllm_engine.set_noise(0.05, 123)
        noisy = vllm_engine.generate(prompts, 1, GREEDY, seed=0)
        weights = vllm_engine.norm_weights()
        vllm_engine.set_noise(0.05, 123)  # the same again: from the clean copy, no accumulation
        again = vllm_engine.generate(prompts, 1, GREEDY, seed=0)
        hf_engine.set_noise(0.05, 123)
        hf_noisy = hf_engine.generate(prompts, 1, GREEDY, seed=0)
    finally:
        vllm_engine.set_noise(0.0, 0)
        hf_engine.set_noise(0.0, 0)
    restored = vllm_engine.generate(prompts, 1, GREEDY, seed=0)
    # The workers hold exactly clean + z (z from qerl.pipeline.rollout.aqn, the same draw as the HF engine's).
    assert len(weights) == 4
    for name, w in weights.items():
        layer, kind = int(name.split(".layers.")[1].split(".")[0]), name.split(".")[-1]
        expected = torch.tensor(clean_weights[name]) + layer_noise(123, layer, len(w), 0.05)[kind]
        assert torch.equal(torch.tensor(w), expected), name
    assert flat_logprobs(noisy) != flat_logprobs(clean)
    assert flat_logprobs(again) == flat_logprobs(noisy)
    assert flat_logprobs(restored) == flat_logprobs(clean)
    assert vllm_engine.norm_weights() == clean_weights
    assert_agree(noisy, hf_noisy)  # both engines saw the same noise


def test_logprobs_mode_choice():
    from qerl.pipeline.rollout.vllm_engine import logprobs_mode_for

    assert logprobs_mode_for(SamplingSpec(temperature=0.6)) == "processed_logprobs"
    assert logprobs_mode_for(SamplingSpec(temperature=0.0, top_p=0.9)) == "processed_logprobs"
    assert logprobs_mode_for(SamplingSpec(temperature=1.0, top_p=0.9)) == "raw_logprobs"
    with pytest.raises(EngineError, match="un-renormalised"):
        logprobs_mode_for(SamplingSpec(temperature=0.7, top_k=20))


def test_a_cuda_engine_core_is_spawned_not_forked(monkeypatch, tmp_path):
    """torch.cuda.is_available() arms torch's fork guard without initialising CUDA, and vLLM forks
    unless CUDA is initialised: the forked engine core then cannot use CUDA (bench_vllm on an H100).
    An inherited ``fork`` is overridden too; an in-process engine starts no process."""
    from qerl.pipeline.rollout.vllm_engine import _llm_kwargs

    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    _llm_kwargs(RolloutConfig(in_process=True), tmp_path, "processed_logprobs", True)
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "fork"
    _llm_kwargs(RolloutConfig(in_process=False), tmp_path, "processed_logprobs", False)
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "fork"  # the CPU has no CUDA to guard
    _llm_kwargs(RolloutConfig(in_process=False), tmp_path, "processed_logprobs", True)
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"


def test_vllm_engine_rejects_incompatible_sampling_and_long_prompts(vllm_engine, prompts, tmp_path):
    with pytest.raises(EngineError, match="logprobs_mode"):
        vllm_engine.generate(prompts, 1, SamplingSpec(temperature=1.0, top_p=0.5), seed=0)
    with pytest.raises(EngineError, match="max_model_len"):
        vllm_engine.generate(prompts, 1, SamplingSpec(temperature=0.0, max_new_tokens=250), seed=0)
    with pytest.raises(EngineError, match="adapter_config.json"):
        vllm_engine.set_adapter(tmp_path, "ab" * 32)


def test_vllm_seeded_batch_larger_than_one_step_budget(vllm_engine, prompts):
    # 32 seeded requests of ~180 prompt tokens exceed the 4096-token step budget, so vLLM must spread
    # the prompts over steps. On CPU the engine turns chunked prefill off for this (a 128-request
    # batch of the rollout benchmark crashed in vLLM's generator rewind with it on); whole prompts
    # wait for the next step, and the result stays seeded.
    long_prompts = [
        p + " " + " ".join(str(k % 10) for k in range(80 + i)) for i, p in enumerate((prompts * 2)[:4])
    ]
    assert len(vllm_engine.tokenizer(long_prompts[0]).input_ids) > 4096 // 32
    scheduler = vllm_engine.llm.llm_engine.vllm_config.scheduler_config
    assert scheduler.enable_chunked_prefill is False and scheduler.max_num_batched_tokens == 4096
    spec = SamplingSpec(temperature=1.0, max_new_tokens=4)
    a = vllm_engine.generate(long_prompts, 8, spec, seed=3)
    b = vllm_engine.generate(long_prompts, 8, spec, seed=3)
    assert [len(row) for row in a] == [8] * 4
    assert [c.completion_ids for row in a for c in row] == [c.completion_ids for row in b for c in row]


def test_group_reuses_its_prompt_prefill(vllm_engine, hf_engine, prompts):
    # Each distinct prompt is prefilled once before its group, so the group's n requests find the
    # prompt's full KV blocks (32 tokens on CPU) in the prefix cache; greedy results still agree
    # with transformers, which prefills every sample itself.
    long_prompts = [p + " " + " ".join(str(k % 10) for k in range(40)) for p in prompts]
    block = vllm_engine.block_size
    assert block == 32
    lengths = [len(vllm_engine.tokenizer(p).input_ids) for p in long_prompts]
    assert min(lengths) >= 2 * block
    vllm_engine.llm.reset_prefix_cache()
    result = vllm_engine.generate(long_prompts, 3, GREEDY, seed=0)
    stats = vllm_engine.last_prefix_stats
    # all full blocks but one holding the prompt's last token, which vLLM always computes (its logits)
    expected = sum(3 * ((length - 1) // block) * block for length in lengths)
    assert stats == {"prompt_tokens": 3 * sum(lengths), "cached_prompt_tokens": expected}
    assert_agree(result, hf_engine.generate(long_prompts, 3, GREEDY, seed=0))
    vllm_engine.llm.reset_prefix_cache()
    single = vllm_engine.generate(long_prompts, 1, GREEDY, seed=0)
    assert vllm_engine.last_prefix_stats["cached_prompt_tokens"] == 0  # nothing to share, nothing primed
    assert_agree(single, [row[:1] for row in result])


def test_the_cpu_kv_cache_is_the_configured_size(tmp_path, monkeypatch):
    """``rollout.kv_cache_gib`` sizes the CPU engine's cache: ``qerl run``'s environment no longer pins
    vLLM's legacy ``VLLM_CPU_KVCACHE_SPACE`` (which overrides it) to 1 GiB."""
    import os

    from qerl.pipeline.rollout.config import RolloutConfig
    from qerl.pipeline.rollout.vllm_engine import _memory_kwargs

    environ = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    monkeypatch.setattr(os, "environ", environ)  # what prepare_environment sets stays in this test
    from qerl.flows.orchestration import prepare_environment

    prepare_environment(tmp_path)
    assert "VLLM_CPU_KVCACHE_SPACE" not in environ and "PREFECT_CLIENT_MAX_RETRIES" in environ
    assert _memory_kwargs(RolloutConfig(kv_cache_gib=2.5), cuda=False)["kv_cache_memory_bytes"] == 5 << 29
