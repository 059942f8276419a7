"""What FP4 Marlin reads differently from a checkpoint (``qerl.pipeline.nvfp4.marlin``), against vLLM.

The reference is vLLM's own conversion of the block scales for its Marlin kernel
(``nvfp4_marlin_process_scales``, plain PyTorch, the same function in this environment's vLLM 0.32 as
in the GPU's 0.26), decoded back by the replica's weights check (``tools/gpu_transfer/gpu_replica_weights.py``):
the count of zeroed blocks must be exactly the blocks vLLM's bytes decode to zero, and every other
block must decode to its stored scale.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch
from qerl.pipeline.nvfp4.marlin import marlin_rescale, marlin_zeroed_blocks, zeroed_in_layer
from qerl.pipeline.nvfp4.recipe import QuantizeConfig
from qerl.pipeline.store.artifact_store import ArtifactStore
from qerl.stages import quantize
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "gpu_transfer"))
import gpu_replica_weights as grw  # noqa: E402


def _e4m3(values: torch.Tensor) -> torch.Tensor:
    return values.to(torch.float8_e4m3fn)


def test_marlin_rescales_a_layer_by_the_power_of_two_that_keeps_its_largest_scale_under_448():
    assert marlin_rescale(448.0) == 1.0 and marlin_rescale(300.0) == 1.0
    assert marlin_rescale(224.0) == 2.0 and marlin_rescale(100.0) == 4.0 and marlin_rescale(0.5) == 512.0
    assert marlin_rescale(0.0) == 1.0  # an all-zero layer


@pytest.mark.parametrize(("largest", "some_zeroed"), [(448.0, True), (100.0, True), (0.75, False)])
def test_the_zeroed_count_is_what_vllms_own_conversion_loses(largest, some_zeroed):
    """Random E4M3 scales over the whole range, subnormals included, in a layer whose largest scale
    sets Marlin's rescale (1, 4, 512: that one lifts every subnormal above 2^-6); exactly the counted
    blocks decode to zero from vLLM's bytes."""
    pytest.importorskip("vllm")
    g = torch.Generator().manual_seed(int(largest * 4))
    exponents = torch.randint(-9, 9, (96, 32), generator=g).float()
    scales = _e4m3(torch.rand(96, 32, generator=g).add(1.0) * 2.0**exponents).float().clamp(max=largest)
    scales[0, :4] = 0.0
    scales[1, 0] = largest
    scales = _e4m3(scales)
    decoded, factor = grw.marlin_scale_roundtrip(scales)
    stored = scales.float()
    assert factor == marlin_rescale(largest)
    lost = (stored > 0) & (decoded == 0)
    assert torch.equal(decoded[~lost], stored[~lost])
    assert int(lost.sum()) == zeroed_in_layer([scales])
    assert bool(lost.any()) == some_zeroed


def test_a_quantize_manifest_counts_the_blocks_marlin_zeroes(tiny_model_dir, tmp_path):
    """The tiny model has none; planting subnormal scales in one fused part counts them against the
    fused layer (named by its first part), not against the part."""
    manifest = quantize.run(QuantizeConfig(), tiny_model_dir, ArtifactStore(tmp_path / "store"))
    marlin = manifest.extra["marlin"]
    assert marlin["zeroed_blocks"] == 0 and marlin["zeroed_layers"] == {}
    ckpt = tmp_path / "planted"
    shutil.copytree(manifest.dir, ckpt)
    shard = next(ckpt.glob("*.safetensors"))
    tensors = load_file(shard)
    name = "model.layers.1.self_attn.k_proj.weight_scale"
    planted = tensors[name].float()
    planted[:2, :3] = 2.0**-8  # subnormal in E4M3: under 2^-6 after a rescale of 1 (the group holds 448)
    tensors[name] = _e4m3(planted)
    save_file(tensors, shard, metadata={"format": "pt"})
    prefix = "model.layers.1.self_attn."
    layers = [
        [f"{prefix}{p}.weight_packed", f"{prefix}{p}.weight_scale"] for p in ("q_proj", "k_proj", "v_proj")
    ]
    got = marlin_zeroed_blocks(ckpt, [sum(layers, [])])
    assert got["zeroed_blocks"] == 6 and got["zeroed_layers"] == {f"{prefix}q_proj": 6}
    assert got["blocks"] == sum(
        tensors[f"{prefix}{p}.weight_scale"].numel() for p in ("q_proj", "k_proj", "v_proj")
    )
