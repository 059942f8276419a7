"""vLLM on the GPU, built for AQN: exact noise under CUDA graphs.

A run with AQN builds its engine with
``build_engine(..., aqn=True)``: vLLM loads the model through qerl's loader
(``qerl.pipeline.rollout.aqn_vllm.FP32_NORMS_LOAD_FORMAT``), which leaves the AQN norms fp32 before
torch.compile traces the model and CUDA graphs capture it, and the noise is written into them in
place. This module checks that on the kit's engine (``tests/gpu/test_gpu_vllm.py``'s model and config,
its own engine: a failure of the fp32 norms under graph capture fails here, not there). Under
gpu_check.sh it serves the same checkpoint as that module's plain engine, which compiled first, so
what follows also checks that it did not run the plain engine's cached graphs:

- the norms are fp32 from the load on, and CUDA graphs are on;
- at the 7B schedule's last sigma (5e-4, which a bf16 write rounds mostly away) and at 0.05, the
  weights hold clean + the noise ``qerl.pipeline.rollout.aqn`` draws, to the last bit; at 0.05 the
  logprobs move, and sigma 0 gives them back bit for bit;
- the sampler/trainer gap with the noise on is as small as without it (the trainer given the same
  noise): recorded beside the other engine's in $OUT/vllm-gap.json under ``fp32_norms``.

The CPU runs the same path on vLLM 0.32's compiled engine (``tests/gpu/test_aqn_compiled_vllm.py``).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch

from tests.gpu.test_gpu_vllm import (  # noqa: F401 - module-scoped fixtures, built again for this module
    DIGEST,
    ENGINE,
    K3_BOUND,
    MEAN_ABS_BOUND,
    SIZES,
    _gap,
    _greedy,
    marlin_base,
    record_gap,
    trainer,
)

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def engine(marlin_base):  # noqa: F811 - the imported fixture
    from qerl.pipeline.rollout.config import RolloutConfig
    from qerl.pipeline.rollout.factory import build_engine

    eng = build_engine(RolloutConfig(**ENGINE), marlin_base, None, aqn=True)
    yield eng
    eng.close()


def test_the_norms_are_fp32_from_the_load_and_the_noise_is_exact_under_cuda_graphs(engine):
    from qerl.pipeline.rollout.aqn import layer_noise
    from qerl.pipeline.rollout.aqn_vllm import FP32_NORMS_CACHE_KEY
    from vllm.config import CUDAGraphMode

    assert engine.info["aqn_norms"] == "fp32 from load" and engine.info["built_for_aqn"] is True
    # its own compile cache, apart from test_gpu_vllm.py's plain engine's (aqn_vllm's docstring)
    vcfg = engine.llm.llm_engine.vllm_config
    assert vcfg.additional_config == FP32_NORMS_CACHE_KEY
    plain = Path(os.environ.get("QERL_GPU_KIT_DIR", "/nonexistent")) / "plain-engine.json"
    if plain.is_file():  # gpu_check.sh: the plain engine served this very checkpoint before, and compiled
        record = json.loads(plain.read_text())
        assert record["model"] == vcfg.model_config.model, record
        assert record["config_hash"] != vcfg.compute_hash(), "it would load the plain engine's graphs"
        print(
            f"same checkpoint as the plain engine; config hash {vcfg.compute_hash()} vs its {record['config_hash']}"
        )
    assert engine.llm.llm_engine.vllm_config.compilation_config.cudagraph_mode != CUDAGraphMode.NONE
    assert set(engine.norm_dtypes().values()) == {"torch.float32"}
    engine.set_adapter(None, None)
    clean = engine.norm_weights()
    base_ids, base_lp = _greedy(engine)
    seed = 11
    try:
        for sigma in (5e-4, 0.05):
            realised = engine.set_noise(sigma, seed)
            noisy = engine.norm_weights()
            assert len(noisy) == 2 * SIZES["num_layers"]
            for name, w in noisy.items():
                layer, kind = re.search(r"layers\.(\d+)\.(\w+)$", name).groups()
                z = layer_noise(seed, int(layer), SIZES["hidden_size"], sigma)[kind]
                assert torch.equal(torch.tensor(w), torch.tensor(clean[name]) + z), (sigma, name)
            print(f"AQN fp32 norms: sigma {sigma:g} realised {realised:.4g}")
        noisy_ids, noisy_lp = _greedy(engine)
    finally:
        engine.set_noise(0.0, seed)
    back_ids, back_lp = _greedy(engine)
    moved = [abs(x[0] - y[0]) for x, y in zip(base_lp, noisy_lp, strict=True) if x and y]
    assert noisy_ids != base_ids or max(moved) > 1e-3, moved
    assert back_ids == base_ids and back_lp == base_lp, "sigma 0 must restore the clean model exactly"


def test_the_gap_with_exact_noise_is_as_small_as_without(engine, trainer):  # noqa: F811
    state, adapter = trainer
    engine.set_adapter(adapter, DIGEST)
    try:
        engine.set_noise(0.0, 0)
        clean = _gap(engine, state, 0.0)
        engine.set_noise(0.02, 5)
        noisy = _gap(engine, state, 0.02)  # the trainer given the same noise (same seed)
    finally:
        engine.set_noise(0.0, 0)
        engine.set_adapter(None, None)
    record = {"clean": clean, "aqn": noisy}
    print("sampler/trainer gap, engine built for AQN:", json.dumps(record))
    record_gap("fp32_norms", record)
    for r in (clean, noisy):
        assert r["tokens"] > 0
        assert r["mean_abs_dlogp"] < MEAN_ABS_BOUND and r["k3_kl"] < K3_BOUND, r
    # exact noise on both sides: the noisy gap is the clean one's size, not larger
    assert noisy["mean_abs_dlogp"] < 1.5 * clean["mean_abs_dlogp"] + 1e-3, record
