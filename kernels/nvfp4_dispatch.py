"""NVFP4 quantize/dequantize on any device: picks the fastest implementation that matches the spec.

What: ``quantize`` and ``dequantize`` take the arguments of ``qerl.kernels.nvfp4_reference.quantize_nvfp4``
/ ``dequantize_nvfp4`` (the specification) and run the Triton kernels (``qerl.kernels.nvfp4_triton``)
on CUDA tensors, the fused numba loops (``qerl.kernels.nvfp4_numba``) on CPU, and the reference itself
on CPU without numba. Every backend is bit-identical to the reference; ``quantize_backend`` /
``dequantize_backend`` say which one a device gets, and the choice is logged (a dequantize backend once
per process, at INFO), never silent.

How: the backends are imported lazily (numba and Triton cost seconds to import). The numba quantizer
is driven here in row chunks: with a shared global scale (a fused q/k/v or gate/up group) it skips the
amax pass and the kernel counts non-finite inputs instead; a nonzero count reruns the amax pass, which
raises naming the row and column. The numba dequantizer writes float32 or bfloat16; any other dtype
is decoded to float32 and rounded once, as the reference does.
"""

from __future__ import annotations

import logging

import torch
from qerl.kernels.nvfp4_reference import (
    CHUNK_ELEMENTS,
    GROUP_SIZE,
    NVFP4Error,
    check_global_scale,
    check_packed,
    check_weight,
    dequantize_nvfp4,
    quantize_nvfp4,
    resolve_global_scale,
    tensor_amax,
)

__all__ = ["dequantize", "dequantize_backend", "quantize", "quantize_backend"]

log = logging.getLogger("qerl.kernels.nvfp4")  # the NVFP4 kernels' log name, which run logs show


def quantize_backend(device: torch.device | str) -> str:
    """Which implementation ``quantize`` uses on ``device``: "triton", "numba" or "torch"."""
    if torch.device(device).type == "cuda":
        return "triton"
    from qerl.kernels import nvfp4_numba

    return "numba" if nvfp4_numba.available() else "torch"


@torch.no_grad()
def _quantize_numba(
    w: torch.Tensor, gs: torch.Tensor | float | None, name: str, chunk_elements: int = CHUNK_ELEMENTS
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from qerl.kernels import nvfp4_numba

    check_weight(w, name)
    if gs is None:
        gs_t = resolve_global_scale(w, gs, name)  # the amax pass also rejects NaN/Inf
    else:  # a shared global scale: skip the amax pass, the kernel counts non-finite inputs instead
        gs_t = torch.as_tensor(gs, dtype=torch.float32).reshape(1).cpu()
        check_global_scale(gs_t, name)
    out_f, in_f = w.shape
    packed = torch.empty(out_f, in_f // 2, dtype=torch.uint8)
    scale32 = torch.empty(out_f, in_f // GROUP_SIZE, dtype=torch.float32)
    step = max(1, chunk_elements // max(1, in_f))
    bad = 0
    for r0 in range(0, out_f, step):
        rows = slice(r0, r0 + step)
        bad += nvfp4_numba.quantize_rows(w[rows].float(), gs_t.item(), packed[rows], scale32[rows])
    if bad:
        tensor_amax(w, name)  # raises with the row and column
    return packed, scale32.to(torch.float8_e4m3fn), gs_t


def quantize(
    w: torch.Tensor, gs: torch.Tensor | float | None = None, name: str = "weight"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize with the fastest exact implementation for ``w``'s device (see ``quantize_backend``).

    Triton on CUDA tensors, the fused numba loop on CPU, the torch reference on CPU without numba.
    Every backend is bit-identical to ``quantize_nvfp4``; the choice is logged, not silent.
    """
    backend = quantize_backend(w.device)
    log.debug("nvfp4 quantize %s %s: %s backend", name, tuple(w.shape), backend)
    if backend == "triton":
        from qerl.kernels import nvfp4_triton

        return nvfp4_triton.quantize_nvfp4_triton(w, gs, name=name)
    if backend == "numba":
        return _quantize_numba(w, gs, name)
    return quantize_nvfp4(w, gs, name=name)


def dequantize_backend(device: torch.device | str) -> str:
    """Which implementation ``dequantize`` uses on ``device``: "triton", "numba" or "torch"."""
    if torch.device(device).type == "cuda":
        return "triton"
    if torch.device(device).type != "cpu":
        return "torch"
    from qerl.kernels import nvfp4_numba

    return "numba" if nvfp4_numba.available() else "torch"


_logged_backends: set[tuple[str, str]] = set()


def _log_backend(op: str, backend: str) -> None:
    """Log each (operation, backend) once at INFO, so a run's log says which path ran without
    flooding it (the training layer dequantizes several times per layer per step)."""
    if (op, backend) not in _logged_backends:
        _logged_backends.add((op, backend))
        log.info("nvfp4 %s: %s backend", op, backend)


@torch.no_grad()
def dequantize(
    packed: torch.Tensor,
    scale: torch.Tensor,
    gs: torch.Tensor | float,
    dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dequantize with the fastest exact implementation for ``packed``'s device (``dequantize_backend``).

    Triton on CUDA tensors, the numba loop on CPU, the torch reference on CPU without numba; all are
    bit-identical to ``dequantize_nvfp4``. ``packed``/``scale`` may be column slices of a weight (a
    multiple of 16 columns); ``out`` (contiguous, ``dtype``, ``[out, in]``) is written in place when
    given, so a caller decoding a weight chunk by chunk reuses one buffer. The backend is logged.
    """
    out_f, in_f = check_packed(packed, scale, out, dtype)
    backend = dequantize_backend(packed.device)
    _log_backend("dequantize", backend)
    if backend == "numba":
        from qerl.kernels import nvfp4_numba

        if scale.dtype != torch.float8_e4m3fn:  # the kernel decodes the FP8 bytes itself
            raise NVFP4Error(f"weight_scale must be float8_e4m3fn, got {scale.dtype}")

        gs_f = float(torch.as_tensor(gs, dtype=torch.float32).reshape(1)[0])
        if dtype in (torch.float32, torch.bfloat16):
            return nvfp4_numba.dequantize_into(
                packed, scale, gs_f, out if out is not None else torch.empty(out_f, in_f, dtype=dtype)
            )
        # other dtypes: float32 from the kernel, then the reference's single rounding to dtype
        dense = nvfp4_numba.dequantize_into(
            packed, scale, gs_f, torch.empty(out_f, in_f, dtype=torch.float32)
        )
        return dense.to(dtype) if out is None else out.copy_(dense)
    if backend == "triton":
        from qerl.kernels import nvfp4_triton

        dense = nvfp4_triton.dequantize_nvfp4_triton(packed, scale, gs, dtype=dtype)
    else:
        dense = dequantize_nvfp4(packed, scale, gs, dtype=dtype)
    return dense if out is None else out.copy_(dense)
