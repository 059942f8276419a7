"""Quantization plan: which tensors are quantized together, in what order, and what each group writes.

What: ``plan_quantization`` turns a model's tensor index (``safetensors_io.safetensors_index``) into
``Group`` s in natural name order: one per fused set of projections of a layer (q/k/v, gate/up), one per
other targeted projection, and one per pass-through tensor; each group lists its sources and the
output tensors it writes (``weight_packed`` / ``weight_scale`` / ``weight_global_scale`` per quantized
source, or the source itself).

How and why: the members of a fused group are quantized together because they share one global scale
(the one from the max amax over the group): vLLM fuses them into one layer with a single global
scale. The plan validates every tensor (MoE expert weights, linears the recipe does not know, shapes
NVFP4 cannot take, dtypes) from the headers only, so an unsupported model fails before anything is
written.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from qerl.pipeline.nvfp4.recipe import KNOWN_PROJECTIONS, QuantizeConfig, UnsupportedModelError
from qerl.pipeline.nvfp4.safetensors_io import TensorSpec, natural_key

__all__ = ["Group", "plan_quantization"]


@dataclass
class Group:
    """Tensors processed together: one fused set of projections, or one pass-through tensor."""

    sources: list[TensorSpec]
    outputs: list[TensorSpec]
    quantize: bool


def _layer_match(name: str) -> re.Match | None:
    return re.match(r"^(?P<prefix>model\.layers\.\d+)\.(?P<parent>\w+)\.(?P<proj>\w+)\.weight$", name)


def plan_quantization(specs: dict[str, TensorSpec], cfg: QuantizeConfig) -> list[Group]:
    """Validate tensor names/shapes and return the processing order. Raises before any write."""
    fused = {p: i for i, grp in enumerate(cfg.fused_groups) for p in grp}
    groups: dict[tuple, list[TensorSpec]] = {}
    order: list[tuple] = []
    for name in sorted(specs, key=natural_key):
        spec = specs[name]
        if "expert" in name:
            raise UnsupportedModelError(
                f"tensor '{name}' belongs to a mixture-of-experts layer; MoE is not supported"
            )
        m = _layer_match(name)
        if m and m["proj"] in cfg.targets:
            if len(spec.shape) != 2 or spec.shape[1] % 16:
                raise UnsupportedModelError(
                    f"tensor '{name}' has shape {spec.shape}; NVFP4 needs 2-D weights with in_features % 16 == 0"
                )
            if spec.dtype not in ("BF16", "F16", "F32"):
                raise UnsupportedModelError(
                    f"tensor '{name}' has dtype {spec.dtype}; expected BF16, F16 or F32"
                )
            key = (m["prefix"], fused.get(m["proj"], m["proj"]))
        elif m and len(spec.shape) == 2 and "norm" not in m["proj"] and m["proj"] not in KNOWN_PROJECTIONS:
            raise UnsupportedModelError(
                f"tensor '{name}' is a linear weight the recipe does not know; not supported"
            )
        else:
            key = ("copy", name)
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append(spec)
    plan = []
    for key in order:
        sources = groups[key]
        if key[0] == "copy":
            plan.append(
                Group(sources, [TensorSpec(sources[0].name, sources[0].dtype, sources[0].shape)], False)
            )
            continue
        outputs = []
        for s in sources:
            base = s.name[: -len(".weight")]
            out_f, in_f = s.shape
            outputs += [
                TensorSpec(f"{base}.weight_packed", "U8", (out_f, in_f // 2)),
                TensorSpec(f"{base}.weight_scale", "F8_E4M3", (out_f, in_f // 16)),
                TensorSpec(f"{base}.weight_global_scale", "F32", (1,)),
            ]
        plan.append(Group(sources, outputs, True))
    if not any(g.quantize for g in plan):
        raise UnsupportedModelError(
            "no decoder-layer projections found to quantize (names like model.layers.0.mlp.up_proj.weight)"
        )
    return plan
