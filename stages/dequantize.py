"""Stage ``dequantize``: the dequantized twin of a quantized checkpoint, what the rollout engine serves
where no kernel for its format exists (vLLM on CPU).

What: ``run(cfg, quantized, store)`` writes a plain Hugging Face checkpoint whose quantized linears
hold exactly their scheme's dequantization, in ``quantize.twin_dtype`` (``train.dtype`` in a run, so
sampler and trainer hold the same weights; bfloat16 standalone), with no ``quantization_config``;
every other tensor and the tokenizer files are copied. It is its own stage so lineage says what it
is, streamed one linear at a time through ``write_sharded`` like the quantize stage. An unquantized
base (``quantize.scheme: none``) has no twin: engines serve it directly.

The scheme's decoding module (``qerl.pipeline.schemes``) does the arithmetic: for NVFP4 (mode
``nvfp4-dequantized-twin``) ``qerl.kernels``' decode of the codes and scales; for an NF4 base (mode
``nf4-dequantized-twin``) each linear's weight as bitsandbytes' ``dequantize_4bit`` computes it,
which is the compute dtype the trainer's ``Linear4bit`` layers dequantize to: the same values. Each
twin weight takes the place of its linear's codes in the file order; the quantization state's other
tensors are dropped.

The cache key is the twin dtype, the quantized checkpoint's content digest and the code version of
this module and of the scheme's decoding module: nothing of the quantize recipe (the checkpoint's
digest says which it is) and nothing of the quality settings.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from qerl.pipeline.nvfp4.recipe import QuantizeConfig, read_model_config, twin_dtype
from qerl.pipeline.nvfp4.safetensors_io import (
    DTYPE_NAMES,
    TensorSpec,
    copy_aux_files,
    copy_producer,
    natural_key,
    safetensors_index,
    write_sharded,
)
from qerl.pipeline.schemes import NF4_TWIN_MODE, TWIN_MODE, mode_scheme, scheme_module, scheme_module_name
from qerl.pipeline.store.artifact_store import ArtifactStore
from qerl.pipeline.store.code_version import code_version
from qerl.pipeline.store.files import atomic_write_json
from qerl.pipeline.store.layout import QUANTIZE_STAGE
from qerl.pipeline.store.manifest import ArtifactError, BuildResult, Manifest
from tqdm.auto import tqdm

__all__ = ["STAGE", "code_roots", "run"]

STAGE = "dequantize"
_MODES = {"nvfp4": TWIN_MODE, "nf4": NF4_TWIN_MODE}
_NOTES = {
    "nvfp4": "Linear weights are qerl.kernels.nvfp4_reference.dequantize_nvfp4 of the NVFP4 checkpoint",
    "nf4": "Linear weights are bitsandbytes' dequantize_4bit of the NF4 checkpoint",
}


def code_roots(scheme: str) -> tuple[str, ...]:
    """The modules a ``scheme`` twin's code version covers: this one and the scheme's decoding module."""
    return __name__, scheme_module_name(scheme)


def run(cfg: QuantizeConfig, quantized: Manifest, store: ArtifactStore) -> Manifest:
    """Derive the dequantized twin of a quantized artifact (see the module docstring)."""
    if quantized.stage != QUANTIZE_STAGE:
        raise ArtifactError(
            f"the dequantize stage needs a '{QUANTIZE_STAGE}' artifact, got stage '{quantized.stage}' at {quantized.dir}"
        )
    scheme = mode_scheme(quantized.mode)
    if scheme == "none":
        raise ArtifactError(
            f"{quantized.dir} is an unquantized base (quantize.scheme none): it has no twin, "
            "engines serve it directly"
        )
    dtype_name = twin_dtype(cfg)
    dtype = getattr(torch, dtype_name)
    decoder = scheme_module(scheme)
    src = quantized.dir

    def build(tmp: Path) -> BuildResult:
        t0 = time.perf_counter()
        aux = copy_aux_files(src, tmp)
        config = read_model_config(src)
        config.pop("quantization_config", None)
        config["torch_dtype" if "torch_dtype" in config else "dtype"] = dtype_name
        atomic_write_json(tmp / "config.json", config)
        specs = safetensors_index(src)
        shapes = decoder.quantized_linears(specs)
        anchors, dropped = {}, set()
        for module in shapes:  # the twin's weight goes where the linear's codes were
            first, *rest = decoder.state_tensors(specs, module)
            anchors[first] = module
            dropped.update(rest)
        weights = decoder.dequantized_linears(src, dtype)  # natural order, as write_sharded asks
        groups = []
        for name in sorted(specs, key=natural_key):
            if name in dropped:
                continue
            if name not in anchors:
                groups.append(
                    ([TensorSpec(name, specs[name].dtype, specs[name].shape)], copy_producer(specs[name]))
                )
                continue
            module = anchors[name]
            out = TensorSpec(f"{module}.weight", DTYPE_NAMES[dtype], shapes[module])

            def produce(module: str = module, out_name: str = out.name) -> dict[str, torch.Tensor]:
                got, weight = next(weights)
                if got != module:
                    raise RuntimeError(f"twin: {got} dequantized where {module} was expected")
                return {out_name: weight}

            groups.append(([out], produce))
        with tqdm(total=len(groups), desc=f"dequantize {scheme} twin", unit="tensor", disable=None) as bar:
            write_sharded(tmp, groups, int(cfg.max_shard_mb * 2**20), progress=bar.update)
        return BuildResult(
            mode=_MODES[scheme],
            metrics={"seconds": time.perf_counter() - t0},
            extra={
                "derived_from": {"stage": quantized.stage, "key": quantized.key, "digest": quantized.digest},
                "base_digest": quantized.extra.get("base_digest"),
                "dtype": dtype_name,
                "dequantized_linears": len(shapes),
                "aux_files": aux,
                "max_shard_mb": cfg.max_shard_mb,  # a resource field: recorded, not keyed
                "note": f"derived artifact: {_NOTES[scheme]}",
            },
        )

    code = code_version(*code_roots(scheme))
    return store.produce(STAGE, {"twin_dtype": dtype_name}, {"quantized": quantized.digest}, code, build)[0]
