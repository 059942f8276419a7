"""The NVFP4 base for LoRA training: a linear layer that keeps its weight packed (4.5 bits/weight).

What: ``NVFP4Linear`` holds a compressed-tensors NVFP4 weight as buffers (``weight_packed`` uint8
[out, in/2], ``weight_scale`` FP8 E4M3 [out, in/16], ``weight_global_scale`` fp32 [1]) plus an
optional bias, and computes ``x @ dequant(W).T + b``. ``qerl.pipeline.nvfp4.loading`` puts one in place
of every quantized Linear of a checkpoint's model.

How: a custom autograd Function decodes the weight straight into the activation dtype, uses the dense
tile for one GEMM and drops it; backward decodes again for ``grad_input = grad_out @ W``. Only the
packed buffers are saved for backward, so no dequantized copy of the base lives between forward and
backward (the QLoRA trade: one extra decode per layer per step for ~3.5x less base-weight memory). On
CPU the decode is the numba kernel (``qerl.kernels.nvfp4_dispatch.dequantize``, backend logged once),
several times faster than the torch reference, written into a per-thread scratch buffer reused by
every layer; a layer larger than ``slice_elements(device)`` is decoded and multiplied in slices (output
rows in forward, 16-aligned input columns in backward, so every output element is still one dot
product in one GEMM), so the dense weight alive at any time is at most one slice: 16 MiB on the CPU,
whole layers on CUDA (see ``slice_elements`` for why). The base takes no gradient: its tensors are
buffers, never parameters. peft's LoRA wraps the module through peft's custom-module registry
(``register_with_peft``) using peft's own ``lora.Linear``, so saved adapters are ordinary peft adapters
(same keys and config as for an ``nn.Linear`` base).

Departures: the paper's trainer uses a fused Marlin-style FP4 GEMM; here the dequantizer is numba on
CPU (the PyTorch reference if numba is missing) and qerl.kernels.nvfp4_triton's Triton dequantizer on GPU,
with a dense matmul after, so the fast paths save memory but not FLOPs. The weight is dequantized to
the activation dtype, which is exactly what a bf16 model loaded with the dequantized weights holds
(see ``qerl.pipeline.nvfp4.loading.load_dequantized``).
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from qerl.kernels import nvfp4_dispatch
from qerl.kernels.nvfp4_reference import GROUP_SIZE
from qerl.pipeline.nvfp4.recipe import QUANT_SUFFIXES
from torch import nn

__all__ = ["NVFP4Linear", "dequantize_weight", "register_with_peft", "slice_elements"]

_PACKED, _SCALE, _GSCALE = QUANT_SUFFIXES


# Dense elements of one dequantized weight slice, per device type (``slice_elements``). A layer larger
# than this is decoded and multiplied slice by slice, so the transient dense weight per layer is at most
# one slice. CPU: 16 MiB in bf16 (a 7B MLP projection, 68M elements, takes 9 slices; every projection of
# a 0.5B model fits in one). CUDA: 512 MiB in bf16, i.e. every projection up to 72B in one GEMM.
CHUNK_ELEMENTS = 1 << 23
CHUNK_ELEMENTS_CUDA = 1 << 28


def slice_elements(device: torch.device | str) -> int:
    """Largest dense weight slice decoded at once on ``device`` (by ``device.type``: "cuda", else CPU's).

    Why they differ: on the CPU the decoded slice lives in a per-thread scratch buffer that stays
    resident for the whole run, so it is capped at 16 MiB. That costs speed on a layer above the cap
    (sliced GEMMs are slower than one whole GEMM, the narrow column slices of backward most), but
    every projection of the models a CPU trains here (0.5B: at most 4864 x 896) fits one slice. On a GPU the dense tile is a transient of the caching allocator, a few hundred MB
    at most (Qwen2.5-32B's largest projection, 27648 x 5120, is 283 MB in bf16), and slicing would
    turn a 7B MLP projection into 9 narrow GEMMs (each with its own dequantizer launch) and write each
    backward slice into a strided view of ``grad_input``. So CUDA decodes whole layers: every
    projection of the catalogue's models, up to 72B's 29568 x 8192, is below ``1 << 28``.
    """
    return CHUNK_ELEMENTS_CUDA if torch.device(device).type == "cuda" else CHUNK_ELEMENTS


_scratch = threading.local()


def dequantize_weight(
    packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Dense [out, in] weight via ``qerl.kernels.nvfp4_dispatch.dequantize`` (Triton on CUDA, numba on CPU;
    logged)."""
    return nvfp4_dispatch.dequantize(packed, scale, global_scale, dtype=dtype)


def _decode(
    packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Dense ``[rows, cols]`` of a (possibly column-sliced) packed weight, for one GEMM only.

    On CPU it is written into a per-thread scratch buffer reused by every layer and every call: a
    fresh multi-MB tensor per decode costs page faults (glibc hands large blocks back to the kernel)
    and fragments the heap, while the decoded weight is dead as soon as its GEMM returns. The caller
    must not keep the result. On CUDA the Triton dequantizer's own output is used (caching allocator).
    """
    rows, cols = packed.shape[0], packed.shape[1] * 2
    if packed.device.type != "cpu":
        return dequantize_weight(packed, scale, global_scale, dtype)
    bufs: dict[torch.dtype, torch.Tensor] = getattr(_scratch, "bufs", None) or {}
    _scratch.bufs = bufs
    buf = bufs.get(dtype)
    if buf is None or buf.numel() < rows * cols:
        buf = bufs[dtype] = torch.empty(rows * cols, dtype=dtype)
    return nvfp4_dispatch.dequantize(
        packed, scale, global_scale, dtype, out=buf[: rows * cols].view(rows, cols)
    )


def _chunk(total: int, other: int, align: int, chunk_elements: int) -> int:
    """Slice length along a dimension of ``total`` so that ``slice * other <= chunk_elements`` (up to
    ``align``), with the slices of equal size: a small remainder slice would make a skinny, slow GEMM."""
    n_slices = max(1, -(-total * other // chunk_elements))
    per = -(-total // n_slices)
    return min(total, -(-per // align) * align)


def _linear_forward(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor,
    bias: torch.Tensor | None,
    chunk_elements: int,
) -> torch.Tensor:
    """``x @ W.T + b``; ``W`` decoded in output-row slices written straight into ``y``'s columns.

    Each output element is still one full dot product over ``in`` inside one GEMM (``addmm``, as
    ``F.linear`` lowers to), so slicing changes no reduction order; a layer that fits one slice uses
    ``F.linear`` itself, the exact op of a dense bf16 model.
    """
    out_f, in_f = packed.shape[0], packed.shape[1] * 2
    rows = _chunk(out_f, in_f, 1, chunk_elements)
    if rows >= out_f:
        return F.linear(x, _decode(packed, scale, global_scale, x.dtype), bias)
    x2 = x.reshape(-1, in_f)
    y = torch.empty(x2.shape[0], out_f, dtype=x.dtype, device=x.device)
    for r0 in range(0, out_f, rows):
        r1 = min(out_f, r0 + rows)
        w = _decode(packed[r0:r1], scale[r0:r1], global_scale, x.dtype)
        if bias is None:
            torch.mm(x2, w.t(), out=y[:, r0:r1])
        else:
            torch.addmm(bias[r0:r1], x2, w.t(), out=y[:, r0:r1])
    return y.reshape(*x.shape[:-1], out_f)


def _linear_grad_input(
    grad_out: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor,
    chunk_elements: int,
) -> torch.Tensor:
    """``grad_out @ W``; ``W`` decoded in input-column slices (multiples of the 16-wide block).

    Slicing ``W``'s columns (not its rows) keeps every output element a single full dot product over
    ``out`` in one GEMM: no partial sums are rounded to bf16 and added across slices, so the result is
    the dense model's ``grad_out @ W``. Each slice's GEMM writes straight into ``grad_input``'s columns.
    """
    out_f, in_f = packed.shape[0], packed.shape[1] * 2
    cols = _chunk(in_f, out_f, GROUP_SIZE, chunk_elements)
    dtype = grad_out.dtype
    if cols >= in_f:
        return grad_out.matmul(_decode(packed, scale, global_scale, dtype))
    g2 = grad_out.reshape(-1, out_f)
    grad_in = torch.empty(g2.shape[0], in_f, dtype=dtype, device=grad_out.device)
    for c0 in range(0, in_f, cols):
        c1 = min(in_f, c0 + cols)
        blocks = slice(c0 // GROUP_SIZE, c1 // GROUP_SIZE)
        w = _decode(packed[:, c0 // 2 : c1 // 2], scale[:, blocks], global_scale, dtype)
        torch.mm(g2, w, out=grad_in[:, c0:c1])
    return grad_in.reshape(*grad_out.shape[:-1], in_f)


class _NVFP4LinearFn(torch.autograd.Function):
    """y = x W^T + b with W dequantized on the fly (in slices) in forward and again in backward."""

    @staticmethod
    def forward(ctx, x, packed, scale, global_scale, bias, chunk_elements):  # noqa: ANN001, ANN205
        ctx.save_for_backward(packed, scale, global_scale)
        ctx.chunk_elements = chunk_elements
        return _linear_forward(x, packed, scale, global_scale, bias, chunk_elements)

    @staticmethod
    def backward(ctx, grad_out):  # noqa: ANN001, ANN205
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None, None
        packed, scale, global_scale = ctx.saved_tensors
        grad_in = _linear_grad_input(grad_out, packed, scale, global_scale, ctx.chunk_elements)
        return grad_in, None, None, None, None, None


class NVFP4Linear(nn.Module):
    """A frozen Linear whose weight stays NVFP4-packed; LoRA (peft) trains on top of it."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        if in_features % 16:
            raise ValueError(f"NVFP4Linear needs in_features divisible by 16, got {in_features}")
        self.in_features, self.out_features = in_features, out_features
        self.compute_dtype = dtype
        self.register_buffer(
            _PACKED, torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device)
        )
        self.register_buffer(
            _SCALE, torch.zeros(out_features, in_features // 16, dtype=torch.float8_e4m3fn, device=device)
        )
        self.register_buffer(_GSCALE, torch.ones(1, dtype=torch.float32, device=device))
        self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device) if bias else None)

    @classmethod
    def from_tensors(
        cls,
        packed: torch.Tensor,
        scale: torch.Tensor,
        global_scale: torch.Tensor,
        bias: torch.Tensor | None = None,
        dtype: torch.dtype = torch.bfloat16,
        name: str = "<linear>",
    ) -> NVFP4Linear:
        """Wrap existing packed tensors (shapes and dtypes checked; ``name`` is used in errors)."""
        out_features, half_in = packed.shape
        expected = {
            _PACKED: (packed, torch.uint8, (out_features, half_in)),
            _SCALE: (scale, torch.float8_e4m3fn, (out_features, half_in * 2 // 16)),
            _GSCALE: (global_scale, torch.float32, (1,)),
        }
        for suffix, (tensor, dtype_, shape) in expected.items():
            if tensor.dtype != dtype_ or tuple(tensor.shape) != shape:
                raise ValueError(
                    f"{name}.{suffix}: expected {dtype_} {shape}, got {tensor.dtype} {tuple(tensor.shape)}"
                )
        if bias is not None and tuple(bias.shape) != (out_features,):
            raise ValueError(f"{name}.bias: expected shape ({out_features},), got {tuple(bias.shape)}")
        module = cls(half_in * 2, out_features, bias=bias is not None, dtype=dtype, device="meta")
        module.weight_packed = packed
        module.weight_scale = scale
        module.weight_global_scale = global_scale
        module.bias = None if bias is None else bias.to(dtype)
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return _NVFP4LinearFn.apply(
            x, self.weight_packed, self.weight_scale, self.weight_global_scale, bias, slice_elements(x.device)
        )

    @property
    def qweight(self) -> torch.Tensor:
        """The packed codes under the name peft probes to find a quantized layer's device."""
        return self.weight_packed

    def dequantized(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize_weight(
            self.weight_packed, self.weight_scale, self.weight_global_scale, dtype or self.compute_dtype
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )


def register_with_peft(lora_config) -> None:  # noqa: ANN001
    """Let peft wrap NVFP4Linear with its ordinary ``lora.Linear`` (the base is only called, never merged)."""
    from peft.tuners.lora import Linear as LoraLinear

    lora_config._register_custom_module({NVFP4Linear: LoraLinear})
