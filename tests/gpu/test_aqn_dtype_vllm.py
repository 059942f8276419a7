"""AQN in a bf16 vLLM engine (CPU, in-process, eager) and the HF engine on the same bf16 model.

One engine of each kind for the module (vLLM takes seconds to start); each test restores sigma 0.
Checked: the workers hold clean + z in fp32 (the noise drawn, identical to the HF engine's), the
realised sigma they return is within 10% at the preset schedule's ends, the logprobs move, sigma 0
gives back the bf16 parameters and bit-identical outputs; an engine with compiled graphs keeps the
bf16 write and says so at WARNING; the rollout stage records the realised sigma and the run record
carries it.
"""

from __future__ import annotations

import logging

import pytest
import torch
from qerl.pipeline.rollout.aqn import layer_noise
from qerl.pipeline.rollout.config import RolloutConfig
from qerl.pipeline.rollout.factory import build_engine
from qerl.pipeline.rollout.protocol import SamplingSpec

from tests.pipeline.test_engines import fake_manifest

GREEDY = SamplingSpec(temperature=0.0, max_new_tokens=6)
PROMPTS = ["What is 2 + 3?", "Tom has 5 apples and buys 7 more."]


@pytest.fixture(scope="module")
def cfg():
    return RolloutConfig(
        dtype="bfloat16", enforce_eager=True, max_new_tokens=6, max_model_len=128, kv_cache_gib=0.125,
        template="terse", max_lora_rank=8, in_process=True, hf_batch_size=8, enable_lora=False, seed=3,
    )  # fmt: skip


@pytest.fixture(scope="module")
def engines(cfg, tiny_model_dir):
    vllm = build_engine(cfg, None, fake_manifest(tiny_model_dir))
    hf = build_engine(cfg.model_copy(update={"engine": "hf"}), None, fake_manifest(tiny_model_dir))
    yield vllm, hf
    vllm.close()
    hf.close()


def _logprobs(engine) -> list[float]:
    rows = engine.generate(PROMPTS, 1, GREEDY, seed=0)
    return [lp for row in rows for c in row for lp in c.logprobs]


def _hf_norm_weights(engine) -> dict[str, list[float]]:
    return {
        n: m.weight.detach().float().tolist()
        for n, m in engine.base.named_modules()
        if n.endswith("layernorm")
    }


def test_bf16_vllm_holds_the_drawn_noise_in_fp32_like_the_hf_engine(engines):
    vllm, hf = engines
    assert set(vllm.norm_dtypes().values()) == {"torch.bfloat16"}
    clean = vllm.norm_weights()
    clean_lp = _logprobs(vllm)
    try:
        for sigma in (1e-2, 5e-4):
            realised = vllm.set_noise(sigma, 77)
            assert realised == vllm.sigma_realised and abs(realised / sigma - 1) < 0.10, (sigma, realised)
            assert set(vllm.norm_dtypes().values()) == {"torch.float32"}
            weights = vllm.norm_weights()
            for name, w in weights.items():
                layer, kind = int(name.split(".layers.")[1].split(".")[0]), name.split(".")[-1]
                want = torch.tensor(clean[name]) + layer_noise(77, layer, len(w), sigma)[kind]
                assert torch.equal(torch.tensor(w), want), (sigma, name)
            hf_realised = hf.set_noise(sigma, 77)
            hf_weights = _hf_norm_weights(hf)
            assert hf_realised == pytest.approx(realised, rel=1e-6)
            # both engines use the same noise vectors (vLLM names modules, transformers the same path)
            assert {k.removeprefix("model."): v for k, v in weights.items()} == {
                k.removeprefix("model."): v for k, v in hf_weights.items()
            }
            noisy_lp = _logprobs(vllm)
            assert noisy_lp != clean_lp
            vllm.set_noise(sigma, 77)  # again from the clean copy: no accumulation
            assert vllm.norm_weights() == weights and _logprobs(vllm) == noisy_lp
    finally:
        assert vllm.set_noise(0.0, 0) == 0.0
        hf.set_noise(0.0, 0)
    assert set(vllm.norm_dtypes().values()) == {"torch.bfloat16"}
    assert vllm.norm_weights() == clean
    assert _logprobs(vllm) == clean_lp  # noise-free again: the fused path, bit for bit


def test_noisy_vllm_and_hf_agree_through_the_residual_norms(engines):
    """The fp32-weight norms in vLLM (plain and fused residual-add) compute what the HF engine's do."""
    vllm, hf = engines
    try:
        vllm.set_noise(1e-2, 5)
        hf.set_noise(1e-2, 5)
        v = vllm.generate(PROMPTS, 1, GREEDY, seed=0)
        h = hf.generate(PROMPTS, 1, GREEDY, seed=0)
    finally:
        vllm.set_noise(0.0, 0)
        hf.set_noise(0.0, 0)
    for vrow, hrow in zip(v, h, strict=True):
        vc, hc = vrow[0], hrow[0]
        assert vc.completion_ids[:1] == hc.completion_ids[:1]
        # bf16 activations, two attention implementations: agreement to bf16 precision
        assert abs(vc.logprobs[0] - hc.logprobs[0]) < 0.05, (vc.logprobs[0], hc.logprobs[0])


def test_compiled_graphs_keep_the_bf16_write_and_warn(engines, monkeypatch, caplog):
    """An engine whose graphs are compiled cannot change a weight's dtype: bf16 write, WARNING."""
    from qerl.pipeline.rollout import aqn_vllm

    vllm, _ = engines
    monkeypatch.setattr(aqn_vllm, "graphs_frozen", lambda config: True)  # the worker is in-process
    try:
        with caplog.at_level(logging.WARNING):
            realised = vllm.set_noise(5e-4, 77)
        assert set(vllm.norm_dtypes().values()) == {"torch.bfloat16"}
        assert abs(realised / 5e-4 - 1) > 0.10
        assert "compiled graphs" in caplog.text and "realised sigma" in caplog.text
    finally:
        vllm.set_noise(0.0, 0)


def test_the_rollout_stage_and_run_record_carry_the_realised_sigma(engines, cfg, tiny_model_dir, tmp_path):
    from types import SimpleNamespace

    from qerl.flows.report import step_entry
    from qerl.pipeline.store.artifact_store import ArtifactStore
    from qerl.stages import rollout

    vllm, _ = engines
    store = ArtifactStore(tmp_path / "store")
    problems = [{"id": "p0", "question": PROMPTS[0], "answer": "5"}]
    common = dict(
        cfg=cfg.model_copy(update={"n_samples": 2}), problems=problems, base=fake_manifest(tiny_model_dir)
    )
    try:
        noisy = rollout.run(
            **common, adapter_dir=None, adapter_digest=None, sigma=5e-4, step=3, store=store, engine=vllm
        )
    finally:
        vllm.set_noise(0.0, 0)
    m = noisy.metrics
    assert m["aqn_sigma"] == 5e-4 and abs(m["aqn_sigma_realised"] / 5e-4 - 1) < 0.10
    clean = rollout.run(
        **common, adapter_dir=None, adapter_digest=None, sigma=0.0, step=0, store=store, engine=vllm
    )
    assert clean.metrics["aqn_sigma_realised"] == 0.0
    other = SimpleNamespace(key="k", metrics={})
    entry = step_entry(3, 5e-4, noisy, other, other).model_dump()
    assert entry["sigma"] == 5e-4 and entry["aqn_sigma_realised"] == m["aqn_sigma_realised"]
    assert not any(k.startswith("rollout_aqn") for k in entry)


def test_vllm_native_norms_with_an_fp32_weight_match_a_plain_reference():
    """What vLLM's CPU RMSNorm runs (native ``rms_norm`` / ``fused_add_rms_norm``) given the fp32
    weight: the output is ``(x_hat_fp32 * w_fp32).to(bf16)`` and the residual stays bf16."""
    from vllm import ir

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=gen).to(torch.bfloat16)
    r = torch.randn(5, 64, generator=gen).to(torch.bfloat16)
    w = (1 + 0.05 * torch.randn(64, generator=gen)).to(torch.bfloat16).float() + 5e-4 * torch.randn(
        64, generator=gen
    )

    def reference(h: torch.Tensor) -> torch.Tensor:
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * w).to(torch.bfloat16)

    out = ir.ops.rms_norm.impls["native"].impl_fn(x, w, 1e-6)
    assert out.dtype == torch.bfloat16 and torch.equal(out, reference(x.float()))
    fused_out, residual = ir.ops.fused_add_rms_norm.impls["native"].impl_fn(x.clone(), r.clone(), w, 1e-6)
    summed = x.float() + r.float()
    assert residual.dtype == torch.bfloat16 and torch.equal(residual, summed.to(torch.bfloat16))
    assert fused_out.dtype == torch.bfloat16 and torch.equal(fused_out, reference(summed))
    # vLLM's fused C kernel declines a weight whose dtype differs from the input's (then: native)
    from vllm.kernels import vllm_c

    assert not vllm_c.rms_no_var_size(x, w, 1e-6) and vllm_c.rms_no_var_size(x, w.to(torch.bfloat16), 1e-6)
