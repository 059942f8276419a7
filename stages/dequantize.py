"""Stage ``dequantize``: the dequantized twin of an NVFP4 checkpoint, what the rollout engine serves
where no NVFP4 kernel exists (vLLM on CPU).

What: ``run(cfg, quantized, store)`` writes a plain Hugging Face checkpoint whose Linear weights are
exactly ``qerl.kernels`` dequantization of the quantize stage's codes and scales, in
``quantize.twin_dtype`` (``train.dtype`` in a run, so sampler and trainer hold the same weights;
bfloat16 standalone), with no ``quantization_config``; every other tensor and the tokenizer files are
copied. It is its own stage (mode ``nvfp4-dequantized-twin``) so lineage says what it is, streamed
one tensor at a time through ``write_sharded`` like the quantize stage. An unquantized base
(``quantize.scheme: none``) has no twin: engines serve it directly.

An NF4 base (``quantize.scheme: nf4``, mode ``nf4/bitsandbytes``) has a twin too (mode
``nf4-dequantized-twin``): each NF4 linear's weight as bitsandbytes' ``dequantize_4bit`` computes it
(``qerl.pipeline.nf4.checkpoint.dequantized_linears``), in the twin dtype, which is the compute dtype
the trainer's ``Linear4bit`` layers dequantize to: the same values.

The cache key is the quantize recipe with the twin dtype, the quantized checkpoint's content digest
and this module's code version (its import closure, the quantize stage's included).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import qerl.kernels.nvfp4_dispatch as nvfp4_dispatch
import torch
from qerl.pipeline.config import key_payload
from qerl.pipeline.nf4.checkpoint import NF4_MODE, NF4_TWIN_MODE, dequantized_linears, nf4_linears, nf4_shape
from qerl.pipeline.nvfp4.recipe import (
    QUANT_SUFFIXES,
    TWIN_MODE,
    UNQUANTIZED_MODE,
    QuantizeConfig,
    read_model_config,
)
from qerl.pipeline.nvfp4.safetensors_io import (
    DTYPE_NAMES,
    TensorSpec,
    natural_key,
    read_tensor,
    safetensors_index,
    write_sharded,
)
from qerl.pipeline.store.artifact_store import ArtifactStore
from qerl.pipeline.store.code_version import code_version
from qerl.pipeline.store.files import atomic_write_json
from qerl.pipeline.store.manifest import ArtifactError, BuildResult, Manifest
from qerl.stages import quantize
from tqdm.auto import tqdm

__all__ = ["STAGE", "run"]

STAGE = "dequantize"


def run(cfg: QuantizeConfig, quantized: Manifest, store: ArtifactStore) -> Manifest:
    """Derive the dequantized twin of a quantized artifact (see the module docstring)."""
    if quantized.stage != quantize.STAGE:
        raise ArtifactError(
            f"the dequantize stage needs a '{quantize.STAGE}' artifact, got stage '{quantized.stage}' at {quantized.dir}"
        )
    if quantized.mode == UNQUANTIZED_MODE:
        raise ArtifactError(
            f"{quantized.dir} is an unquantized base (quantize.scheme none): it has no NVFP4 twin, "
            "engines serve it directly"
        )
    dtype_name = quantize.twin_dtype(cfg)
    dtype = getattr(torch, dtype_name)
    code = code_version(sys.modules[__name__])
    src = quantized.dir
    if quantized.mode == NF4_MODE:
        return _run_nf4(cfg, quantized, store, dtype_name, code)

    def build(tmp: Path) -> BuildResult:
        t0 = time.perf_counter()
        aux = _plain_config(src, tmp, dtype_name)
        specs = safetensors_index(src)
        groups = []
        for name in sorted(specs, key=natural_key):
            spec = specs[name]
            if name.endswith((".weight_scale", ".weight_global_scale")):
                continue
            if name.endswith(".weight_packed"):
                base = name[: -len(".weight_packed")]
                out_f, half = spec.shape
                out = TensorSpec(f"{base}.weight", DTYPE_NAMES[dtype], (out_f, half * 2))

                def produce(base: str = base, out_name: str = out.name) -> dict[str, torch.Tensor]:
                    p, s, g = (read_tensor(specs[f"{base}.{k}"]) for k in QUANT_SUFFIXES)
                    return {out_name: nvfp4_dispatch.dequantize(p, s, g, dtype=dtype)}

                groups.append(([out], produce))
            else:
                groups.append(([TensorSpec(name, spec.dtype, spec.shape)], quantize.copy_producer(spec)))
        with tqdm(total=len(groups), desc="dequantize twin", unit="tensor", disable=None) as bar:
            write_sharded(tmp, groups, int(cfg.max_shard_mb * 2**20), progress=bar.update)
        linears = sum(1 for n in specs if n.endswith(".weight_packed"))
        note = "Linear weights are qerl.kernels.nvfp4_reference.dequantize_nvfp4 of the NVFP4 checkpoint"
        return _twin_result(TWIN_MODE, t0, cfg, quantized, dtype_name, linears, aux, note)

    key = {**key_payload(cfg), "twin_dtype": dtype_name}
    return store.produce(STAGE, key, {"quantized": quantized.digest}, code, build)[0]


def _run_nf4(
    cfg: QuantizeConfig, quantized: Manifest, store: ArtifactStore, dtype_name: str, code: str
) -> Manifest:
    """The dequantized twin of an NF4 base: plain linears, the quantization states dropped."""
    dtype = getattr(torch, dtype_name)
    src = quantized.dir

    def build(tmp: Path) -> BuildResult:
        t0 = time.perf_counter()
        aux = _plain_config(src, tmp, dtype_name)
        specs = safetensors_index(src)
        modules = nf4_linears(specs)
        weights = dequantized_linears(src, dtype)  # natural order: write_sharded asks in that order
        groups = []
        for name in sorted(specs, key=natural_key):
            spec = specs[name]
            module = name[: -len(".weight")] if name.endswith(".weight") else None
            if any(name.startswith(f"{m}.weight.") for m in modules):
                continue  # the quantization state of an NF4 linear
            if module in modules:
                out = TensorSpec(name, DTYPE_NAMES[dtype], nf4_shape(specs, module))

                def produce(module: str = module, out_name: str = name) -> dict[str, torch.Tensor]:
                    got, weight = next(weights)
                    if got != module:
                        raise RuntimeError(f"NF4 twin: {got} dequantized where {module} was expected")
                    return {out_name: weight}

                groups.append(([out], produce))
            else:
                groups.append(([TensorSpec(name, spec.dtype, spec.shape)], quantize.copy_producer(spec)))
        with tqdm(total=len(groups), desc="dequantize NF4 twin", unit="tensor", disable=None) as bar:
            write_sharded(tmp, groups, int(cfg.max_shard_mb * 2**20), progress=bar.update)
        note = "Linear weights are bitsandbytes' dequantize_4bit of the NF4 checkpoint"
        return _twin_result(NF4_TWIN_MODE, t0, cfg, quantized, dtype_name, len(modules), aux, note)

    key = {**key_payload(cfg), "twin_dtype": dtype_name}
    return store.produce(STAGE, key, {"quantized": quantized.digest}, code, build)[0]


def _plain_config(src: Path, tmp: Path, dtype_name: str) -> list[str]:
    """The twin's config.json (no quantization_config, the twin's dtype) and the source's other files."""
    aux = quantize.copy_aux_files(src, tmp)
    config = read_model_config(src)
    config.pop("quantization_config", None)
    config["torch_dtype" if "torch_dtype" in config else "dtype"] = dtype_name
    atomic_write_json(tmp / "config.json", config)
    return aux


def _twin_result(
    mode: str, t0: float, cfg: QuantizeConfig, quantized: Manifest, dtype_name: str, linears: int,
    aux: list[str], note: str,
) -> BuildResult:  # fmt: skip
    return BuildResult(
        mode=mode,
        metrics={"seconds": time.perf_counter() - t0},
        extra={
            "derived_from": {"stage": quantized.stage, "key": quantized.key, "digest": quantized.digest},
            "base_digest": quantized.extra.get("base_digest"),
            "dtype": dtype_name,
            "dequantized_linears": linears,
            "aux_files": aux,
            "max_shard_mb": cfg.max_shard_mb,  # a resource field: recorded, not keyed
            "note": f"derived artifact: {note}",
        },
    )
