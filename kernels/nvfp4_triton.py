"""NVFP4 quantize and dequantize as Triton kernels; ``qerl.kernels.nvfp4_reference`` is their specification.

What: ``quantize_nvfp4_triton`` / ``dequantize_nvfp4_triton`` compute exactly what
``qerl.kernels.nvfp4_reference.quantize_nvfp4`` / ``dequantize_nvfp4`` compute, bit for bit, on CUDA (compiled) or
anywhere under ``TRITON_INTERPRET=1`` (how the tests run them on CPU).

How: a weight ``[out, in]`` with ``in % 16 == 0`` is viewed as ``out*in/16`` contiguous groups of 16,
and group ``g`` owns scale element ``g`` and packed bytes ``8g..8g+7`` -- the flat layouts of
``weight_scale [out, in/16]`` and ``weight_packed [out, in/2]`` -- so one program handles BLOCK groups
with no row/column bookkeeping. The global scale (one reduction over the whole tensor) is computed by
the caller in torch, shared by fused q/k/v and gate/up groups.

Departures and why: FP8 E4M3 rounding is explicit (exponent from the float32 bits, step 2^(e-3),
round half to even with the 1.5*2^23 magic-number trick) because the interpreter's
``.to(tl.float8e4nv)`` rounds wrongly when rounding carries into the exponent (7.85 -> 4.0). The
rounded value is exactly representable, so the final cast only re-encodes it. Scales are written as
float32 and cast to float8_e4m3fn in torch (exact), which keeps the kernel free of FP8 store support.
For the same reason the float32 -> bf16 rounding of dequantized values is explicit (the interpreter
truncates where CUDA rounds to nearest even); the final cast then only drops zero bits. Every float32
division is ``tl.math.div_rn`` (IEEE round-to-nearest), not ``/``: Triton lowers ``/`` on NVIDIA GPUs to
``div.full.f32`` / ``div.approx.f32`` (up to 2 ulp off, triton-lang/triton#10661), which moves quotients
across the FP4 tie boundaries; the interpreter divides exactly either way, so only the compiled PTX
shows it (tests/gpu/test_gpu.py checks the PTX on a CPU). Signs go on by an integer OR of the sign bit,
never a float negation: compiled for the GPU, ``tl.where(code & 8, -v, v)`` decodes code 8 to +0.0
(measured on an H200), where the interpreter and the library give -0.0.
"""

# ruff: noqa: ANN001 - @triton.jit arguments are pointers and scalars typed by Triton, not Python

from __future__ import annotations

import torch
import triton
import triton.language as tl
from qerl.kernels.nvfp4_reference import GROUP_SIZE, check_packed, check_weight, resolve_global_scale

__all__ = ["dequantize_nvfp4_triton", "quantize_nvfp4_triton", "round_fp8_e4m3_triton"]

_BLOCK = 64


@triton.jit
def _signed(mag, negative):
    """``mag`` (>= +0.0) with its sign bit set where ``negative``, by an integer OR, so that zero keeps
    its sign: compiled for the GPU, the float forms (``-x``, a select between ``x`` and ``-x``) give
    +0.0 for code 8 where the interpreter gives -0.0."""
    sign = tl.where(negative, -2147483648, 0)
    return (mag.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _round_fp8_e4m3(s):
    """float32 -> nearest E4M3 value (float32), ties to even, saturating at 448; s >= 0."""
    a = tl.minimum(s, 448.0)
    exp = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exp = tl.maximum(exp, -6)
    step = ((exp - 3 + 127) << 23).to(tl.float32, bitcast=True)
    t = tl.math.div_rn(a, step)  # exact: division by a power of two, t < 16
    t = (t + 12582912.0) - 12582912.0  # round half to even at integer precision (|t| < 2^22)
    return t * step


@triton.jit
def _round_fp8_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    r = _round_fp8_e4m3(tl.abs(x))
    r = _signed(r, x < 0)
    tl.store(out_ptr + offs, r, mask=mask)


@triton.jit
def _quantize_kernel(w_ptr, gs_ptr, packed_ptr, scale_ptr, n_groups, BLOCK: tl.constexpr):
    groups = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    gmask = groups < n_groups
    cols = tl.arange(0, 16)
    offs = groups[:, None] * 16 + cols[None, :]
    x = tl.load(w_ptr + offs, mask=gmask[:, None], other=0.0).to(tl.float32)
    gs = tl.load(gs_ptr)
    amax = tl.max(tl.abs(x), axis=1)
    s = _round_fp8_e4m3(gs * tl.math.div_rn(amax, 6.0))
    s = tl.where(s == 0.0, 0.125, s)
    tl.store(scale_ptr + groups, s, mask=gmask)
    y = tl.math.div_rn(x, tl.math.div_rn(s, gs)[:, None])
    m = tl.abs(y)
    # ties to the even code: strict ">" where the tie rounds down, ">=" where it rounds up
    code = (
        (m > 0.25).to(tl.int32)
        + (m >= 0.75).to(tl.int32)
        + (m > 1.25).to(tl.int32)
        + (m >= 1.75).to(tl.int32)
        + (m > 2.5).to(tl.int32)
        + (m >= 3.5).to(tl.int32)
        + (m > 5.0).to(tl.int32)
    )
    code = code + tl.where(y < 0.0, 8, 0)
    lo, hi = tl.split(tl.reshape(code, (BLOCK, 8, 2)))
    byte = (lo | (hi << 4)).to(tl.uint8)
    boffs = groups[:, None] * 8 + tl.arange(0, 8)[None, :]
    tl.store(packed_ptr + boffs, byte, mask=gmask[:, None])


@triton.jit
def _fp4_magnitude(code):
    """|value| of an FP4 code; the caller applies the sign (``_signed``) after scaling."""
    mag = code & 7
    v = tl.where(mag == 1, 0.5, 0.0)
    v = tl.where(mag == 2, 1.0, v)
    v = tl.where(mag == 3, 1.5, v)
    v = tl.where(mag == 4, 2.0, v)
    v = tl.where(mag == 5, 3.0, v)
    v = tl.where(mag == 6, 4.0, v)
    v = tl.where(mag == 7, 6.0, v)
    return v


@triton.jit
def _dequantize_kernel(
    packed_ptr, scale_ptr, gs_ptr, out_ptr, n_groups, BLOCK: tl.constexpr, BF16: tl.constexpr
):
    groups = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    gmask = groups < n_groups
    boffs = groups[:, None] * 8 + tl.arange(0, 8)[None, :]
    byte = tl.load(packed_ptr + boffs, mask=gmask[:, None], other=0).to(tl.int32)
    s = tl.load(scale_ptr + groups, mask=gmask, other=0.0)
    gs = tl.load(gs_ptr)
    mult = tl.math.div_rn(s, gs)[:, None]
    # |q| * |mult|, then the product's sign (the code's XOR the multiplier's: a checkpoint's scale may
    # be negative) by an integer OR, so code 8 decodes to -0.0 as the library does
    neg_mult = mult.to(tl.int32, bitcast=True) < 0
    mag_mult = tl.abs(mult)
    lo = _signed(_fp4_magnitude(byte & 15) * mag_mult, ((byte & 8) != 0) != neg_mult)
    hi = _signed(_fp4_magnitude(byte >> 4) * mag_mult, ((byte & 128) != 0) != neg_mult)
    vals = tl.reshape(tl.join(lo, hi), (BLOCK, 16))
    if BF16:
        # round half to even to bf16 by hand: the interpreter's float32 -> bf16 cast truncates
        bits = vals.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        vals = bits.to(tl.float32, bitcast=True)
    offs = groups[:, None] * 16 + tl.arange(0, 16)[None, :]
    tl.store(out_ptr + offs, vals.to(out_ptr.dtype.element_ty), mask=gmask[:, None])


def round_fp8_e4m3_triton(x: torch.Tensor) -> torch.Tensor:
    """The kernel's FP8 rounding on a float32 tensor (exposed so tests can check it value by value)."""
    x = x.float().contiguous()
    out = torch.empty_like(x)
    n = x.numel()
    _round_fp8_kernel[(triton.cdiv(n, 1024),)](x, out, n, BLOCK=1024)
    return out


@torch.no_grad()
def quantize_nvfp4_triton(
    w: torch.Tensor, global_scale: torch.Tensor | float | None = None, name: str = "weight"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton twin of ``qerl.kernels.nvfp4_reference.quantize_nvfp4`` (same arguments, same bits)."""
    check_weight(w, name)
    gs = resolve_global_scale(w, global_scale, name)
    w = w.contiguous()
    out_f, in_f = w.shape
    n_groups = out_f * in_f // GROUP_SIZE
    packed = torch.empty(out_f, in_f // 2, dtype=torch.uint8, device=w.device)
    scale32 = torch.empty(out_f, in_f // GROUP_SIZE, dtype=torch.float32, device=w.device)
    _quantize_kernel[(triton.cdiv(n_groups, _BLOCK),)](w, gs, packed, scale32, n_groups, BLOCK=_BLOCK)
    return packed, scale32.to(torch.float8_e4m3fn), gs


@torch.no_grad()
def dequantize_nvfp4_triton(
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor | float,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Triton twin of ``qerl.kernels.nvfp4_reference.dequantize_nvfp4``."""
    out_f, in_f = check_packed(packed, scale)
    gs = torch.as_tensor(global_scale, dtype=torch.float32).reshape(1).to(packed.device)
    out = torch.empty(out_f, in_f, dtype=dtype, device=packed.device)
    n_groups = out_f * in_f // GROUP_SIZE
    scale32 = scale.float().contiguous()  # E4M3 -> float32 is exact
    _dequantize_kernel[(triton.cdiv(n_groups, _BLOCK),)](
        packed.contiguous(), scale32, gs, out, n_groups, BLOCK=_BLOCK, BF16=dtype == torch.bfloat16
    )
    return out
