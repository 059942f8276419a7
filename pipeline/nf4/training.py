"""NF4's training loader (``qerl.pipeline.schemes``): an NF4 checkpoint as QLoRA's bitsandbytes layers hold it.

What: ``load_for_training`` is the model with bitsandbytes' ``Linear4bit`` layers that peft puts
LoRA on, computing in the trainer's dtype, every parameter frozen.

Departure and why: it turns off bitsandbytes' CPU inference path (``support_avx512bf16_for_cpu``).
On a CPU with AVX512-BF16, a ``Linear4bit`` called in eval mode without gradients repacks its weight
for a bf16 kernel: its logprobs then differ from the values the engine samples with, and the
repacked layer can no longer train (its bias is added in place to a tensor autograd tracks). With it
off, every call dequantizes and multiplies in the compute dtype: the twin's function exactly.
Norms stay in the trainer's dtype too, where peft's ``prepare_model_for_kbit_training`` (QLoRA's
recipe) would upcast them to float32: sampler and trainer must hold the same weights.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

__all__ = ["load_for_training"]

log = logging.getLogger("qerl.nf4")


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
