"""What vLLM's FP4 Marlin kernel reads differently from an NVFP4 checkpoint: its zeroed block scales.

On a GPU the sampler is vLLM's Marlin W4A16 kernel and the trainer decodes the same checkpoint with
qerl's kernels. Marlin stores each FP8 E4M3 block scale in its own 8-bit S0E5M3 form (the scale times
2^7, after the power-of-two rescale of the fused layer that lifts its largest scale into (224, 448]), which
holds every normal E4M3 value exactly but no subnormal one: a nonzero block scale whose rescaled value
is below 2^-6, the smallest normal E4M3 value, becomes zero, and its 16 weights with it, in the
sampler only (vLLM 0.26, ``nvfp4_marlin_process_scales``). ``marlin_zeroed_blocks`` counts those
blocks per vLLM layer (a fused q/k/v or gate/up group is one) so that the quantize manifest says how
far sampler and trainer disagree before anything is served; a nonzero count is logged as a warning.

With qerl's global scale (``448 * 6 / amax`` of the fused group) a block scale is subnormal only when
its block's largest weight is below about 3.5e-5 of the group's; the published SmolLM2-135M has no
such block. The count follows vLLM's arithmetic, and a CPU test checks it against vLLM's own
conversion.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch
from qerl.kernels.nvfp4_reference import FP8_MAX
from qerl.pipeline.nvfp4.safetensors_io import TensorSpec, read_tensor, safetensors_index

__all__ = ["E4M3_MIN_NORMAL", "marlin_rescale", "marlin_zeroed_blocks", "zeroed_in_layer"]

log = logging.getLogger(__name__)

E4M3_MIN_NORMAL = 2.0**-6  # the smallest normal FP8 E4M3 value


def marlin_rescale(max_scale: float) -> float:
    """Marlin's power-of-two factor for a layer whose largest block scale is ``max_scale`` (with bf16
    activations): the largest power of two that keeps it at or below 448, and 1 when it is already
    there or the layer's scales are all zero."""
    if not 0.0 < max_scale < FP8_MAX:
        return 1.0
    return 2.0 ** math.floor(math.log2(FP8_MAX / max_scale))


def zeroed_in_layer(scales: list[torch.Tensor]) -> int:
    """Blocks of one vLLM layer (the block scales of its parts) that Marlin reads as zero."""
    values = [s.float() for s in scales]
    if not values:
        return 0
    factor = marlin_rescale(max(float(v.max()) for v in values))
    return sum(int(((v > 0) & (v * factor < E4M3_MIN_NORMAL)).sum()) for v in values)


def marlin_zeroed_blocks(ckpt_dir: str | Path, layers: list[list[str]]) -> dict[str, object]:
    """For the checkpoint in ``ckpt_dir`` and its vLLM layers (each the list of its tensors' names, a
    fused group's together; only the ``weight_scale`` ones are read): the blocks, the blocks Marlin
    reads as zero, and the layers that have any, by their first part's name (logged as a warning)."""
    index: dict[str, TensorSpec] = safetensors_index(ckpt_dir)
    blocks, per_layer = 0, {}
    for names in layers:
        scales = [read_tensor(index[n]) for n in names if n.endswith(".weight_scale")]
        blocks += sum(s.numel() for s in scales)
        zeroed = zeroed_in_layer(scales)
        if zeroed:
            per_layer[names[0].rsplit(".", 1)[0]] = zeroed
    if per_layer:
        log.warning("FP4 Marlin (the GPU sampler) reads NVFP4 blocks as zero, per layer: %s", per_layer)
    return {"blocks": blocks, "zeroed_blocks": sum(per_layer.values()), "zeroed_layers": per_layer}
