"""The NVFP4A16 checkpoint format: what gets quantized, how it is laid out, and streaming I/O.

What: the compressed-tensors "nvfp4-pack-quantized" checkpoint the quantize stage writes and the
rollout/training code reads. The decoder-layer linear projections named in ``QuantizeConfig.targets``
(by default all of q/k/v/o, gate/up/down) become ``<name>.weight_packed`` / ``.weight_scale`` /
``.weight_global_scale``; the other projections, embeddings, norms, biases and lm_head are copied byte
for byte, and ``quantization_config`` targets exactly the quantized modules. q/k/v and gate/up of a layer share one global scale (the one from the
max amax over the group), because vLLM fuses them and keeps a single global scale per fused layer.

How: ``plan_quantization`` validates the model (architecture, MoE, tensor names, shapes) from the
config and the safetensors *headers* only, so an unsupported model fails before anything is written.
``write_sharded`` then knows every output tensor's dtype and shape up front, writes each shard's
header first and streams tensor data behind it, one tensor group at a time; pass-through tensors are
copied in 64 MiB slices without ever becoming tensors. Peak memory is therefore one fused group
(gate+up of the largest layer) plus row-chunked float32 temporaries, not the model.

Departure and why: tensors are read with plain ``pread``-style file reads instead of
``safetensors.safe_open`` (which memory-maps the file): mapped pages a process has touched count in its
resident set, so reading a 15 GB checkpoint through mmap shows ~15 GB RSS even though the pages are
reclaimable, and the memory bound could not be measured or enforced. The on-disk format is standard
safetensors (8-byte header length, JSON header, data) and is read back by ``safetensors`` in tests.
"""

from __future__ import annotations

import json
import logging
import re
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from pydantic import Field, model_validator
from qerl.pipeline.config import StrictModel

log = logging.getLogger("qerl.nvfp4")

__all__ = [
    "KNOWN_PROJECTIONS",
    "QUANT_SUFFIXES",
    "SUPPORTED_ARCHITECTURES",
    "TWIN_MODE",
    "UNQUANTIZED_MODE",
    "QuantizeConfig",
    "RawSlice",
    "TensorSpec",
    "UnsupportedModelError",
    "check_architecture",
    "iter_quantized_linears",
    "plan_quantization",
    "quantization_config",
    "quantized_module_targets",
    "read_model_config",
    "read_tensor",
    "safetensors_index",
    "write_sharded",
]

# The manifest mode of the dequantize stage's output (stages/quantize.py builds it, the engines check it)
TWIN_MODE = "nvfp4-dequantized-twin"
# the quantize stage with ``scheme: none``: the base as is (floats cast to the twin dtype), no NVFP4
UNQUANTIZED_MODE = "unquantized"
# The linear projections of a decoder layer in the supported architectures: one not in
# ``QuantizeConfig.targets`` is kept in full precision; a linear outside this list is refused.
KNOWN_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SUPPORTED_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM")
QUANT_SUFFIXES = ("weight_packed", "weight_scale", "weight_global_scale")
_MOE_KEYS = (
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "moe_intermediate_size",
    "num_experts_per_tok",
)
_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "BOOL": torch.bool,
}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}
_COPY_CHUNK = 64 << 20


class QuantizeConfig(StrictModel):
    """Recipe of the quantize stage (part of its cache key).

    Every decoder-layer projection named in ``targets`` is quantized; the others of
    ``KNOWN_PROJECTIONS`` are kept in full precision (copied), and the checkpoint's
    ``quantization_config`` targets exactly the quantized ones. A fused group (q/k/v, gate/up) is
    taken whole or not at all: vLLM runs it as one layer with one scheme.
    """

    scheme: Literal["nvfp4", "none"] = Field(
        default="nvfp4",
        description="nvfp4: the NVFP4A16 checkpoint (QeRL); none: the base unquantized (its floating weights "
        "in the twin dtype), served and trained as is: the 16-bit LoRA arm of an ablation",
    )
    targets: list[str] = Field(
        default=list(KNOWN_PROJECTIONS),
        description="projections inside decoder layers that are quantized; the others stay in full precision",
    )
    fused_groups: list[list[str]] = Field(
        default=[["q_proj", "k_proj", "v_proj"], ["gate_proj", "up_proj"]],
        description="projections that share one global scale (vLLM fuses them)",
    )
    architectures: list[str] = Field(default=list(SUPPORTED_ARCHITECTURES))
    max_shard_mb: float = Field(default=4096, gt=0, description="largest output shard, MiB")
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
        return self


class UnsupportedModelError(ValueError):
    """The model cannot be quantized by this recipe; the message names what is unsupported."""


# --- model inspection --------------------------------------------------------------------------


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


def quantization_config(cfg: QuantizeConfig | None = None) -> dict:
    """The config.json ``quantization_config`` of an NVFP4A16 checkpoint, as compressed-tensors writes it."""
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
        "ignore": ["lm_head"],  # the one Linear outside the decoder layers (tied or not): never quantized
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": version("compressed-tensors"),
    }


# --- safetensors reading -----------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    """Where a tensor lives in a source file, or what an output tensor will be."""

    name: str
    dtype: str  # safetensors dtype string
    shape: tuple[int, ...]
    path: Path | None = None
    offset: int = 0  # absolute byte offset of the data in ``path``

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * _DTYPES[self.dtype].itemsize


@dataclass(frozen=True)
class RawSlice:
    """Bytes to copy verbatim from a source file (a pass-through tensor)."""

    path: Path
    offset: int
    nbytes: int


def _read_header(path: Path) -> tuple[dict, int]:
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) != 8:
            raise UnsupportedModelError(f"{path} is not a safetensors file (truncated header)")
        (n,) = struct.unpack("<Q", head)
        if n > 100 << 20:
            raise UnsupportedModelError(f"{path} has an implausible safetensors header length {n}")
        header = json.loads(fh.read(n))
    return header, 8 + n


def safetensors_index(model_dir: str | Path) -> dict[str, TensorSpec]:
    """Every tensor of a model directory's safetensors shards, from the headers only."""
    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in model_dir.glob("*.bin"))
        hint = (
            f" (found {pickles}: pickle checkpoints are not read, convert to safetensors)" if pickles else ""
        )
        raise UnsupportedModelError(f"{model_dir} has no .safetensors files{hint}")
    specs: dict[str, TensorSpec] = {}
    for path in files:
        header, base = _read_header(path)
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if info["dtype"] not in _DTYPES:
                raise UnsupportedModelError(
                    f"tensor '{name}' in {path.name} has unsupported dtype {info['dtype']}"
                )
            if name in specs:
                raise UnsupportedModelError(
                    f"tensor '{name}' appears in two shards ({specs[name].path}, {path})"
                )
            begin, _ = info["data_offsets"]
            specs[name] = TensorSpec(name, info["dtype"], tuple(info["shape"]), path, base + begin)
    return specs


def read_tensor(spec: TensorSpec) -> torch.Tensor:
    """Read one tensor with a plain file read (no mmap; see the module docstring)."""
    buf = bytearray(spec.nbytes)
    with open(spec.path, "rb") as fh:
        fh.seek(spec.offset)
        if fh.readinto(buf) != spec.nbytes:
            raise UnsupportedModelError(f"tensor '{spec.name}' is truncated in {spec.path}")
    if spec.nbytes == 0:
        return torch.empty(spec.shape, dtype=_DTYPES[spec.dtype])
    return torch.frombuffer(buf, dtype=_DTYPES[spec.dtype]).reshape(spec.shape)


# --- planning ----------------------------------------------------------------------------------


def _natural_key(name: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


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
    for name in sorted(specs, key=_natural_key):
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


# --- sharded writing ---------------------------------------------------------------------------


def _shard_layout(specs: list[TensorSpec], max_bytes: int) -> list[list[TensorSpec]]:
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


def _header_bytes(specs: list[TensorSpec]) -> bytes:
    header: dict = {"__metadata__": {"format": "pt"}}
    pos = 0
    for s in specs:
        header[s.name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [pos, pos + s.nbytes]}
        pos += s.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(raw)) + raw


def _write_payload(fh, spec: TensorSpec, value: torch.Tensor | RawSlice) -> None:  # noqa: ANN001
    if isinstance(value, RawSlice):
        if value.nbytes != spec.nbytes:
            raise ValueError(f"tensor '{spec.name}': {value.nbytes} bytes to copy, {spec.nbytes} planned")
        with open(value.path, "rb") as src:
            src.seek(value.offset)
            left = value.nbytes
            while left:
                chunk = src.read(min(left, _COPY_CHUNK))
                if not chunk:
                    raise ValueError(f"tensor '{spec.name}' is truncated in {value.path}")
                fh.write(chunk)
                left -= len(chunk)
        return
    if _DTYPE_NAMES.get(value.dtype) != spec.dtype or tuple(value.shape) != spec.shape:
        raise ValueError(
            f"tensor '{spec.name}': produced {value.dtype} {tuple(value.shape)}, planned {spec.dtype} {spec.shape}"
        )
    if value.numel():
        fh.write(value.contiguous().view(torch.uint8).numpy())


def write_sharded(
    out_dir: Path,
    groups: list[tuple[list[TensorSpec], Callable[[], dict[str, torch.Tensor | RawSlice]]]],
    max_shard_bytes: int,
    progress: Callable[[int], None] | None = None,
) -> dict[str, str]:
    """Write ``model-0000i-of-0000n.safetensors`` shards plus ``model.safetensors.index.json``.

    ``groups`` pairs the planned output specs of a group with a producer called once, in order; its
    outputs are written as they come, so only one group's tensors are alive at a time. ``progress(n)``
    is called after each group. Returns the weight map (tensor name -> shard file).
    """
    all_specs = [s for specs, _ in groups for s in specs]
    shards = _shard_layout(all_specs, max_shard_bytes)
    n = len(shards)
    names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map = {s.name: names[i] for i, shard in enumerate(shards) for s in shard}
    shard_iter = iter(zip(names, shards, strict=True))
    fh, remaining = None, []
    try:
        for specs, produce in groups:
            values = produce()
            for spec in specs:
                if not remaining:
                    if fh is not None:
                        fh.close()
                    fname, remaining = next(shard_iter)
                    remaining = list(remaining)
                    fh = open(out_dir / fname, "wb")  # noqa: SIM115 - closed when the shard is full
                    fh.write(_header_bytes(remaining))
                expected = remaining.pop(0)
                assert expected.name == spec.name, (expected.name, spec.name)
                _write_payload(fh, spec, values.pop(spec.name))
            del values
            if progress:
                progress(1)
    finally:
        if fh is not None:
            fh.close()
    total = sum(s.nbytes for s in all_specs)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return weight_map


# --- reading a quantized checkpoint back -------------------------------------------------------


def iter_quantized_linears(
    ckpt_dir: str | Path,
) -> Iterator[tuple[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """Yield ``module_name -> (weight_packed, weight_scale, weight_global_scale)`` one linear at a time."""
    specs = safetensors_index(ckpt_dir)
    modules = sorted({n.rsplit(".", 1)[0] for n in specs if n.endswith(".weight_packed")}, key=_natural_key)
    for module in modules:
        parts = []
        for suffix in QUANT_SUFFIXES:
            spec = specs.get(f"{module}.{suffix}")
            if spec is None:
                raise UnsupportedModelError(f"{ckpt_dir}: '{module}' has weight_packed but no {suffix}")
            parts.append(read_tensor(spec))
        yield module, (parts[0], parts[1], parts[2])
