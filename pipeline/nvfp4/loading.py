"""Loading an NVFP4A16 checkpoint for LoRA training, and its dequantized reference.

What: ``load_quantized_for_training`` builds a Hugging Face causal LM from the quantize stage's
checkpoint with every quantized Linear replaced by a packed ``NVFP4Linear`` (``qerl.pipeline.nvfp4.linear``),
all parameters frozen. ``load_dequantized_reference`` builds the same checkpoint as an ordinary HF model
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

import json
import logging
from pathlib import Path

import torch
from qerl.pipeline.nvfp4.linear import NVFP4Linear, dequantize_weight
from qerl.pipeline.nvfp4.recipe import QUANT_SUFFIXES
from safetensors import safe_open
from torch import nn

log = logging.getLogger("qerl.qlinear")

__all__ = ["load_dequantized_reference", "load_quantized_for_training", "quantized_linear_names"]

_PACKED, _SCALE, _GSCALE = QUANT_SUFFIXES


def _weight_files(ckpt_dir: Path) -> list[Path]:
    index = ckpt_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [ckpt_dir / s for s in shards]
    single = ckpt_dir / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {ckpt_dir}")
    return [single]


def read_tensors(ckpt_dir: Path, device: torch.device | str) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in _weight_files(ckpt_dir):
        with safe_open(str(path), framework="pt", device=str(device)) as fh:
            for key in fh.keys():  # noqa: SIM118 - safe_open has no __iter__
                tensors[key] = fh.get_tensor(key)
    return tensors


def quantized_linear_names(tensors: dict[str, torch.Tensor] | list[str]) -> list[str]:
    """Module names ``X`` that have an ``X.weight_packed`` tensor."""
    suffix = "." + _PACKED
    return sorted(k[: -len(suffix)] for k in tensors if k.endswith(suffix))


def empty_model(ckpt_dir: Path, dtype: torch.dtype):  # noqa: ANN202
    """The HF model skeleton: parameters on meta (no allocation), buffers such as RoPE real."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(ckpt_dir)
    if hasattr(config, "quantization_config"):
        # We load the packed tensors ourselves; transformers must not apply compressed-tensors.
        del config.quantization_config
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.config._name_or_path = str(ckpt_dir)
    return model


def finish_loading(
    model: nn.Module, tensors: dict[str, torch.Tensor], ckpt_dir: Path, dtype: torch.dtype
) -> None:
    float_tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    result = model.load_state_dict(float_tensors, strict=False, assign=True)
    if result.unexpected_keys:
        raise ValueError(f"{ckpt_dir}: tensors the model has no place for: {result.unexpected_keys[:10]}")
    if getattr(model.config, "tie_word_embeddings", False):
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    missing = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta]
    if missing:
        raise ValueError(f"{ckpt_dir}: no tensor for {missing[:10]}")
    for param in model.parameters():
        param.requires_grad_(False)


def load_quantized_for_training(
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


def load_dequantized_reference(
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
