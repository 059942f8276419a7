"""Sequential GPTQ over a model's decoder layers, one layer in memory at a time.

What: ``gptq_layers(src_dir, specs, plan, cfg, token_ids)`` is a generator yielding, for decoder
layer 0, 1, ..., the NVFP4 tensors (``weight_packed``, ``weight_scale``, ``weight_global_scale``)
of that layer's quantized linears, computed by ``qerl.pipeline.nvfp4.gptq.gptq_nvfp4``. The quantize
stage pulls from it while ``write_sharded`` streams the checkpoint in name order, so only one
layer's weights, its Hessians and the calibration hidden states are alive at a time.

How: the model skeleton comes from transformers' own classes (``AutoModelForCausalLM.from_config``
on the meta device, so Llama/Qwen2/Qwen3 layers are the library's, with sdpa attention, whose
``attention_mask=None`` means causal). The calibration token ids go through the embedding once; then
for each layer i: its weights are read from the source safetensors (float32), hooks collect
``sum x^T x`` of the inputs of its quantized linears (one Hessian per fused group, whose members
share their input) while the hidden states - already produced by the *quantized* layers before i -
pass through it; GPTQ quantizes each group (one global scale per fused group, as for RTN); the
layer's weights are replaced by the dequantized values and the hidden states run through it again
to become layer i+1's input (sequential GPTQ). Each sequence runs alone (batch 1, no padding).
All compute is float32 (the factorisations float64) on ``device``: the CPU, or the GPU where the
quantize stage runs on one (GPTQ's column loop is the cost: hours for a 7B model on
a CPU, BENCHMARKS.md). The GPU's results differ from the CPU's in the last bits of float32 sums, so which
device ran is in the manifest; the tensors are moved to the CPU as each layer finishes, for the
writer.

Memory: the hidden states (tokens x hidden, float32), one layer's weights and one ``in x in``
Hessian per group; never the model.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import torch
from qerl.kernels.nvfp4_reference import GROUP_SIZE, global_scale, pack_codes, tensor_amax
from qerl.pipeline.nvfp4.gptq import gptq_nvfp4
from qerl.pipeline.nvfp4.grouping import Group
from qerl.pipeline.nvfp4.recipe import QuantizeConfig
from qerl.pipeline.nvfp4.safetensors_io import TensorSpec, read_tensor

__all__ = ["layer_index", "gptq_layers", "model_skeleton"]

LayerTensors = dict[str, torch.Tensor]


def layer_index(name: str) -> int:
    """The decoder layer of ``model.layers.<i>....``; an error for any other tensor."""
    m = re.match(r"^model\.layers\.(\d+)\.", name)
    if not m:
        raise ValueError(f"tensor '{name}' is not inside a decoder layer (model.layers.<i>.)")
    return int(m.group(1))


def model_skeleton(src_dir: Path) -> torch.nn.Module:
    """The transformers model of ``src_dir``'s config.json on the meta device (no weights), sdpa attention."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(src_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    return model


def _load_layer(
    model: torch.nn.Module, i: int, specs: dict[str, TensorSpec], device: torch.device
) -> torch.nn.Module:
    layer = model.model.layers[i]
    prefix = f"model.layers.{i}."
    state = {}
    for key in layer.state_dict(keep_vars=True):
        spec = specs.get(prefix + key)
        if spec is None:
            raise ValueError(f"the source model has no tensor '{prefix + key}' that layer {i} needs")
        state[key] = read_tensor(spec).float().to(device)
    layer.load_state_dict(state, strict=True, assign=True)
    return layer


def _run_layer(
    layer: torch.nn.Module, rotary: torch.nn.Module, hidden: list[torch.Tensor]
) -> list[torch.Tensor]:
    out = []
    for h in hidden:
        pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        emb = rotary(h, position_ids=pos)
        y = layer(h, attention_mask=None, position_ids=pos, position_embeddings=emb)
        out.append(y[0] if isinstance(y, tuple) else y)
    return out


def _collect_hessians(
    layer: torch.nn.Module, rotary: torch.nn.Module, hidden: list[torch.Tensor], groups: list[list[str]]
) -> dict[str, torch.Tensor]:
    """``2 X^T X / n`` of the input of each group's first member (the group's shared input)."""
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    handles = []
    for members in groups:
        key = members[0]

        def hook(_mod, args, key=key):  # noqa: ANN001, ANN202
            x = args[0].reshape(-1, args[0].shape[-1]).float()
            sums[key] = sums.get(key, 0) + x.T @ x
            counts[key] = counts.get(key, 0) + x.shape[0]

        handles.append(layer.get_submodule(key).register_forward_pre_hook(hook))
    try:
        _run_layer(layer, rotary, hidden)
    finally:
        for h in handles:
            h.remove()
    return {k: 2 * sums[k] / counts[k] for k in sums}


def _quantize_group(
    layer: torch.nn.Module, members: list[str], h: torch.Tensor, cfg: QuantizeConfig, names: list[str]
) -> LayerTensors:
    mods = [layer.get_submodule(m) for m in members]
    weights = [m.weight.data for m in mods]
    # the RTN global scale: from the original weights' amax, shared by a fused group
    gs = global_scale(max(tensor_amax(w, n) for w, n in zip(weights, names, strict=True)))
    cal = cfg.calibration
    codes, scales = gptq_nvfp4(
        torch.cat(weights), h, gs, cal.damp, cal.act_order, cal.scales, cfg.scale_sweep
    )
    out: LayerTensors = {}
    row = 0
    lut_values = _decoded(codes, scales, gs)
    for mod, w, name in zip(mods, weights, names, strict=True):
        rows = slice(row, row + w.shape[0])
        row += w.shape[0]
        base = name[: -len(".weight")]
        out[f"{base}.weight_packed"] = pack_codes(codes[rows]).cpu()
        out[f"{base}.weight_scale"] = scales[rows].to(torch.float8_e4m3fn).cpu()
        out[f"{base}.weight_global_scale"] = gs.cpu().clone()
        mod.weight.data = lut_values[rows].clone()  # the next layers see the quantized weights
    return out


def _decoded(codes: torch.Tensor, scales: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    from qerl.pipeline.nvfp4.scale_search import decode

    out_f, in_f = codes.shape
    return decode(codes.reshape(out_f, -1, GROUP_SIZE), scales, gs).reshape(out_f, in_f)


@torch.no_grad()
def gptq_layers(
    src_dir: Path,
    specs: dict[str, TensorSpec],
    plan: list[Group],
    cfg: QuantizeConfig,
    token_ids: list[list[int]],
    device: torch.device | str = "cpu",
) -> Iterator[tuple[int, LayerTensors]]:
    """Yield ``(layer index, {output tensor name: CPU tensor})`` for every decoder layer in order,
    computed on ``device``."""
    device = torch.device(device)
    model = model_skeleton(src_dir)
    inner = model.model
    # rebuilt off the meta device: its buffers are computed
    rotary = type(inner.rotary_emb)(inner.config).to(device)
    emb_spec = specs.get("model.embed_tokens.weight")
    if emb_spec is None:
        raise ValueError(f"{src_dir}: no model.embed_tokens.weight to embed the calibration text with")
    emb = read_tensor(emb_spec).float()
    hidden = [emb[torch.tensor(ids)].unsqueeze(0).to(device) for ids in token_ids]
    del emb
    by_layer: dict[int, list[Group]] = {}
    for g in plan:
        if g.quantize:
            by_layer.setdefault(layer_index(g.sources[0].name), []).append(g)
    for i in range(len(inner.layers)):
        layer = _load_layer(model, i, specs, device)
        prefix = f"model.layers.{i}."
        groups = [[s.name[len(prefix) : -len(".weight")] for s in g.sources] for g in by_layer.get(i, [])]
        out: LayerTensors = {}
        if groups:
            hessians = _collect_hessians(layer, rotary, hidden, groups)
            for members, g in zip(groups, by_layer[i], strict=True):
                out.update(
                    _quantize_group(
                        layer, members, hessians.pop(members[0]), cfg, [s.name for s in g.sources]
                    )
                )
        hidden = _run_layer(layer, rotary, hidden)
        inner.layers[i] = torch.nn.Identity()  # drop the layer's weights before the next is read
        yield i, out
