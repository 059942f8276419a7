"""NVFP4 (E2M1 codes, FP8 E4M3 block scales, float32 global scale): the plain-PyTorch specification.

What: ``quantize_nvfp4`` turns a 2-D weight ``[out, in]`` into the three tensors of a compressed-tensors
"nvfp4-pack-quantized" Linear (``weight_packed`` uint8 ``[out, in/2]``, ``weight_scale`` float8_e4m3fn
``[out, in/16]``, ``weight_global_scale`` float32 ``[1]``) and ``dequantize_nvfp4`` inverts it. The Triton
kernels in ``qerl.kernels.nvfp4_triton`` and the numba loops in ``qerl.kernels.nvfp4_numba`` must agree with these
functions bit for bit; ``qerl.kernels.nvfp4_dispatch`` picks between them and this file per device. Every
backend validates its arguments with the checks here (``check_weight``, ``check_packed``,
``check_global_scale``, ``resolve_global_scale``), so their errors read the same.

How, operation by operation (the order of float32 operations is part of the spec, because the
compressed-tensors library is the reference we are bit-exact against):

* global scale ``gs = 2688 / max(amax|W|, float32 tiny)``; a non-finite result (an all-zero or
  denormal-only tensor) becomes 1.0, as ``compressed_tensors.quantization.utils.generate_gparam`` does.
* block scale ``s = fp8_e4m3(clamp(gs * (amax_block / 6), -448, 448))``, round to nearest even; an
  exact zero becomes 0.125 (the smallest scale the library substitutes).
* code ``q = round_fp4(clamp(x / (s / gs), -6, 6))`` with ties to the even code; the sign bit is set for
  strictly negative quotients, so ``-0.3 -> 0x8`` ("negative zero") but ``-0.0 -> 0x0``.
* dequantization ``x = q * (s / gs)`` in float32, then one rounding to the output dtype.

Departures from the textbook formulas and why: NVFP4 is usually written ``s = fp8(gs * amax / 6)`` and
``x = q * s / gs``; the library computes ``gs * (amax / 6)`` and ``q * (s / gs)``, which can differ in
the last float32 bit, so we follow the library. All arithmetic is float32 whatever the input dtype
(a bf16 weight is upcast exactly); the library gives the same codes for a bf16 weight only when its
caller also computes the scales in float32 (the test feeds it float32). ``in % 16 != 0`` is an error
here, as it is in the library (``_process_group`` raises for non-divisible columns); no padding.

Memory: work is done in row chunks of about ``CHUNK_ELEMENTS`` elements, so the float32 temporaries of
a 7B model's largest projection stay in the tens of MB. FP8 rounding is done explicitly (exponent from
the float32 bits, then round-half-even at the E4M3 step) rather than by a dtype cast, because the Triton
interpreter's cast is wrong when rounding carries into the exponent and both paths share this recipe.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "FP4_VALUES",
    "GROUP_SIZE",
    "NVFP4Error",
    "check_global_scale",
    "check_packed",
    "check_weight",
    "dequantize_nvfp4",
    "fp4_codes",
    "global_scale",
    "pack_codes",
    "quantize_nvfp4",
    "resolve_global_scale",
    "round_fp8_e4m3",
    "tensor_amax",
    "unpack_codes",
]


GROUP_SIZE = 16
FP4_MAX = 6.0
FP8_MAX = 448.0
ZERO_SCALE = 0.125  # what the library puts in place of a zero block scale
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
CHUNK_ELEMENTS = 1 << 22

# |y| > b for each boundary b gives the code; the boundaries that round *up* at a tie (towards the even
# code) are moved one float32 ulp down so that one strict comparison implements both tie directions:
# 0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2.0, 2.5->2.0, 3.5->4.0, 5.0->4.0.
_TIE_UP = {0.75, 1.75, 3.5}
_BOUNDARIES = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]


class NVFP4Error(ValueError):
    """A weight cannot be quantized (shape, dtype, non-finite values); the message names the tensor."""


def fp4_boundaries(device: torch.device) -> torch.Tensor:
    """The E2M1 rounding boundaries ``fp4_codes`` bucketizes by (ties to even), on ``device``."""
    b = torch.tensor(_BOUNDARIES, dtype=torch.float32, device=device)
    down = torch.tensor([v in _TIE_UP for v in _BOUNDARIES], device=device)
    return torch.where(down, torch.nextafter(b, torch.zeros_like(b)), b)


def round_fp8_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round float32 ``x`` to the nearest FP8 E4M3 value (ties to even), saturating at +-448.

    Returns float32 holding exactly representable values. E4M3: 3 mantissa bits, exponents -6..8,
    subnormal step 2^-9. The step at ``|x|`` is ``2^(max(e, -6) - 3)`` with ``e`` the float32 exponent.
    """
    x = x.float()
    a = x.abs().clamp(max=FP8_MAX)
    exp = ((a.view(torch.int32) >> 23) & 0xFF) - 127
    step_bits = (exp.clamp(min=-6) - 3 + 127) << 23
    step = step_bits.view(torch.float32)
    return torch.copysign(torch.round(a / step) * step, x)


def global_scale(amax: torch.Tensor | float) -> torch.Tensor:
    """``2688 / amax`` as float32 ``[1]``; 1.0 where that is not finite (all-zero tensors)."""
    return _global_scale(amax)


def _global_scale(amax: torch.Tensor | float) -> torch.Tensor:
    amax_t = torch.as_tensor(amax, dtype=torch.float32).reshape(1).abs()
    amax_t = amax_t.clamp(min=torch.finfo(torch.float32).tiny)
    gs = (FP8_MAX * FP4_MAX) / amax_t
    return torch.nan_to_num(gs, nan=1.0, posinf=1.0, neginf=1.0)


def resolve_global_scale(w: torch.Tensor, gs: torch.Tensor | float | None, name: str) -> torch.Tensor:
    """``gs`` as float32 ``[1]`` on ``w``'s device, or ``w``'s own global scale when None; the amax pass
    rejects NaN/Inf in ``w`` (naming ``name``), and a non-finite or non-positive scale is an error."""
    amax = tensor_amax(w, name)  # also the NaN/Inf check
    out = _global_scale(amax) if gs is None else torch.as_tensor(gs, dtype=torch.float32).reshape(1)
    out = out.to(device=w.device, dtype=torch.float32)
    check_global_scale(out, name)
    return out


def check_global_scale(gs: torch.Tensor, name: str = "weight") -> None:
    """A global scale (float32 ``[1]``) must be finite and positive; the error names the tensor."""
    if not (torch.isfinite(gs).all() and gs.item() > 0):
        raise NVFP4Error(f"tensor '{name}': global scale must be finite and positive, got {gs.item()}")


def fp4_codes(y: torch.Tensor, boundaries: torch.Tensor | None = None) -> torch.Tensor:
    """E2M1 codes (uint8 0..15, bit 3 = sign) of float32 ``y``, clamped to +-6, ties to even."""
    bounds = fp4_boundaries(y.device) if boundaries is None else boundaries
    mag = torch.bucketize(y.abs(), bounds, right=False, out_int32=True).to(torch.uint8)
    return mag | ((y < 0).to(torch.uint8) << 3)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """Two codes per byte, the even column in the low nibble."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_codes``: uint8 ``[out, in/2]`` -> uint8 codes ``[out, in]``."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


def _fp4_lut(device: torch.device) -> torch.Tensor:
    mags = torch.tensor(FP4_VALUES, dtype=torch.float32, device=device)
    return torch.cat((mags, -mags))  # code 8 -> -0.0, as the library decodes it


def check_weight(w: torch.Tensor, name: str = "weight") -> None:
    """Shape and dtype checks, with the tensor's name in the message."""
    if w.dim() != 2:
        raise NVFP4Error(f"tensor '{name}': NVFP4 needs a 2-D weight, got shape {tuple(w.shape)}")
    if not w.is_floating_point():
        raise NVFP4Error(f"tensor '{name}': NVFP4 needs a floating-point weight, got {w.dtype}")
    if w.shape[1] % GROUP_SIZE:
        raise NVFP4Error(
            f"tensor '{name}': in_features {w.shape[1]} is not a multiple of {GROUP_SIZE} "
            "(compressed-tensors does not pad NVFP4 groups either)"
        )


def _raise_non_finite(chunk: torch.Tensor, row0: int, name: str) -> None:
    bad = (~torch.isfinite(chunk)).nonzero()[0].tolist()
    value = chunk[bad[0], bad[1]].item()
    raise NVFP4Error(
        f"tensor '{name}' has a non-finite value {value} at row {row0 + bad[0]}, column {bad[1]}"
    )


def tensor_amax(w: torch.Tensor, name: str = "weight", chunk_elements: int = CHUNK_ELEMENTS) -> float:
    """max |w| over the tensor, raising on NaN/Inf with the tensor name, row and column."""
    check_weight(w, name)
    amax = 0.0
    step = max(1, chunk_elements // max(1, w.shape[1]))
    for r0 in range(0, w.shape[0], step):
        chunk = w[r0 : r0 + step]
        if not chunk.numel():
            continue
        lo, hi = torch.aminmax(chunk)  # one pass, no |w| temporary; NaN propagates into both
        m = max(-lo.float().item(), hi.float().item())
        if not math.isfinite(m) or math.isnan(lo.float().item()) or math.isnan(hi.float().item()):
            _raise_non_finite(chunk, r0, name)
        amax = max(amax, m)
    return amax


@torch.no_grad()
def quantize_nvfp4(
    w: torch.Tensor,
    global_scale: torch.Tensor | float | None = None,
    name: str = "weight",
    chunk_elements: int = CHUNK_ELEMENTS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``w [out, in]`` to (weight_packed, weight_scale, weight_global_scale).

    ``global_scale`` is the shared scale of a fused group (q/k/v, gate/up); None computes it from ``w``.
    """
    check_weight(w, name)
    gs = resolve_global_scale(w, global_scale, name)
    out_f, in_f = w.shape
    packed = torch.empty(out_f, in_f // 2, dtype=torch.uint8, device=w.device)
    scale = torch.empty(out_f, in_f // GROUP_SIZE, dtype=torch.float8_e4m3fn, device=w.device)
    bounds = fp4_boundaries(w.device)
    step = max(1, chunk_elements // max(1, in_f))
    for r0 in range(0, out_f, step):
        x = w[r0 : r0 + step].float().reshape(-1, in_f // GROUP_SIZE, GROUP_SIZE)
        s = round_fp8_e4m3(gs * (x.abs().amax(dim=-1) / FP4_MAX))
        s = torch.where(s == 0, torch.full_like(s, ZERO_SCALE), s)
        y = (x / (s / gs).unsqueeze(-1)).reshape(x.shape[0], in_f)
        packed[r0 : r0 + step] = pack_codes(fp4_codes(y, bounds))
        scale[r0 : r0 + step] = s.to(torch.float8_e4m3fn)  # exact: s is already an E4M3 value
    return packed, scale, gs


def check_packed(
    packed: torch.Tensor,
    scale: torch.Tensor,
    out: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[int, int]:
    """Shape/dtype checks of a packed weight, and of ``out`` (the contiguous ``dtype`` ``[out, in]``
    buffer a decode writes into) when given; returns the dense ``(out, in)``. Every dequantizer
    (reference, dispatch, Triton) validates its arguments here."""
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise NVFP4Error(
            f"weight_packed must be a 2-D uint8 tensor, got {packed.dtype} {tuple(packed.shape)}"
        )
    out_f, in_f = packed.shape[0], packed.shape[1] * 2
    if in_f % GROUP_SIZE or tuple(scale.shape) != (out_f, in_f // GROUP_SIZE):
        raise NVFP4Error(
            f"weight_scale shape {tuple(scale.shape)} does not match weight_packed {tuple(packed.shape)} "
            f"(expected {(out_f, in_f // GROUP_SIZE)})"
        )
    if out is not None and (
        out.dtype != dtype or tuple(out.shape) != (out_f, in_f) or not out.is_contiguous()
    ):
        raise NVFP4Error(
            f"out must be a contiguous {dtype} {(out_f, in_f)} tensor, got {out.dtype} {tuple(out.shape)}"
        )
    return out_f, in_f


@torch.no_grad()
def dequantize_nvfp4(
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor | float,
    dtype: torch.dtype = torch.bfloat16,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> torch.Tensor:
    """``q * (s / gs)`` in float32, rounded once to ``dtype``; returns ``[out, in]``."""
    out_f, in_f = check_packed(packed, scale)
    gs = torch.as_tensor(global_scale, dtype=torch.float32).reshape(1).to(packed.device)
    lut = _fp4_lut(packed.device)
    out = torch.empty(out_f, in_f, dtype=dtype, device=packed.device)
    step = max(1, chunk_elements // max(1, in_f))
    for r0 in range(0, out_f, step):
        codes = unpack_codes(packed[r0 : r0 + step])
        q = lut[codes.long()].reshape(codes.shape[0], -1, GROUP_SIZE)
        mult = (scale[r0 : r0 + step].float() / gs).unsqueeze(-1)
        out[r0 : r0 + step] = (q * mult).reshape(codes.shape[0], in_f).to(dtype)
    return out
