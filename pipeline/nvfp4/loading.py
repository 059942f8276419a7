"""NVFP4's decoding module (``qerl.pipeline.schemes``): an NVFP4A16 checkpoint read back, for LoRA
training, as its dequantized twin's weights and as its dequantized reference.

What: ``quantized_linears`` and ``state_tensors`` read which linears a checkpoint holds quantized
(``<m>.weight_packed`` with its scales) and their shapes from the safetensors headers;
``dequantized_linears`` decodes each with ``qerl.kernels`` (the twin's and the quality report's
weights); ``load_for_training`` builds a Hugging Face causal LM from the quantize stage's
checkpoint with every quantized Linear replaced by a packed ``NVFP4Linear`` (``qerl.pipeline.nvfp4.linear``),
all parameters frozen. ``load_dequantized`` builds the same checkpoint as an ordinary HF model
whose Linear weights hold ``dequant(W)``: the independent reference the tests compare against.

How: the model skeleton is built on the meta device (``accelerate.init_empty_weights``, buffers such
as RoPE real), so the full-precision Linear weights are never materialised; the checkpoint's tensors
are then assigned in place (``load_state_dict(assign=True)``). Every quantized module name must match
a Linear of the config's shape, every model tensor must come from the checkpoint, and every checkpoint
tensor must find a place: a mismatch is an error naming the tensor, never a silently random weight.
transformers' own compressed-tensors loading is bypassed (``quantization_config`` is dropped from the
config) because it would decompress the weights.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from qerl.pipeline.nvfp4.linear import NVFP4Linear, dequantize_weight, register_with_peft
from qerl.pipeline.nvfp4.recipe import QUANT_SUFFIXES
from qerl.pipeline.nvfp4.safetensors_io import (
    TensorSpec,
    empty_model,
    finish_loading,
    iter_quantized_linears,
    read_tensors,
)
from torch import nn

log = logging.getLogger("qerl.qlinear")

__all__ = [
    "dequantized_linears",
    "load_dequantized",
    "load_for_training",
    "quantized_linear_names",
    "quantized_linears",
    "register_with_peft",
    "state_tensors",
]

_PACKED, _SCALE, _GSCALE = QUANT_SUFFIXES


def quantized_linear_names(tensors: dict[str, torch.Tensor] | list[str]) -> list[str]:
    """Module names ``X`` that have an ``X.weight_packed`` tensor."""
    suffix = "." + _PACKED
    return sorted(k[: -len(suffix)] for k in tensors if k.endswith(suffix))


def quantized_linears(specs: dict[str, TensorSpec]) -> dict[str, tuple[int, int]]:
    """Each NVFP4 linear's module name -> its unquantized [out, in] shape (two codes a byte)."""
    out_in = {name: specs[f"{name}.{_PACKED}"].shape for name in quantized_linear_names(list(specs))}
    return {name: (int(shape[0]), int(shape[1]) * 2) for name, shape in out_in.items()}


def state_tensors(specs: dict[str, TensorSpec], module: str) -> list[str]:
    """The tensors that hold NVFP4 linear ``module``: its codes first, then its block and global scales."""
    return [f"{module}.{suffix}" for suffix in QUANT_SUFFIXES if f"{module}.{suffix}" in specs]


def dequantized_linears(
    ckpt_dir: str | Path, dtype: torch.dtype = torch.float32
) -> Iterator[tuple[str, torch.Tensor]]:
    """(module, weight in ``dtype``) of every NVFP4 linear of ``ckpt_dir``, decoded by ``qerl.kernels``
    in ``dtype``, one at a time in natural module order."""
    for module, (packed, scale, gscale) in iter_quantized_linears(ckpt_dir):
        yield module, dequantize_weight(packed, scale, gscale, dtype)


def load_for_training(
    ckpt_dir: str | Path, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu"
) -> nn.Module:
    """The HF causal LM of an NVFP4A16 checkpoint with packed NVFP4Linear layers, all frozen."""
    ckpt_dir = Path(ckpt_dir)
    model = empty_model(ckpt_dir, dtype)
    tensors = read_tensors(ckpt_dir, device)
    names = quantized_linear_names(tensors)
    if not names:
        raise ValueError(f"{ckpt_dir}: no '*.{_PACKED}' tensors - not an NVFP4 checkpoint")
    for name in names:
        try:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            old = getattr(parent, child)
        except AttributeError:
            raise ValueError(
                f"{ckpt_dir}: quantized tensor '{name}.{_PACKED}' matches no module in the model"
            ) from None
        if not isinstance(old, nn.Linear):
            raise ValueError(f"{ckpt_dir}: '{name}' is a {type(old).__name__}, not a Linear")
        module = NVFP4Linear.from_tensors(
            tensors.pop(f"{name}.{_PACKED}"),
            tensors.pop(f"{name}.{_SCALE}"),
            tensors.pop(f"{name}.{_GSCALE}"),
            tensors.pop(f"{name}.bias", None),
            dtype=dtype,
            name=name,
        )
        if (module.in_features, module.out_features) != (old.in_features, old.out_features):
            raise ValueError(
                f"{ckpt_dir}: '{name}' is {module.out_features}x{module.in_features} in the checkpoint, "
                f"{old.out_features}x{old.in_features} in config.json"
            )
        setattr(parent, child, module)
    finish_loading(model, tensors, ckpt_dir, dtype)
    log.info("loaded %s: %d NVFP4 linears (packed), dtype %s", ckpt_dir, len(names), dtype)
    return model


def load_dequantized(
    ckpt_dir: str | Path, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu"
) -> nn.Module:
    """The same checkpoint as an ordinary HF model whose Linear weights hold dequant(W) in ``dtype``.

    The independent reference for tests: plain ``nn.Linear`` layers, no custom autograd.
    """
    ckpt_dir = Path(ckpt_dir)
    model = empty_model(ckpt_dir, dtype)
    tensors = read_tensors(ckpt_dir, device)
    for name in quantized_linear_names(tensors):
        tensors[f"{name}.weight"] = dequantize_weight(
            tensors.pop(f"{name}.{_PACKED}"),
            tensors.pop(f"{name}.{_SCALE}"),
            tensors.pop(f"{name}.{_GSCALE}"),
            dtype,
        )
    finish_loading(model, tensors, ckpt_dir, dtype)
    return model
