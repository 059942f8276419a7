"""GPTQ in the NVFP4 grid: error-compensating quantization of one weight given its input Hessian.

What: ``gptq_nvfp4(w, H, gs)`` returns FP4 codes and FP8 E4M3 block scales for ``w [out, in]`` that
minimise ``||X (W - Q)^T||^2`` greedily, as GPTQ (Frantar et al., 2022) does: columns are quantized
one at a time and each column's error, scaled by the inverse-Hessian Cholesky factor, is pushed
onto the columns not yet quantized. ``H = 2 X^T X / n`` comes from calibration activations
(``qerl.pipeline.nvfp4.calibration``), damped by ``damp * mean(diag H)``. The codes decode with the
unchanged NVFP4 dequantizer to exactly the values GPTQ chose (``scale_search.decode``).

How, and where it departs from the paper's integer-grid GPTQ:

* the grid is NVFP4's: a 16-column block shares one FP8 block scale and the tensor (or fused
  group) one global scale, the RTN one. A block's scales are fixed when GPTQ reaches the block's
  first column, from the current, error-updated weights of its 16 columns; ``scale_search`` picks
  them: ``absmax`` (RTN's rule), ``mse`` (weight error) or ``hessian`` (error weighted per column
  by ``1 / U_jj^2``, GPTQ's own cost of an error in column j, U the Cholesky factor of H^-1).
* ``act_order`` processes columns by decreasing ``diag(H)``; a block then has no single "start",
  so its scales are chosen up front from the original weights (static groups, as AutoGPTQ does).
* columns whose input is always zero (``diag(H) == 0``) keep their weights (RTN there), instead of
  being zeroed as the reference implementation does: a zero column on the calibration text need
  not be zero on the run's prompts.
* Lazy batch updates (``block`` columns at a time) as in the paper, all float32.
"""

from __future__ import annotations

import torch
from qerl.kernels.nvfp4_reference import GROUP_SIZE, NVFP4Error, fp4_boundaries
from qerl.pipeline.nvfp4.scale_search import (
    absmax_scales,
    decode,
    fp4_lut,
    quantize_with_scales,
    search_block_scales,
)

__all__ = ["SCALE_RULES", "gptq_nvfp4", "inverse_hessian_factor"]

SCALE_RULES = ("absmax", "mse", "hessian")


def inverse_hessian_factor(h: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor U of ``(H + damp * mean(diag H) I)^-1`` (dead inputs get diag 1).

    Float64 for the factorisations; each intermediate is dropped as soon as the next exists, so at
    most two ``in x in`` float64 matrices are alive at once (down_proj of a 7B model: in = 18944,
    2.9 GB each), where keeping every step's result would hold four."""
    h = h.to(torch.float64, copy=True)
    diag = torch.diagonal(h)
    diag[diag == 0] = 1.0
    diag += damp * diag.mean()
    try:
        factor = torch.linalg.cholesky(h)
    except torch.linalg.LinAlgError as err:
        raise NVFP4Error(
            f"the calibration Hessian is not positive definite with damp={damp}; raise "
            "quantize.calibration.damp or calibrate on more tokens"
        ) from err
    del h, diag
    factor = torch.cholesky_inverse(factor)  # H^-1; the lower factor is freed on reassignment
    factor = torch.linalg.cholesky(factor, upper=True)
    return factor.float()


def _block_scales(
    w: torch.Tensor, gs: torch.Tensor, rule: str, col_weight: torch.Tensor | None, sweep: int
) -> torch.Tensor:
    """Scales ``[out, n_blocks]`` for ``w [out, n_blocks * 16]`` under ``rule``."""
    x = w.reshape(w.shape[0], -1, GROUP_SIZE)
    if rule == "absmax":
        return absmax_scales(x, gs)
    weight = col_weight.reshape(-1, GROUP_SIZE) if rule == "hessian" else None
    return search_block_scales(x, gs, sweep, weight)


@torch.no_grad()
def gptq_nvfp4(
    w: torch.Tensor,
    h: torch.Tensor,
    gs: torch.Tensor,
    damp: float = 0.01,
    act_order: bool = False,
    scale_rule: str = "hessian",
    sweep: int = 2,
    block: int = 128,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ-quantize ``w [out, in]`` with input Hessian ``h [in, in]`` and global scale ``gs``.

    Returns (codes uint8 ``[out, in]``, block scales float32 E4M3 values ``[out, in/16]``), in the
    original column order; ``decode(codes, scales, gs)`` is the quantized weight.
    """
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"unknown GPTQ scale rule '{scale_rule}'; valid: {', '.join(SCALE_RULES)}")
    out_f, in_f = w.shape
    if in_f % GROUP_SIZE or tuple(h.shape) != (in_f, in_f):
        raise NVFP4Error(
            f"GPTQ needs in % 16 == 0 and H of shape {(in_f, in_f)}; got W {tuple(w.shape)}, H {tuple(h.shape)}"
        )
    w = w.float().clone()
    gs = gs.float().reshape(1).to(w.device)
    perm = torch.argsort(torch.diagonal(h), descending=True, stable=True) if act_order else None
    u_full = inverse_hessian_factor(h if perm is None else h[perm][:, perm], damp)
    cost = 1.0 / torch.diagonal(u_full) ** 2  # the cost of a unit error in column j (GPTQ's w^2/[H^-1]_jj)
    n_blocks = in_f // GROUP_SIZE
    scales = torch.empty(out_f, n_blocks, dtype=torch.float32, device=w.device)
    if perm is not None:  # static groups: every block's scales from the original weights
        col_cost = torch.empty_like(cost)
        col_cost[perm] = cost
        scales[:] = _block_scales(w, gs, scale_rule, col_cost, sweep)
        w = w[:, perm]
        order = perm
    else:
        order = torch.arange(in_f, device=w.device)
    codes = torch.empty(out_f, in_f, dtype=torch.uint8, device=w.device)
    # made once, not per column: on a GPU each would be a host copy, and order[col] a host sync
    bounds, lut, order_host = fp4_boundaries(w.device), fp4_lut(w.device), order.tolist()
    for b0 in range(0, in_f, block):
        b1 = min(b0 + block, in_f)
        w1 = w[:, b0:b1].clone()
        err1 = torch.zeros_like(w1)
        u1 = u_full[b0:b1, b0:b1]
        for i in range(b1 - b0):
            col = b0 + i
            if perm is None and col % GROUP_SIZE == 0:  # a block starts: fix its scales now
                g = col // GROUP_SIZE
                scales[:, g] = _block_scales(
                    w1[:, i : i + GROUP_SIZE], gs, scale_rule, cost[col : col + GROUP_SIZE], sweep
                ).squeeze(-1)
            orig = order_host[col]
            s = scales[:, orig // GROUP_SIZE]
            x = w1[:, i]
            c = quantize_with_scales(x.reshape(-1, 1, 1), s.reshape(-1, 1), gs, bounds).reshape(-1)
            q = decode(c.reshape(-1, 1, 1), s.reshape(-1, 1), gs, lut).reshape(-1)
            codes[:, orig] = c
            e = (x - q) / u1[i, i]
            w1[:, i:] -= e.unsqueeze(1) * u1[i, i:].unsqueeze(0)
            err1[:, i] = e
        w[:, b1:] -= err1 @ u_full[b0:b1, b1:]
    return codes, scales
