"""Streaming safetensors I/O: headers, single tensors, and the sharded writer of the quantize stage.

What: ``safetensors_index`` lists every tensor of a model directory's shards (dtype, shape, file and
byte offset) from the headers alone; ``read_tensor`` reads one of them; ``write_sharded`` writes
``model-0000i-of-0000n.safetensors`` shards plus ``model.safetensors.index.json`` from a sequence of
tensor groups whose output specs are known up front; ``iter_quantized_linears`` reads a quantized
checkpoint back one linear at a time.

How: ``write_sharded`` knows every output tensor's dtype and shape before it starts, so it writes each
shard's header first and streams tensor data behind it, one tensor group at a time; pass-through
tensors (``RawSlice``) are copied in 64 MiB slices without ever becoming tensors. Peak memory is
therefore one fused group (gate+up of the largest layer) plus row-chunked float32 temporaries, not
the model.

Departure and why: tensors are read with plain ``pread``-style file reads instead of
``safetensors.safe_open`` (which memory-maps the file): mapped pages a process has touched count in its
resident set, so reading a 15 GB checkpoint through mmap shows ~15 GB RSS even though the pages are
reclaimable, and the memory bound could not be measured or enforced. The on-disk format is standard
safetensors (8-byte header length, JSON header, data) and is read back by ``safetensors`` in tests.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from qerl.pipeline.nvfp4.recipe import QUANT_SUFFIXES, UnsupportedModelError
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm

__all__ = [
    "DTYPE_NAMES",
    "RawSlice",
    "TensorSpec",
    "iter_quantized_linears",
    "natural_key",
    "read_tensor",
    "safetensors_index",
    "Progress",
    "copy_aux_files",
    "copy_producer",
    "empty_model",
    "finish_loading",
    "read_tensors",
    "tensor_bar",
    "weight_files",
    "write_sharded",
]

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
DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}
_COPY_CHUNK = 64 << 20
Progress = Callable[[int, int], None]  # (done, total): a build's progress, for a console's own bar


def natural_key(name: str) -> list:
    """Sort key that orders ``layers.10`` after ``layers.9``."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


# --- reading -----------------------------------------------------------------------------------


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
        raw = fh.read(n)
    try:
        header = json.loads(raw)
    except ValueError as err:  # cut short (an interrupted copy) or not JSON
        got = f"{len(raw)} of {n} header bytes" if len(raw) < n else f"a {n}-byte header"
        raise UnsupportedModelError(f"{path} is not a readable safetensors file ({got}: {err})") from err
    if not isinstance(header, dict):
        raise UnsupportedModelError(f"{path} is not a safetensors file (its header is not a JSON object)")
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
    if DTYPE_NAMES.get(value.dtype) != spec.dtype or tuple(value.shape) != spec.shape:
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
    modules = sorted({n.rsplit(".", 1)[0] for n in specs if n.endswith(".weight_packed")}, key=natural_key)
    for module in modules:
        parts = []
        for suffix in QUANT_SUFFIXES:
            spec = specs.get(f"{module}.{suffix}")
            if spec is None:
                raise UnsupportedModelError(f"{ckpt_dir}: '{module}' has weight_packed but no {suffix}")
            parts.append(read_tensor(spec))
        yield module, (parts[0], parts[1], parts[2])


@contextmanager
def tensor_bar(total: int, desc: str, progress: Progress | None) -> Iterator[Callable[[int], None]]:
    """``advance(n)``: n more tensors written, on tqdm's bar (stderr: the log under a console) and
    to the caller's ``progress(done, total)`` (a console's own bar)."""
    done = 0
    with tqdm(total=total, desc=desc, unit="tensor", disable=None) as bar:

        def advance(n: int) -> None:
            nonlocal done
            done += n
            bar.update(n)
            if progress is not None:
                progress(done, total)

        yield advance


# --- a model directory as a whole -------------------------------------------------------------

# Files never copied from a source model: weights are rewritten, pickles are not read.
_SKIP_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".pkl", ".msgpack", ".h5", ".onnx")
_SKIP_NAMES = {"config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json"}


def copy_aux_files(src: Path, dst: Path) -> list[str]:
    """Copy the model's other files (tokenizer, generation config; never weights or pickles) from
    ``src`` to ``dst``; their names."""
    copied = []
    for p in sorted(src.iterdir()):
        if not p.is_file() or p.name.startswith(".") or p.name in _SKIP_NAMES or p.suffix in _SKIP_SUFFIXES:
            continue
        shutil.copy2(p, dst / p.name)
        copied.append(p.name)
    return copied


def copy_producer(spec: TensorSpec) -> Callable[[], dict[str, RawSlice]]:
    """A ``write_sharded`` producer that copies one tensor's bytes unchanged."""
    return lambda: {spec.name: RawSlice(spec.path, spec.offset, spec.nbytes)}


def weight_files(ckpt_dir: Path) -> list[Path]:
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
    for path in weight_files(ckpt_dir):
        with safe_open(str(path), framework="pt", device=str(device)) as fh:
            for key in fh.keys():  # noqa: SIM118 - safe_open has no __iter__
                tensors[key] = fh.get_tensor(key)
    return tensors


def empty_model(ckpt_dir: Path, dtype: torch.dtype) -> nn.Module:
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
