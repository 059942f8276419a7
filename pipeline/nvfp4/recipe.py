"""The NVFP4A16 recipe: what the quantize stage quantizes, which models it takes, and the config.json entry.

What: ``QuantizeConfig`` is the quantize stage's recipe (part of its cache key). The decoder-layer
linear projections named in ``targets`` (by default all of q/k/v/o, gate/up/down) are quantized to
compressed-tensors' "nvfp4-pack-quantized" layout: ``<name>.weight_packed`` / ``.weight_scale`` /
``.weight_global_scale`` (``QUANT_SUFFIXES``); the other projections, embeddings, norms, biases and
lm_head are copied byte for byte. ``keep`` leaves chosen targeted linears in the base dtype (mixed precision).
``quantization_config`` is the ``config.json`` entry that targets exactly the quantized modules (the
kept ones in its ``ignore``), as compressed-tensors writes it, so transformers and vLLM load the
checkpoint as their own. ``check_architecture`` refuses, from config.json alone, what the recipe
cannot handle (mixture-of-experts, an architecture outside ``SUPPORTED_ARCHITECTURES``, a model that
is already quantized), before anything is read or written.

``method`` says how codes and block scales are chosen; every method writes the same format, so the
dequantizer and vLLM's FP4 Marlin kernel serve them all unchanged: ``rtn`` (round to nearest with the
absmax block scale, the default, bit-identical to compressed-tensors' compressor), ``mse`` (per-block
scale search, ``qerl.pipeline.nvfp4.scale_search``) and ``gptq`` (error compensation on calibration
text, ``qerl.pipeline.nvfp4.gptq`` and ``qerl.pipeline.nvfp4.calibration``, configured by
``CalibrationConfig``).

Departure and why: a fused group (q/k/v, gate/up) is taken whole or not at all, and its members share
one global scale (``qerl.pipeline.nvfp4.grouping``): vLLM runs each group as one layer with one scheme
and one global scale. Every method keeps that RTN global scale.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from qerl.pipeline.config import StrictModel, resource_field
from qerl.pipeline.nvfp4.quality_config import QualityConfig
from qerl.pipeline.schemes import TWIN_MODE, UNQUANTIZED_MODE

__all__ = [
    "KNOWN_PROJECTIONS",
    "QUANT_METHODS",
    "QUANT_SUFFIXES",
    "SUPPORTED_ARCHITECTURES",
    "TWIN_MODE",
    "UNQUANTIZED_MODE",
    "CalibrationConfig",
    "QuantizeConfig",
    "UnsupportedModelError",
    "check_architecture",
    "quantization_config",
    "quantized_module_targets",
    "read_model_config",
    "twin_dtype",
]

# The linear projections of a decoder layer in the supported architectures: one not in
# ``QuantizeConfig.targets`` is kept in full precision; a linear outside this list is refused.
KNOWN_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SUPPORTED_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM")
# the tensors a quantized Linear is stored as: `<module>.<suffix>`
QUANT_SUFFIXES = ("weight_packed", "weight_scale", "weight_global_scale")
_MOE_KEYS = (
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "moe_intermediate_size",
    "num_experts_per_tok",
)


QUANT_METHODS = ("rtn", "mse", "gptq")


class CalibrationConfig(StrictModel):
    """Calibration text and GPTQ settings of ``quantize.method: gptq`` (ignored by rtn and mse)."""

    source: Literal["auto", "gsm8k", "train", "samples"] = Field(
        default="auto",
        description="gsm8k: GSM8K train questions with their worked solutions from the data directory "
        "(data.root or $QERL_DATA_DIR); train: the run's own training problems with their reference "
        "completions (arithmetic answers, GSM8K solutions); samples: the run's training problems with the base "
        "model's own greedy completions; auto: gsm8k when the data directory has it, else train where the "
        "training data has reference completions, else samples",
    )
    count: int = Field(default=128, ge=1, description="calibration sequences (prompt + completion)")
    max_tokens: int = Field(default=512, ge=8, description="tokens kept per calibration sequence")
    damp: float = Field(default=0.01, gt=0, description="Hessian damping, as a fraction of its mean diagonal")
    act_order: bool = Field(
        default=False,
        description="process columns by decreasing Hessian diagonal (block scales then fixed up front)",
    )
    seed: int = Field(default=0, description="seed of the shuffle that picks the calibration problems")
    scales: Literal["absmax", "mse", "hessian"] = Field(
        default="hessian",
        description="how GPTQ fixes a 16-column block's FP8 scale when it reaches the block: absmax (the RTN "
        "rule), mse (weight error) or hessian (error weighted by GPTQ's per-column cost)",
    )


class QuantizeConfig(StrictModel):
    """Recipe of the quantize stage (part of its cache key).

    Every decoder-layer projection named in ``targets`` is quantized; the others of
    ``KNOWN_PROJECTIONS`` are kept in full precision (copied), and the checkpoint's
    ``quantization_config`` targets exactly the quantized ones. A fused group (q/k/v, gate/up) is
    taken whole or not at all: vLLM runs it as one layer with one scheme.
    """

    scheme: Literal["nvfp4", "nf4", "none"] = Field(
        default="nvfp4",
        description="nvfp4: the NVFP4A16 checkpoint (QeRL); nf4: QLoRA's base, bitsandbytes NF4 with double "
        "quantization (blocks of 64, the rest in the twin dtype; method, calibration and fused_groups are "
        "NVFP4's and do not apply); none: the base unquantized (its floating weights in the twin dtype), "
        "served and trained as is: the 16-bit LoRA arm of an ablation",
    )
    targets: list[str] = Field(
        default=list(KNOWN_PROJECTIONS),
        description="projections inside decoder layers that are quantized; the others stay in full precision",
    )
    keep: list[str] = Field(
        default=[],
        description="mixed precision: targeted linears kept in the base dtype, listed in quantization_config's "
        "ignore so vLLM serves them dense. Each entry is a module-name pattern (fnmatch: 'model.layers.0.*', "
        "'*.down_proj') or first:N / last:N (every targeted projection of the first / last N decoder layers)",
    )
    fused_groups: list[list[str]] = Field(
        default=[["q_proj", "k_proj", "v_proj"], ["gate_proj", "up_proj"]],
        description="projections that share one global scale (vLLM fuses them)",
    )
    architectures: list[str] = Field(default=list(SUPPORTED_ARCHITECTURES))
    method: Literal["rtn", "mse", "gptq"] = Field(
        default="rtn",
        description="how codes and block scales are chosen (same NVFP4A16 checkpoint format): rtn: round to "
        "nearest with the absmax block scale; mse: per-block scale search (absmax, 4-over-6 and neighbouring "
        "E4M3 values, lowest weight error); gptq: GPTQ error compensation on calibration text (quantize.calibration)",
    )
    scale_sweep: int = Field(
        default=2,
        ge=0,
        le=8,
        description="mse and gptq scale search: E4M3 neighbours tried on each side of the absmax and 4-over-6 scales",
    )
    calibration: CalibrationConfig = Field(
        default_factory=CalibrationConfig, description="calibration of quantize.method gptq"
    )
    # a resource field here: the settings change the quality stage's report (whose key holds them),
    # never the checkpoint, its twin or an adapter, so they stay out of those keys and the run id
    quality: QualityConfig = resource_field(
        default_factory=QualityConfig, description="what the quality stage measures (its own key holds it)"
    )
    max_shard_mb: float = resource_field(
        default=4096, gt=0, description="largest output shard, MiB (the files' layout, not the weights)"
    )
    twin_dtype: Literal["bfloat16", "float16", "float32"] | None = Field(
        default=None,
        description="dtype of the dequantized twin (what vLLM serves on a CPU); null: train.dtype in a run, "
        "bfloat16 standalone. Not part of the quantize stage's key: the NVFP4 checkpoint does not depend on it",
    )

    @model_validator(mode="after")
    def _whole_groups(self) -> QuantizeConfig:
        if not self.targets or len(set(self.targets)) != len(self.targets):
            raise ValueError(f"quantize.targets must name distinct projections, got {self.targets}")
        for group in self.fused_groups:
            chosen = [p for p in group if p in self.targets]
            if chosen and len(chosen) != len(group):
                raise ValueError(
                    f"quantize.targets takes {chosen} of the fused group {group}: vLLM runs the group as one "
                    "layer with one scheme, so quantize all of it or none"
                )
        for entry in self.keep:
            layers = re.fullmatch(r"(first|last):(\d+)", entry)
            if entry.startswith(("first:", "last:")) and not (layers and int(layers[2]) > 0):
                raise ValueError(f"quantize.keep entry '{entry}': first:N / last:N takes a positive N")
        return self


def twin_dtype(cfg: QuantizeConfig) -> str:
    """The twin's dtype: the configured one (a run derives it from train.dtype), else bfloat16."""
    return cfg.twin_dtype or "bfloat16"


class UnsupportedModelError(ValueError):
    """The model cannot be quantized by this recipe; the message names what is unsupported."""


# --- model inspection ------------------------------------------------------------------------


def read_model_config(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise UnsupportedModelError(f"{model_dir} has no config.json; not a Hugging Face model directory")
    return json.loads(path.read_text())


def check_architecture(config: dict, cfg: QuantizeConfig | None = None) -> str:
    """Return the architecture name, or raise naming what is unsupported (MoE, unknown, quantized)."""
    cfg = cfg or QuantizeConfig()
    archs = config.get("architectures") or []
    if len(archs) != 1:
        raise UnsupportedModelError(f"config.json must name exactly one architecture, got {archs}")
    arch = archs[0]
    moe = {k: config[k] for k in _MOE_KEYS if config.get(k)}
    if moe or "moe" in str(config.get("model_type", "")).lower():
        raise UnsupportedModelError(
            f"mixture-of-experts models are not supported ({arch}, model_type={config.get('model_type')}, {moe})"
        )
    if arch not in cfg.architectures:
        raise UnsupportedModelError(
            f"unsupported architecture '{arch}'; supported: {', '.join(cfg.architectures)}"
        )
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method", "?")
        raise UnsupportedModelError(
            f"the model is already quantized (quant_method={method}); give a bf16/fp16/fp32 one"
        )
    return arch


def quantized_module_targets(cfg: QuantizeConfig) -> list[str]:
    """The config group's ``targets``: exactly the modules ``plan_quantization`` quantizes.

    All seven projections: ``Linear``, the library's own NVFP4A16 form (every Linear of the supported
    architectures is a decoder projection, except lm_head, which ``ignore`` names). A narrower recipe:
    one ``re:`` pattern per projection name, which compressed-tensors (transformers) and vLLM both
    match against module names; vLLM matches a fused layer (qkv_proj) when all its parts match, and
    leaves every unmatched Linear unquantized, which is what the checkpoint holds there.
    """
    if set(KNOWN_PROJECTIONS) <= set(cfg.targets):
        return ["Linear"]
    return [f"re:.*\\.{re.escape(name)}$" for name in cfg.targets]


def quantization_config(cfg: QuantizeConfig | None = None, kept: list[str] | tuple[str, ...] = ()) -> dict:
    """The config.json ``quantization_config`` of an NVFP4A16 checkpoint, as compressed-tensors writes it.

    ``kept``: the module names ``quantize.keep`` left dense (``grouping.kept_linears``), ignored beside
    lm_head; vLLM serves a fused layer dense when all its parts are ignored, which the plan ensures."""
    # the version from metadata: importing compressed_tensors costs seconds (it pulls in torch.compile)
    from importlib.metadata import version

    cfg = cfg or QuantizeConfig()
    weights = {
        "num_bits": 4,
        "type": "float",
        "symmetric": True,
        "group_size": 16,
        "strategy": "tensor_group",
        "block_structure": None,
        "dynamic": False,
        "actorder": None,
        "scale_dtype": "torch.float8_e4m3fn",
        "zp_dtype": None,
        "observer": "memoryless_minmax",
        "observer_kwargs": {},
    }
    return {
        "config_groups": {
            "group_0": {
                "targets": quantized_module_targets(cfg),
                "weights": weights,
                "input_activations": None,
                "output_activations": None,
                "format": None,
            }
        },
        "format": "nvfp4-pack-quantized",
        "global_compression_ratio": None,
        # lm_head: the one Linear outside the decoder layers (tied or not), never quantized
        "ignore": ["lm_head", *kept],
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": version("compressed-tensors"),
    }
