"""NVFP4 block-scale search: the same checkpoint format, block scales chosen by reconstruction error.

What: ``search_block_scales`` picks, for every 16-element block of a weight, the FP8 E4M3 block scale
with the lowest (optionally column-weighted) squared reconstruction error among a few candidates:
the absmax scale that round-to-nearest (RTN) uses, the "4 over 6" scale (the block max maps to the
FP4 value 4 instead of 6, so the block's large values land on the finer part of the grid), and the
``sweep`` neighbouring E4M3 values on either side of each. ``quantize_with_scales`` turns a weight
and given block scales into FP4 codes with exactly the reference's arithmetic
(``q = round_fp4(x / (s / gs))``), ``decode`` is ``q * (s / gs)``, and ``quantize_mse`` packs the
result into the three tensors of a compressed-tensors NVFP4A16 linear, like
``qerl.kernels.nvfp4_reference.quantize_nvfp4``.

How: everything is plain PyTorch vectorised over blocks (a ``[blocks, candidates, 16]`` temporary per
row chunk), so it runs on CPU and CUDA. Neighbouring E4M3 values are found by stepping the FP8 bit
pattern (for positive values it is monotonic in the value), clamped to [smallest subnormal, 448].
The absmax candidate comes first and a later one replaces it only when strictly better, so the
chosen scale's error is never above RTN's and an all-zero block keeps RTN's scale (0.125).

Departure and why: the global scale stays the RTN one (``2688 / amax`` of the tensor or of its fused
group, ``qerl.pipeline.nvfp4.grouping``): vLLM needs one per fused layer, and the block scales have
the freedom that matters. The codes are what RTN would give for the chosen scale, so the checkpoint
decodes with the unchanged dequantizer (and vLLM's FP4 Marlin kernel).
"""

from __future__ import annotations

import torch
from qerl.kernels.nvfp4_reference import (
    FP4_MAX,
    FP4_VALUES,
    GROUP_SIZE,
    ZERO_SCALE,
    check_weight,
    fp4_codes,
    pack_codes,
    resolve_global_scale,
    round_fp8_e4m3,
)

__all__ = [
    "absmax_scales",
    "decode",
    "quantize_mse",
    "quantize_with_scales",
    "fp4_lut",
    "scale_candidates",
    "search_block_scales",
]

_E4M3_MAX_BITS = 0x7E  # 448; 0x7F is NaN in float8_e4m3fn
CHUNK_ELEMENTS = 1 << 20


def _lut(device: torch.device) -> torch.Tensor:
    mags = torch.tensor(FP4_VALUES, dtype=torch.float32, device=device)
    return torch.cat((mags, -mags))


def absmax_scales(x: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    """RTN's block scales of ``x [rows, blocks, 16]`` (float32 E4M3 values, zero -> 0.125)."""
    s = round_fp8_e4m3(gs * (x.abs().amax(dim=-1) / FP4_MAX))
    return torch.where(s == 0, torch.full_like(s, ZERO_SCALE), s)


def _step_e4m3(s: torch.Tensor, k: int) -> torch.Tensor:
    """The E4M3 value ``k`` representable steps from ``s`` (positive E4M3 values), clamped."""
    bits = s.to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int16) + k
    bits = bits.clamp(1, _E4M3_MAX_BITS).to(torch.uint8)
    return bits.view(torch.float8_e4m3fn).float()


def scale_candidates(x: torch.Tensor, gs: torch.Tensor, sweep: int = 2) -> torch.Tensor:
    """Candidate scales ``[rows, blocks, C]``: absmax first, then 4-over-6, then ``sweep`` E4M3
    neighbours on each side of both (duplicates are harmless: ties keep the earlier one)."""
    absmax = absmax_scales(x, gs)
    four = round_fp8_e4m3(gs * (x.abs().amax(dim=-1) / 4.0)).clamp(min=2.0**-9)
    cands = [absmax, four]
    for k in range(1, sweep + 1):
        for base in (absmax, four):
            cands += [_step_e4m3(base, -k), _step_e4m3(base, k)]
    return torch.stack(cands, dim=-1)


def quantize_with_scales(
    x: torch.Tensor, scales: torch.Tensor, gs: torch.Tensor, boundaries: torch.Tensor | None = None
) -> torch.Tensor:
    """FP4 codes (uint8, ``x``'s shape ``[..., blocks, 16]``) of ``x`` under the given block scales
    (``[..., blocks]``), with the reference's operation order. ``boundaries``: ``fp4_boundaries`` of
    ``x``'s device, made once by a caller that calls this per column (GPTQ)."""
    return fp4_codes(x.float() / (scales / gs.to(scales.device)).unsqueeze(-1), boundaries)


def decode(
    codes: torch.Tensor, scales: torch.Tensor, gs: torch.Tensor, lut: torch.Tensor | None = None
) -> torch.Tensor:
    """``q * (s / gs)`` in float32: the values a checkpoint holding these codes dequantizes to.
    ``lut``: ``fp4_lut`` of the codes' device, made once by a caller that calls this per column."""
    # gs may stay on the CPU while the codes are on the GPU (GPTQ keeps the checkpoint's copy there)
    lut = _lut(codes.device) if lut is None else lut
    return lut[codes.long()] * (scales / gs.to(scales.device)).unsqueeze(-1)


def fp4_lut(device: torch.device) -> torch.Tensor:
    """Code -> E2M1 value (codes 8..15 negative), on ``device``."""
    return _lut(device)


# E2M1 rounding as a sum of steps: |y| passes boundary b -> the value grows by the step there
_STEPS = ((0.25, 0.5), (0.75, 0.5), (1.25, 0.5), (1.75, 0.5), (2.5, 1.0), (3.5, 1.0), (5.0, 2.0))


def _round_fp4_value(y: torch.Tensor) -> torch.Tensor:
    """The E2M1 value nearest ``y`` (clamped to +-6). A tie may go either way: both neighbours are
    equally far, so the squared error - all the search uses it for - is the same; the codes written
    come from the reference's ``fp4_codes`` (ties to even). Comparisons, not ``bucketize``: ~5x faster
    on a CPU."""
    a = y.abs()
    q = torch.zeros_like(a)
    for bound, step in _STEPS:
        q += (a > bound) * step
    return torch.copysign(q, y)


def search_block_scales(
    x: torch.Tensor,
    gs: torch.Tensor,
    sweep: int = 2,
    col_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """The best candidate scale per block of ``x [rows, blocks, 16]`` (float32 E4M3 values).

    The error is ``sum_j w_j (x_j - decode_j)^2`` over a block's 16 columns, ``w = col_weight``
    (``[blocks, 16]``; all ones when None). Ties keep the earlier candidate, so absmax (RTN) wins a tie.
    """
    x = x.float()
    cands = scale_candidates(x, gs, sweep)  # [r, b, C]
    xc = x.unsqueeze(-2)  # [r, b, 1, 16]
    mult = (cands / gs).unsqueeze(-1)
    err = (_round_fp4_value(xc / mult) * mult - xc) ** 2
    if col_weight is not None:
        err = err * col_weight.float().unsqueeze(-2)
    err = err.sum(dim=-1)  # [r, b, C]
    # argmin returns the first minimum: the absmax candidate wins ties
    best = err.argmin(dim=-1, keepdim=True)
    return cands.gather(-1, best).squeeze(-1)


@torch.no_grad()
def quantize_mse(
    w: torch.Tensor,
    global_scale: torch.Tensor | float | None = None,
    name: str = "weight",
    sweep: int = 2,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantize_nvfp4`` with block scales from ``search_block_scales``: (packed, scale, global scale)."""
    check_weight(w, name)
    gs = resolve_global_scale(w, global_scale, name)
    out_f, in_f = w.shape
    packed = torch.empty(out_f, in_f // 2, dtype=torch.uint8, device=w.device)
    scale = torch.empty(out_f, in_f // GROUP_SIZE, dtype=torch.float8_e4m3fn, device=w.device)
    # the candidate temporaries are (2 + 4 * sweep) times a chunk's size
    step = max(1, chunk_elements // max(1, in_f * (2 + 4 * sweep)))
    for r0 in range(0, out_f, step):
        x = w[r0 : r0 + step].float().reshape(-1, in_f // GROUP_SIZE, GROUP_SIZE)
        s = search_block_scales(x, gs, sweep)
        codes = quantize_with_scales(x, s, gs).reshape(x.shape[0], in_f)
        packed[r0 : r0 + step] = pack_codes(codes)
        scale[r0 : r0 + step] = s.to(torch.float8_e4m3fn)  # exact: s is an E4M3 value
    return packed, scale, gs
