"""NF4's decoding module (``qerl.pipeline.schemes``): an NF4 checkpoint's weights as bitsandbytes
dequantizes them.

What: ``quantized_linears`` and ``state_tensors`` read which linears a checkpoint holds in NF4 and
their unquantized shapes from the file (the shape is in each linear's quantization state, not in its
packed ``[numel/2, 1]`` codes); ``dequantized_linears`` streams each NF4 linear's weight as
bitsandbytes' own ``dequantize_4bit`` computes it, one linear at a time (the dequantize stage's twin
and the quality report read it); ``load_dequantized`` is the whole model with plain ``nn.Linear``
layers holding those values, the independent reference.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from qerl.pipeline.nf4.checkpoint import STATE_SUFFIX, nf4_linears, nf4_shape
from qerl.pipeline.nvfp4.safetensors_io import (
    TensorSpec,
    empty_model,
    finish_loading,
    read_tensor,
    read_tensors,
    safetensors_index,
)
from torch import nn

__all__ = ["dequantized_linears", "load_dequantized", "quantized_linears", "state_tensors"]


def quantized_linears(specs: dict[str, TensorSpec]) -> dict[str, tuple[int, ...]]:
    """Each NF4 linear's module name -> its unquantized weight shape (from its quantization state)."""
    return {module: nf4_shape(specs, module) for module in nf4_linears(specs)}


def state_tensors(specs: dict[str, TensorSpec], module: str) -> list[str]:
    """The tensors that hold NF4 linear ``module``: its codes first, then every part of its quantization state."""
    return [f"{module}.weight", *sorted(k for k in specs if k.startswith(f"{module}.weight."))]


def _bnb_state(specs: dict[str, TensorSpec], module: str) -> Any:
    from bitsandbytes.functional import QuantState

    prefix = f"{module}.weight."
    parts = {k[len(prefix) :]: read_tensor(s) for k, s in specs.items() if k.startswith(prefix)}
    return QuantState.from_dict(parts, device=torch.device("cpu"))


def dequantized_linears(
    ckpt_dir: str | Path, dtype: torch.dtype = torch.float32
) -> Iterator[tuple[str, torch.Tensor]]:
    """(module, weight in ``dtype``) of every NF4 linear of ``ckpt_dir``, as bitsandbytes dequantizes
    it, read from the file one linear at a time, on the CPU."""
    from bitsandbytes.functional import dequantize_4bit

    specs = safetensors_index(ckpt_dir)
    names = nf4_linears(specs)
    if not names:
        raise ValueError(f"{ckpt_dir}: no '*.weight.{STATE_SUFFIX}' tensors - not an NF4 checkpoint")
    for module in names:
        state = _bnb_state(specs, module)
        yield module, dequantize_4bit(read_tensor(specs[f"{module}.weight"]), state).to(dtype)


def load_dequantized(ckpt_dir: str | Path, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The NF4 checkpoint as an ordinary HF model whose NF4 linears hold their dequantized values."""
    ckpt_dir = Path(ckpt_dir)
    model = empty_model(ckpt_dir, dtype)
    weights = dict(dequantized_linears(ckpt_dir, dtype))
    tensors = {
        k: v
        for k, v in read_tensors(ckpt_dir, "cpu").items()
        if not any(k.startswith(f"{m}.weight.") for m in weights)
    }
    tensors.update({f"{m}.weight": w for m, w in weights.items()})
    finish_loading(model, tensors, ckpt_dir, dtype)
    return model
