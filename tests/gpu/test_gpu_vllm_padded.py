"""vLLM on the GPU, on a model off FP4 Marlin's tiles: SmolLM2-135M's shape, which vLLM pads.

FP4 Marlin's thread tiles need each projection's (outputs, inputs) to be multiples of (64, 128) or
of (128, 64). vLLM serves any other shape by padding it: it repacks the weight and its block scales
with zeros up to the cheaper of the two (``marlin_padded_nk``), and pads the activations and slices
the outputs on every call. The kit's other model is sized to need none. SmolLM2-135M-Instruct, the
model catalogue's real model, does: its hidden size 576 is 4.5 x 128, so its fused q/k/v (960 x 576)
and o_proj (576 x 576) are padded, whichever family vLLM picks. A user who runs the SmolLM2 preset
on a GPU is served through that path, and no other kit check takes it.

The model: a Llama (SmolLM2's architecture) at SmolLM2-135M's shape, random weights, two layers,
built there (no download) and quantized by the quantize stage on the GPU. One engine, as a run
builds it (``tests/gpu/test_gpu_vllm.py``'s config: CUDA graphs, LoRA), checks that

- vLLM chose FP4 Marlin and padded at least one projection, every repacked shape on a tile family
  (the shapes are recorded);
- the sampler/trainer gap with the trainer's LoRA is within the bounds of the aligned model: the
  trainer (the Triton dequantizer and a dense GEMM) pads nothing, so padding must change nothing of
  the function. Recorded in $OUT/vllm-gap.json under ``padded`` when OUT is set.
"""

from __future__ import annotations

import json

import pytest

from tests.gpu.test_gpu_vllm import (
    DIGEST,
    ENGINE,
    K3_BOUND,
    MEAN_ABS_BOUND,
    _gap,
    _skip_unless_vllm_on_cuda,
    kit_checkpoint,
    lora_trainer,
    record_gap,
)

pytestmark = pytest.mark.gpu

# SmolLM2-135M-Instruct's config.json, less 28 of its 30 layers (and its 49,152-token vocabulary)
SMOLLM2_SIZES = {
    "hidden_size": 576,
    "num_heads": 9,
    "num_kv_heads": 3,
    "intermediate_size": 1536,
    "num_layers": 2,
}


@pytest.fixture(scope="module")
def padded_base(tmp_path_factory):
    """The SmolLM2-shaped checkpoint, quantized on the GPU: its manifest."""
    _skip_unless_vllm_on_cuda()
    return kit_checkpoint(tmp_path_factory, "padded-llama", arch="llama", sizes=SMOLLM2_SIZES)


@pytest.fixture(scope="module")
def engine(padded_base):
    from qerl.pipeline.rollout.config import RolloutConfig
    from qerl.pipeline.rollout.factory import build_engine

    eng = build_engine(RolloutConfig(**ENGINE), padded_base, None)
    yield eng
    eng.close()


def _repacked(worker) -> dict:  # runs on the vLLM worker (in-process)
    from vllm.model_executor.layers.quantization.utils.marlin_utils import marlin_repacked_nk

    shapes = {}
    for name, module in worker.get_model().named_modules():
        scheme = getattr(module, "scheme", None)
        if scheme is None or "Marlin" not in type(getattr(scheme, "kernel", None)).__name__:
            continue
        size = [module.output_size_per_partition, module.input_size_per_partition]
        shapes[name] = {"size": size, "repacked": list(marlin_repacked_nk(module.weight, 4))}
    return shapes


def test_a_padded_model_serves_on_fp4_marlin_as_the_trainer_computes(engine, padded_base, tmp_path_factory):
    assert engine.mode == "vllm-nvfp4-marlin"
    shapes = engine.llm.collective_rpc(_repacked)[0]
    assert shapes, f"no layer on FP4 Marlin: {engine.info['linear_methods']}"
    padded = {name: s for name, s in shapes.items() if s["repacked"] != s["size"]}
    assert padded, f"vLLM padded no projection of a 576-wide model: {shapes}"
    for name, s in shapes.items():
        n, k = s["repacked"]
        assert (n % 64 == 0 and k % 128 == 0) or (n % 128 == 0 and k % 64 == 0), (name, s)
        assert n >= s["size"][0] and k >= s["size"][1], (name, s)

    state, adapter = lora_trainer(padded_base, tmp_path_factory)
    engine.set_adapter(adapter, DIGEST)
    engine.set_noise(0.0, 0)
    gap = _gap(engine, state, 0.0)
    engine.set_adapter(None, None)
    record = {"shapes": shapes, "padded": sorted(padded), "gap": gap}
    print("padded model:", json.dumps(record))
    record_gap("padded", record)
    assert gap["tokens"] > 0
    assert gap["mean_abs_dlogp"] < MEAN_ABS_BOUND and gap["k3_kl"] < K3_BOUND, record
