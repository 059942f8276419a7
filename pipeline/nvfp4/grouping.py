"""Quantization plan: which tensors are quantized together, in what order, and what each group writes.

What: ``plan_quantization`` turns a model's tensor index (``safetensors_io.safetensors_index``) into
``Group`` s in natural name order: one per fused set of projections of a layer (q/k/v, gate/up), one per
other targeted projection, and one per pass-through tensor (the linears ``quantize.keep`` keeps in the
base dtype, ``kept_linears``, among them); each group lists its sources and the
output tensors it writes (``weight_packed`` / ``weight_scale`` / ``weight_global_scale`` per quantized
source, or the source itself).

How and why: the members of a fused group are quantized together because they share one global scale
(the one from the max amax over the group): vLLM fuses them into one layer with a single global
scale. The plan validates every tensor (MoE expert weights, linears the recipe does not know, shapes
NVFP4 cannot take, dtypes) from the headers only, so an unsupported model fails before anything is
written.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

from qerl.pipeline.nvfp4.recipe import KNOWN_PROJECTIONS, QuantizeConfig, UnsupportedModelError
from qerl.pipeline.nvfp4.safetensors_io import TensorSpec, natural_key

__all__ = ["Group", "kept_linears", "kept_memory", "plan_quantization"]


@dataclass
class Group:
    """Tensors processed together: one fused set of projections, or one pass-through tensor."""

    sources: list[TensorSpec]
    outputs: list[TensorSpec]
    quantize: bool


def _layer_match(name: str) -> re.Match | None:
    return re.match(r"^(?P<prefix>model\.layers\.\d+)\.(?P<parent>\w+)\.(?P<proj>\w+)\.weight$", name)


def _keep_entry(entry: str, modules: dict[str, int], n_layers: int) -> set[str]:
    """The modules (name -> layer index) one ``quantize.keep`` entry names."""
    edge = re.fullmatch(r"(first|last):(\d+)", entry)
    if edge:
        n = int(edge[2])
        layers = range(n) if edge[1] == "first" else range(n_layers - n, n_layers)
        return {name for name, i in modules.items() if i in layers}
    return set(fnmatch.filter(modules, entry))


def kept_linears(specs: dict[str, TensorSpec], cfg: QuantizeConfig) -> list[str]:
    """The targeted decoder-layer linears (module names, natural order) that ``quantize.keep`` keeps in
    the base dtype. Raises naming an entry that matches no targeted linear (a typo would otherwise
    quantize everything silently) or one that keeps part of a fused group."""
    modules = {}
    for name in specs:
        m = _layer_match(name)
        if m and m["proj"] in cfg.targets:
            modules[name[: -len(".weight")]] = int(m["prefix"].rpartition(".")[2])
    n_layers = 1 + max(modules.values(), default=-1)
    kept: set[str] = set()
    for entry in cfg.keep:
        chosen = _keep_entry(entry, modules, n_layers)
        if not chosen:
            example = min(modules, key=natural_key, default="model.layers.0.mlp.down_proj")
            raise UnsupportedModelError(
                f"quantize.keep entry '{entry}' matches no quantized linear of this model "
                f"(module names look like '{example}'; first:N / last:N take decoder layers, {n_layers} here)"
            )
        kept |= chosen
    for group in cfg.fused_groups:
        for name in sorted(kept, key=natural_key):
            prefix, _, proj = name.rpartition(".")
            if proj in group:
                missing = [p for p in group if f"{prefix}.{p}" in modules and f"{prefix}.{p}" not in kept]
                if missing:
                    raise UnsupportedModelError(
                        f"quantize.keep keeps {name} but not {', '.join(missing)} of its fused group {group}: "
                        "vLLM runs the group as one layer with one scheme, so keep all of it or none"
                    )
    return sorted(kept, key=natural_key)


def kept_memory(specs: dict[str, TensorSpec], kept: list[str]) -> dict[str, object]:
    """What ``quantize.keep`` costs: the kept linears' bytes as stored, and what NVFP4 would have taken
    (half a byte a weight, an E4M3 scale per 16, a float32 global scale)."""
    weights = [specs[f"{name}.weight"] for name in kept]
    nvfp4 = sum(o * i // 2 + o * i // 16 + 4 for o, i in (w.shape for w in weights))
    return {"linears": kept, "bytes": sum(w.nbytes for w in weights), "nvfp4_bytes": nvfp4}


def plan_quantization(specs: dict[str, TensorSpec], cfg: QuantizeConfig) -> list[Group]:
    """Validate tensor names/shapes and return the processing order. Raises before any write."""
    fused = {p: i for i, grp in enumerate(cfg.fused_groups) for p in grp}
    kept = set(kept_linears(specs, cfg))
    groups: dict[tuple, list[TensorSpec]] = {}
    order: list[tuple] = []
    for name in sorted(specs, key=natural_key):
        spec = specs[name]
        if "expert" in name:
            raise UnsupportedModelError(
                f"tensor '{name}' belongs to a mixture-of-experts layer; MoE is not supported"
            )
        m = _layer_match(name)
        if m and m["proj"] in cfg.targets and name[: -len(".weight")] not in kept:
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
        why = (
            f", quantize.keep keeps all {len(kept)}"
            if kept
            else " (names like model.layers.0.mlp.up_proj.weight)"
        )
        raise UnsupportedModelError(f"no decoder-layer projections found to quantize{why}")
    return plan
