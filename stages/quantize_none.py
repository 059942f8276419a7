"""The quantize stage with ``quantize.scheme: none``: the 16-bit arm of an ablation.

What: ``run_none`` makes the quantize stage's artifact the *unquantized* base (mode ``unquantized``):
every floating tensor cast to the twin dtype (``train.dtype`` in a run), the rest copied, no
``quantization_config``. Engines serve it directly and the trainer loads it as a plain HF model, so
no twin is derived. The cast is why it is a stage and not the source directory itself: sampler and
trainer must hold the same weights, exactly as for the twin (``qerl.pipeline.planning.run_checks``).
Its key is the scheme and the dtype, the base's content digest and this module's code version.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import torch
from qerl.pipeline.nvfp4.recipe import QuantizeConfig, read_model_config, twin_dtype
from qerl.pipeline.nvfp4.safetensors_io import (
    DTYPE_NAMES,
    Progress,
    TensorSpec,
    copy_aux_files,
    copy_producer,
    natural_key,
    read_tensor,
    safetensors_index,
    tensor_bar,
    write_sharded,
)
from qerl.pipeline.schemes import UNQUANTIZED_MODE
from qerl.pipeline.store.artifact_store import ArtifactStore
from qerl.pipeline.store.code_version import code_version
from qerl.pipeline.store.files import atomic_write_json
from qerl.pipeline.store.layout import QUANTIZE_STAGE
from qerl.pipeline.store.manifest import BuildResult, Manifest

__all__ = ["run_none"]

log = logging.getLogger("qerl.stages.quantize")


def run_none(
    cfg: QuantizeConfig, src_dir: Path, source: str, store: ArtifactStore, progress: Progress | None
) -> tuple[Manifest, bool]:
    """``scheme: none``: the base with its floating tensors in the twin dtype (see the module docstring)."""
    read_model_config(src_dir)  # a clear error for a directory that is no HF model
    specs = safetensors_index(src_dir)
    base_digest = store.source_digest(src_dir)
    dtype_name = twin_dtype(cfg)
    dtype = getattr(torch, dtype_name)
    code = code_version(sys.modules[__name__])

    def build(tmp: Path) -> BuildResult:
        t0 = time.perf_counter()
        aux = copy_aux_files(src_dir, tmp)
        config = read_model_config(src_dir)
        config["torch_dtype" if "torch_dtype" in config else "dtype"] = dtype_name
        atomic_write_json(tmp / "config.json", config)
        groups: list = []
        for name in sorted(specs, key=natural_key):
            spec = specs[name]
            if spec.dtype in ("F32", "F16", "BF16", "F64") and spec.dtype != DTYPE_NAMES[dtype]:
                out = TensorSpec(name, DTYPE_NAMES[dtype], spec.shape)
                groups.append(([out], lambda spec=spec: {spec.name: read_tensor(spec).to(dtype)}))
            else:
                groups.append(([TensorSpec(name, spec.dtype, spec.shape)], copy_producer(spec)))
        with tensor_bar(len(groups), f"unquantized {src_dir.name}", progress) as advance:
            write_sharded(tmp, groups, int(cfg.max_shard_mb * 2**20), progress=advance)
        log.info("quantize.scheme none: %s copied unquantized in %s", src_dir, dtype_name)
        return BuildResult(
            mode=UNQUANTIZED_MODE,
            metrics={"seconds": time.perf_counter() - t0},
            extra={
                "base_digest": base_digest,
                "source": source,
                "recipe": {"scheme": "none", "dtype": dtype_name},
                "dtype": dtype_name,
                "aux_files": aux,
                "max_shard_mb": cfg.max_shard_mb,  # a resource field: recorded, not keyed
                "note": "quantize.scheme none: the base model unquantized, floating tensors cast to dtype",
            },
        )

    key = {"scheme": "none", "dtype": dtype_name}
    return store.produce(QUANTIZE_STAGE, key, {"base": base_digest}, code, build)
