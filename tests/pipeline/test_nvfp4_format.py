"""Our NVFP4 reference against the compressed-tensors library's own NVFP4 compressor, bit for bit.

The library path is what llm-compressor runs: ``generate_gparam`` for the global scale,
``calculate_qparams`` for the FP8 block scales from per-group min/max, then
``NVFP4PackedCompressor.compress`` (quantize + ``pack_fp4_to_uint8``); and ``decompress`` back.
The library is fed float32 weights: its scale arithmetic runs in the weight's dtype, ours always in
float32 (see kernels/nvfp4_reference.py), so a bf16 weight is compared after an exact upcast.
"""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam
from qerl.kernels.nvfp4_dispatch import quantize
from qerl.kernels.nvfp4_reference import dequantize_nvfp4, global_scale, quantize_nvfp4
from qerl.pipeline.nvfp4.recipe import quantization_config

SCHEME = preset_name_to_scheme("NVFP4A16", ["Linear"])


def library_compress(w: torch.Tensor, gs: torch.Tensor | None = None):
    w = w.float()
    if gs is None:
        gs = generate_gparam(w.amin(), w.amax())
    groups = w.unflatten(-1, (w.shape[1] // 16, 16))
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), SCHEME.weights, global_scale=gs)
    out = NVFP4PackedCompressor.compress(
        {"weight": w, "weight_scale": scale, "weight_global_scale": gs}, SCHEME
    )
    return out["weight_packed"], out["weight_scale"], out["weight_global_scale"]


def library_decompress(packed, scale, gs) -> torch.Tensor:
    state = {"weight_packed": packed, "weight_scale": scale, "weight_global_scale": gs}
    return NVFP4PackedCompressor.decompress(state, SCHEME)["weight"]


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _weights() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    ties = torch.randint(-24, 25, (64, 128), generator=g).float() / 4.0  # many exact FP4 ties after scaling
    ties[:, ::16] = 6.0  # pins the block max so the scale is exact and the ties stay ties
    spread = torch.randn(64, 256, generator=g) * torch.logspace(-6, 2, 64).unsqueeze(1)
    zeros = torch.randn(32, 64, generator=g)
    zeros[::3] = 0.0
    zeros[1, 16:32] = -0.0
    tiny = torch.randn(16, 64, generator=g)
    tiny[2, :16] = 1e-12  # block scale underflows to 0 -> 0.125
    return [
        ("normal", torch.randn(96, 512, generator=g) * 0.02),
        ("bf16", (torch.randn(64, 384, generator=g) * 0.05).bfloat16()),
        ("heavy_tails", torch.randn(64, 128, generator=g) ** 9),
        ("ties", ties),
        ("row_spread", spread),
        ("zero_rows", zeros),
        ("tiny_block", tiny),
        ("all_zero", torch.zeros(16, 32)),
        ("saturating", torch.full((8, 32), 3.0e4)),
    ]


@pytest.mark.parametrize(("label", "w"), _weights(), ids=[lbl for lbl, _ in _weights()])
def test_reference_matches_library_compressor(label, w):
    ours = quantize_nvfp4(w)
    lib = library_compress(w)
    for name, a, b in zip(("weight_packed", "weight_scale", "weight_global_scale"), ours, lib, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert _raw(a) == _raw(b), f"{label}: {name} differs"
    # the fast CPU backend is the same function
    assert all(_raw(a) == _raw(b) for a, b in zip(quantize(w), ours, strict=True))


@pytest.mark.parametrize(("label", "w"), _weights(), ids=[lbl for lbl, _ in _weights()])
def test_library_decompress_equals_our_dequantization(label, w):
    packed, scale, gs = quantize_nvfp4(w)
    ours = dequantize_nvfp4(packed, scale, gs, dtype=torch.bfloat16)
    theirs = library_decompress(packed, scale, gs)
    assert theirs.dtype == torch.bfloat16
    assert _raw(ours) == _raw(theirs), label


def test_shared_global_scale_matches_library_fused_update():
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(64, 128, generator=g) * s for s in (0.02, 0.5, 0.01))
    # llm-compressor gives fused layers the minimum of their global scales
    lib_gs = torch.min(torch.cat([generate_gparam(t.amin(), t.amax()) for t in (q, k, v)])).reshape(1)
    gs = global_scale(max(t.abs().amax().item() for t in (q, k, v)))
    assert _raw(gs) == _raw(lib_gs)
    for t in (q, k, v):
        assert all(
            _raw(a) == _raw(b)
            for a, b in zip(quantize_nvfp4(t, gs), library_compress(t, lib_gs), strict=True)
        )


def test_quantization_config_is_the_libraries_nvfp4a16():
    cfg = quantization_config()
    parsed = QuantizationConfig.model_validate(cfg)
    assert parsed.format == "nvfp4-pack-quantized"
    assert parsed.quantization_status == "compressed"
    assert parsed.ignore == ["lm_head"]
    group = parsed.config_groups["group_0"]
    assert group.targets == ["Linear"] and group.input_activations is None
    assert group.weights == SCHEME.weights
    assert cfg["quant_method"] == "compressed-tensors"


def test_in_features_not_multiple_of_16_is_rejected_like_the_library():
    from qerl.kernels.nvfp4_reference import NVFP4Error

    with pytest.raises(NVFP4Error, match="multiple of 16"):
        quantize_nvfp4(torch.randn(4, 40), name="odd")
    state = {
        "weight": torch.randn(4, 40),
        "weight_scale": torch.ones(4, 3),
        "weight_global_scale": torch.ones(1),
    }
    with pytest.raises(ValueError, match="divisble|divisible"):
        NVFP4PackedCompressor.compress(state, SCHEME)
