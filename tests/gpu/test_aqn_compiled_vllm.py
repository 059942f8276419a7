"""AQN in a vLLM engine with compiled graphs (CPU, in-process, torch.compile) built for AQN.

``build_engine(..., aqn=True)`` starts vLLM with qerl's model loader (``FP32_NORMS_LOAD_FORMAT``), so
the AQN norms are fp32 before torch.compile traces the model, and the noise is written into them in
place, exactly. Checked: the norms are fp32 from the start; the noise written is the HF engine's to
the last bit at the late-stage sigma that bf16 rounds away; the compiled graphs read it (at a sigma
that changes the model's function, the compiled engine and the HF engine agree); no WARNING; sigma 0
gives back the clean outputs bit for bit. On a GPU the same loader runs before CUDA graphs are
captured (``tests/gpu/test_gpu_vllm.py``).
"""

from __future__ import annotations

import logging

import pytest
import torch
from qerl.pipeline.rollout.aqn import layer_noise
from qerl.pipeline.rollout.aqn_vllm import FP32_NORMS_CACHE_KEY
from qerl.pipeline.rollout.config import RolloutConfig
from qerl.pipeline.rollout.factory import build_engine
from qerl.pipeline.rollout.protocol import SamplingSpec

from tests.pipeline.test_engines import fake_manifest

GREEDY = SamplingSpec(temperature=0.0, max_new_tokens=4)
PROMPTS = ["What is 2 + 3?", "Tom has 5 apples and buys 7 more."]


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    pytest.importorskip("vllm")
    cfg = RolloutConfig(
        dtype="bfloat16", enforce_eager=False, max_new_tokens=4, max_model_len=128, kv_cache_gib=0.125,
        template="terse", in_process=True, hf_batch_size=8, enable_lora=False, seed=3,
    )  # fmt: skip
    compiled = build_engine(cfg, None, fake_manifest(tiny_model_dir), aqn=True)
    hf = build_engine(cfg.model_copy(update={"engine": "hf"}), None, fake_manifest(tiny_model_dir))
    yield compiled, hf
    compiled.close()
    hf.close()


def _first(engine) -> list[tuple[int, float]]:
    """Each prompt's first greedy token and its logprob (the prompt's forward only)."""
    return [
        (c.completion_ids[0], c.logprobs[0]) for row in engine.generate(PROMPTS, 1, GREEDY, 0) for c in row
    ]


def test_a_compiled_engine_built_for_aqn_holds_exact_noise_that_its_graphs_read(engines, caplog):
    compiled, hf = engines
    assert compiled.info["aqn_norms"] == "fp32 from load" and compiled.info["built_for_aqn"] is True
    assert compiled.llm.llm_engine.vllm_config.additional_config == FP32_NORMS_CACHE_KEY  # own cache
    assert set(compiled.norm_dtypes().values()) == {"torch.float32"}  # before any noise: from the load
    clean, clean_first = compiled.norm_weights(), _first(compiled)
    try:
        with caplog.at_level(logging.WARNING):
            realised = compiled.set_noise(5e-4, 77)  # the 7B schedule's last sigma: bf16 rounds it away
        assert "compiled graphs" not in caplog.text
        assert realised == pytest.approx(hf.set_noise(5e-4, 77), rel=1e-6) and abs(realised / 5e-4 - 1) < 0.1
        for name, w in compiled.norm_weights().items():
            layer, kind = int(name.split(".layers.")[1].split(".")[0]), name.split(".")[-1]
            want = torch.tensor(clean[name]) + layer_noise(77, layer, len(w), 5e-4)[kind]
            assert torch.equal(torch.tensor(w), want), name
        # the graphs read the fp32 storage: at a sigma that changes the function, compiled vLLM and
        # transformers agree (to bf16 activations), and both moved away from the clean model
        compiled.set_noise(0.3, 77)
        hf.set_noise(0.3, 77)
        noisy, reference = _first(compiled), _first(hf)
        assert [t for t, _ in noisy] == [t for t, _ in reference]
        assert all(abs(a - b) < 0.05 for (_, a), (_, b) in zip(noisy, reference, strict=True)), (
            noisy,
            reference,
        )
        assert noisy != clean_first and [t for t, _ in noisy] != [t for t, _ in clean_first], (
            noisy,
            clean_first,
        )
    finally:
        compiled.set_noise(0.0, 0)
        hf.set_noise(0.0, 0)
    assert compiled.norm_weights() == clean and _first(compiled) == clean_first


def test_an_engine_built_for_aqn_compiles_into_a_cache_of_its_own(tiny_model_dir):
    """vLLM's compile cache is keyed by a config hash that leaves the load format out, and a cached
    graph is loaded without a check against the weights' dtypes: the AQN engine's config must hash
    apart from the plain engine's on the same model and settings (else one runs the other's graphs)."""
    pytest.importorskip("vllm")
    from qerl.pipeline.rollout.aqn_vllm import FP32_NORMS_LOAD_FORMAT
    from qerl.pipeline.rollout.vllm_engine import _llm_kwargs
    from vllm.compilation.caching import aot_compile_hash_factors
    from vllm.engine.arg_utils import EngineArgs

    cfg = RolloutConfig(
        dtype="bfloat16",
        enforce_eager=False,
        max_new_tokens=4,
        max_model_len=128,
        kv_cache_gib=0.125,
        in_process=True,
    )

    def vllm_config(aqn: bool):
        return EngineArgs(
            **_llm_kwargs(cfg, tiny_model_dir, "processed_logprobs", False, aqn)
        ).create_engine_config()

    plain, built = vllm_config(False), vllm_config(True)
    assert (plain.load_config.load_format, built.load_config.load_format) == ("auto", FP32_NORMS_LOAD_FORMAT)
    assert plain.compute_hash() != built.compute_hash()
    assert aot_compile_hash_factors(plain) != aot_compile_hash_factors(built)  # torch_compile_cache/<hash>
    # the key is the only difference: without it the two hash alike (the defect it prevents)
    built.additional_config = plain.additional_config
    assert plain.compute_hash() == built.compute_hash()
