"""The base schemes (``quantize.scheme``: nvfp4, nf4, none): the mode names their artifacts and
engines record, and the module each stage decodes or trains a scheme's base with.

Constants only, no logic: a module that needs a name (a mode to check, the module to import for a
scheme) imports this one and not the code that makes it, since a stage's cache key covers the code
it imports (``qerl.pipeline.store.code_version``). Each scheme's decoding module is named here
relative to the ``qerl`` package, so that naming it is not an import of every scheme: the stage that
computes with one imports it with ``scheme_module`` and passes it to ``code_version`` as a root, as
the rollout stage does with its engine's implementation. An NVFP4 twin's key then never moves with
NF4 code, and the other way round.

Every decoding module offers the same functions: ``quantized_linears(specs)`` (each quantized
linear's module name -> its unquantized weight shape, from a checkpoint's safetensors headers),
``state_tensors(specs, module)`` (the tensors that hold that linear), ``dequantized_linears(dir,
dtype)`` (each linear's weight as the scheme decodes it, one at a time, in natural order) and
``load_dequantized(dir, dtype)`` (the whole model with plain linears holding those values). Its
``TRAINING`` names the module that loads the base for LoRA training (``load_for_training``).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import ModuleType

__all__ = [
    "MARLIN_MODE",
    "NF4_CUDA_MODE",
    "NF4_MODE",
    "NF4_TWIN_MODE",
    "TWIN_MODE",
    "UNQUANTIZED_MODE",
    "checkpoint_scheme",
    "mode_scheme",
    "scheme_module",
]

# the quantize stage's manifest modes (``nvfp4/<backend>`` for NVFP4, whatever its method)
UNQUANTIZED_MODE = "unquantized"  # scheme none: the base as is, floats cast to the twin dtype
NF4_MODE = "nf4/bitsandbytes"  # scheme nf4: QLoRA's base
# the dequantize stage's, one per quantized scheme
TWIN_MODE = "nvfp4-dequantized-twin"
NF4_TWIN_MODE = "nf4-dequantized-twin"
# the engine modes on CUDA, where vLLM serves the quantized checkpoint itself
MARLIN_MODE = "vllm-nvfp4-marlin"  # NVFP4 on FP4 Marlin
NF4_CUDA_MODE = "vllm-nf4-bitsandbytes"  # NF4 through vLLM's bitsandbytes

# per quantized scheme: (its decoding module, the module that loads it for training), relative to qerl
_MODULES = {
    "nvfp4": ("pipeline.nvfp4.loading", "pipeline.nvfp4.loading"),
    "nf4": ("pipeline.nf4.dequantize", "pipeline.nf4.training"),
}


def mode_scheme(mode: str | None) -> str:
    """The scheme of a quantize artifact's ``mode`` (``nvfp4`` for an NVFP4 backend's, and for None)."""
    return {UNQUANTIZED_MODE: "none", NF4_MODE: "nf4"}.get(mode or "", "nvfp4")


def checkpoint_scheme(model_dir: str | Path) -> str:
    """The scheme a model directory's ``config.json`` says its weights are in: ``nvfp4``
    (compressed-tensors' nvfp4-pack-quantized), ``nf4`` (bitsandbytes NF4) or ``none``."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    qc = config.get("quantization_config") or {}
    groups = (qc.get("config_groups") or {}).values()
    if qc.get("format") == "nvfp4-pack-quantized" or any(
        g.get("format") == "nvfp4-pack-quantized" for g in groups
    ):
        return "nvfp4"
    if qc.get("quant_method") == "bitsandbytes" and qc.get("bnb_4bit_quant_type") == "nf4":
        return "nf4"
    return "none"


def scheme_module_name(scheme: str, training: bool = False) -> str:
    """The dotted name of ``scheme``'s decoding module (its training loader with ``training``)."""
    if scheme not in _MODULES:
        raise ValueError(
            f"scheme {scheme!r} has no quantized weights to decode; quantized: {sorted(_MODULES)}"
        )
    return "qerl." + _MODULES[scheme][1 if training else 0]


def scheme_module(scheme: str, training: bool = False) -> ModuleType:
    """``scheme``'s decoding module, imported (its training loader with ``training``)."""
    return importlib.import_module(scheme_module_name(scheme, training))
