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

``nf4_linears``, ``nf4_shape`` and ``quant_state`` read a checkpoint's NF4 linears, their
unquantized shapes and their quantization states (the JSON beside each) from the file. Reading the
weights back is ``qerl.pipeline.nf4.dequantize``'s (the twin, the quality report) and
``qerl.pipeline.nf4.training``'s (the trainer's ``Linear4bit`` layers): separate modules, so that
each stage's cache key holds the NF4 code it runs and no other.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from qerl.pipeline.nvfp4.safetensors_io import TensorSpec, natural_key, read_tensor, safetensors_index
from qerl.pipeline.schemes import checkpoint_scheme

__all__ = [
    "NF4_BLOCKSIZE",
    "STATE_SUFFIX",
    "is_nf4_checkpoint",
    "nf4_linears",
    "nf4_shape",
    "quant_state",
    "write_nf4",
    "written_layout",
]

log = logging.getLogger("qerl.nf4")

NF4_BLOCKSIZE = 64  # QLoRA's block of weights per scale (bitsandbytes' default)
STATE_SUFFIX = "quant_state.bitsandbytes__nf4"  # the tensor (JSON bytes) that marks an NF4 linear


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
    return checkpoint_scheme(model_dir) == "nf4"


def nf4_linears(specs: dict[str, TensorSpec]) -> list[str]:
    """The module names of the NF4 linears among a checkpoint's tensors, in natural order."""
    suffix = f".weight.{STATE_SUFFIX}"
    return sorted((k[: -len(suffix)] for k in specs if k.endswith(suffix)), key=natural_key)


def quant_state(specs: dict[str, TensorSpec], module: str) -> dict[str, Any]:
    """NF4 linear ``module``'s quantization state, as bitsandbytes wrote it (its JSON tensor)."""
    return json.loads(read_tensor(specs[f"{module}.weight.{STATE_SUFFIX}"]).numpy().tobytes())


def nf4_shape(specs: dict[str, TensorSpec], module: str) -> tuple[int, ...]:
    """The unquantized shape of NF4 linear ``module``'s weight, from its quantization state."""
    return tuple(int(x) for x in quant_state(specs, module)["shape"])


def written_layout(ckpt_dir: str | Path) -> dict[str, Any]:
    """The quantization type, block size and double quantization of the NF4 linears written in
    ``ckpt_dir``, read from their quantization states (one layout for all, else a ``ValueError``)."""
    specs = safetensors_index(ckpt_dir)
    layouts = set()
    for module in nf4_linears(specs):
        state = quant_state(specs, module)
        nested = f"{module}.weight.nested_absmax" in specs
        layouts.add((state.get("quant_type"), int(state["blocksize"]), nested))
    if len(layouts) != 1:
        raise ValueError(
            f"{ckpt_dir}: NF4 linears with {len(layouts)} layouts (type, blocksize, nested): {sorted(layouts)}"
        )
    quant_type, blocksize, nested = layouts.pop()
    return {"quant_type": quant_type, "blocksize": blocksize, "double_quant": nested}


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
