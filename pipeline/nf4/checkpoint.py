"""NF4 bases as QLoRA builds them: bitsandbytes' 4-bit NormalFloat with double quantization.

What: ``write_nf4`` turns a Hugging Face model into the checkpoint transformers itself writes for
``BitsAndBytesConfig(load_in_4bit, nf4, double quant)``: each quantized linear is ``<m>.weight``
(two 4-bit codes a byte, blocks of 64 weights) with its quantization state beside it
(``<m>.weight.absmax`` as 8-bit codes of the block scales, ``nested_absmax`` / ``nested_quant_map``
for them, ``quant_map``, and ``quant_state.bitsandbytes__nf4``, the state's JSON), and
``config.json`` carries ``quant_method: bitsandbytes``. transformers and vLLM load it as their own.
The non-quantized tensors (embeddings, norms, lm_head, any linear left out) are in ``dtype``, which is
also the compute dtype the checkpoint names: the trainer's ``train.dtype`` in a run, so the trainer's
and the sampler's weights are the same values.

``dequantized_linears`` streams each NF4 linear's weight as bitsandbytes' own ``dequantize_4bit``
computes it, from the file, one linear at a time (the dequantize stage's twin and the quality
report read it); ``load_dequantized`` is the whole model with plain ``nn.Linear`` layers holding those
values, the independent reference; ``load_for_training`` is the model with bitsandbytes'
``Linear4bit`` layers that peft puts LoRA on, as QLoRA trains.

Departure and why: ``load_for_training`` turns off bitsandbytes' CPU inference path
(``support_avx512bf16_for_cpu``). On a CPU with AVX512-BF16, a ``Linear4bit`` called in eval mode
without gradients repacks its weight for a bf16 kernel: its logprobs then differ from the values the
engine samples with, and the repacked layer can no longer train (its bias is added in place to a
tensor autograd tracks). With it off, every call dequantizes and multiplies in the compute dtype:
the twin's function exactly.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from qerl.pipeline.nvfp4.loading import empty_model, finish_loading, read_tensors
from qerl.pipeline.nvfp4.safetensors_io import TensorSpec, natural_key, read_tensor, safetensors_index
from torch import nn

__all__ = [
    "NF4_BLOCKSIZE",
    "NF4_MODE",
    "NF4_TWIN_MODE",
    "dequantized_linears",
    "is_nf4_checkpoint",
    "load_dequantized",
    "load_for_training",
    "nf4_linears",
    "nf4_shape",
    "write_nf4",
]

log = logging.getLogger("qerl.nf4")
# bitsandbytes' CPU backend tries, at import, an optional kernel from the Hugging Face hub (through the
# `kernels` package, which is not installed) and warns that it could not; its plain-torch path runs
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)

NF4_MODE = "nf4/bitsandbytes"  # the quantize stage's manifest mode for an NF4 base
NF4_TWIN_MODE = "nf4-dequantized-twin"  # the dequantize stage's, from an NF4 base
NF4_BLOCKSIZE = 64  # QLoRA's block of weights per scale (bitsandbytes' default)
_STATE = "quant_state.bitsandbytes__nf4"  # the tensor (JSON bytes) that marks an NF4 linear


def bnb_config(compute_dtype: torch.dtype, skip: list[str]) -> Any:
    """QLoRA's quantization: NF4, double quantization, blocks of 64, ``skip`` left unquantized."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute_dtype,
        bnb_4bit_quant_storage=torch.uint8,
        llm_int8_skip_modules=skip,
    )


def is_nf4_checkpoint(model_dir: str | Path) -> bool:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    qc = config.get("quantization_config") or {}
    return qc.get("quant_method") == "bitsandbytes" and qc.get("bnb_4bit_quant_type") == "nf4"


def nf4_linears(specs: dict[str, TensorSpec]) -> list[str]:
    """The module names of the NF4 linears among a checkpoint's tensors, in natural order."""
    suffix = f".weight.{_STATE}"
    return sorted((k[: -len(suffix)] for k in specs if k.endswith(suffix)), key=natural_key)


def nf4_shape(specs: dict[str, TensorSpec], module: str) -> tuple[int, ...]:
    """The unquantized shape of NF4 linear ``module``'s weight, from its quantization state."""
    state = json.loads(read_tensor(specs[f"{module}.weight.{_STATE}"]).numpy().tobytes())
    return tuple(int(x) for x in state["shape"])


def _device() -> str:
    from qerl.pipeline.runtime.device import default_device

    return default_device()


def write_nf4(
    src_dir: Path, out_dir: Path, dtype: torch.dtype, skip: list[str], planned: set[str], max_shard_mb: float
) -> dict[str, Any]:
    """Quantize ``src_dir`` to NF4 into ``out_dir`` (weights and config.json; the caller copies the
    other files) and return what was written. ``planned``: the linears that must come out NF4, checked
    against the file (``skip`` is matched by transformers, by substring)."""
    from transformers import AutoModelForCausalLM

    device = _device()
    model = AutoModelForCausalLM.from_pretrained(
        src_dir, quantization_config=bnb_config(dtype, skip), dtype=dtype, device_map={"": device}
    )
    model.save_pretrained(out_dir, max_shard_size=f"{max(1, int(max_shard_mb))}MB")
    del model
    specs = safetensors_index(out_dir)
    written = set(nf4_linears(specs))
    if written != planned:
        raise RuntimeError(
            f"NF4 quantization of {src_dir}: transformers quantized {sorted(written - planned)[:5]} beyond the "
            f"plan and left {sorted(planned - written)[:5]} out of it"
        )
    return {"device": device, "linears": len(written), "bytes_out": sum(s.nbytes for s in specs.values())}


def _quant_state(specs: dict[str, TensorSpec], module: str) -> Any:
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
        raise ValueError(f"{ckpt_dir}: no '*.weight.{_STATE}' tensors - not an NF4 checkpoint")
    for module in names:
        state = _quant_state(specs, module)
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


def load_for_training(
    ckpt_dir: str | Path, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu"
) -> nn.Module:
    """The NF4 checkpoint with bitsandbytes ``Linear4bit`` layers computing in ``dtype``, all frozen
    (QLoRA's base); the CPU inference repacking is off (see the module docstring)."""
    import bitsandbytes as bnb
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt_dir, dtype=dtype, device_map={"": str(device)})
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    if not layers:
        raise ValueError(f"{ckpt_dir}: transformers loaded no 4-bit layer - not an NF4 checkpoint")
    for layer in layers:
        layer.support_avx512bf16_for_cpu = False
        layer.compute_dtype = dtype
    model.requires_grad_(False)
    log.info(
        "loaded %s: %d NF4 linears (bitsandbytes Linear4bit), compute dtype %s", ckpt_dir, len(layers), dtype
    )
    return model
