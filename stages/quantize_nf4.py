"""The quantize stage with ``quantize.scheme: nf4``: QLoRA's base (bitsandbytes NF4, double quantization).

What: ``run_nf4`` writes the checkpoint ``qerl.pipeline.nf4.checkpoint.write_nf4`` makes (transformers'
own bitsandbytes serialization, so transformers and vLLM load it as theirs), with the source model's
tokenizer and generation files, as the quantize stage's artifact in mode ``nf4/bitsandbytes``. The
linears it quantizes are the NVFP4 recipe's (``targets`` less ``keep``, checked by the same plan
before anything is written); embeddings, norms and lm_head stay in the twin dtype (``train.dtype`` in
a run), which is also the compute dtype the checkpoint names. Its manifest records ``scheme: nf4``,
``bitsandbytes`` with its version, and the quantization type, block size and double quantization as
the written quantization states hold them (one layout for every linear, or the build fails).

The key is the base's content digest, the scheme, the dtype, targets and keep, and this module's code
version. ``method``, ``calibration``, ``scale_sweep`` and ``fused_groups`` are NVFP4's and are not in
it: NF4 rounds each block of 64 weights to the nearest of its 16 levels, as QLoRA does.
"""

from __future__ import annotations

import sys
import time
from importlib.metadata import version
from pathlib import Path

import torch
from qerl.pipeline.nf4.checkpoint import write_nf4, written_layout
from qerl.pipeline.nvfp4.grouping import kept_linears, plan_quantization
from qerl.pipeline.nvfp4.recipe import (
    KNOWN_PROJECTIONS,
    QuantizeConfig,
    check_architecture,
    read_model_config,
    twin_dtype,
)
from qerl.pipeline.nvfp4.safetensors_io import Progress, copy_aux_files, safetensors_index
from qerl.pipeline.runtime.device import free_device_cache
from qerl.pipeline.schemes import NF4_MODE
from qerl.pipeline.store.artifact_store import ArtifactStore
from qerl.pipeline.store.code_version import code_version
from qerl.pipeline.store.layout import QUANTIZE_STAGE
from qerl.pipeline.store.manifest import BuildResult, Manifest

__all__ = ["run_nf4"]


def run_nf4(
    cfg: QuantizeConfig, src_dir: Path, source: str, store: ArtifactStore, progress: Progress | None = None
) -> tuple[Manifest, bool]:
    """The NF4 base of ``src_dir`` (see the module docstring); (manifest, whether it was cached)."""
    model_config = read_model_config(src_dir)
    arch = check_architecture(model_config, cfg)
    specs = safetensors_index(src_dir)
    plan = plan_quantization(specs, cfg)  # unknown linears and bad targets are refused here, before a write
    kept = kept_linears(specs, cfg)
    planned = {s.name[: -len(".weight")] for g in plan if g.quantize for s in g.sources} - set(kept)
    skip = ["lm_head", *kept, *(p for p in KNOWN_PROJECTIONS if p not in cfg.targets)]
    base_digest = store.source_digest(src_dir)
    dtype_name = twin_dtype(cfg)

    def build(tmp: Path) -> BuildResult:
        t0 = time.perf_counter()
        if progress is not None:
            progress(0, len(planned))
        written = write_nf4(src_dir, tmp, getattr(torch, dtype_name), skip, planned, cfg.max_shard_mb)
        aux = copy_aux_files(src_dir, tmp)
        free_device_cache()
        if progress is not None:
            progress(len(planned), len(planned))
        # what the file holds (bitsandbytes picks the block size by device), not what was asked for
        recipe = {"scheme": "nf4", "library": "bitsandbytes", "bitsandbytes": version("bitsandbytes"),
                  **written_layout(tmp), "dtype": dtype_name}  # fmt: skip
        return BuildResult(
            mode=NF4_MODE,
            metrics={"seconds": time.perf_counter() - t0, "bytes_out": written["bytes_out"]},
            extra={
                "base_digest": base_digest,
                "source": source,
                "architecture": arch,
                "recipe": recipe,
                "method": "nf4",
                "quantized_tensors": written["linears"],
                "device": written["device"],
                "aux_files": aux,
                "max_shard_mb": cfg.max_shard_mb,  # a resource field: recorded, not keyed
                **({"keep": kept} if kept else {}),
            },
        )

    key = {"scheme": "nf4", "dtype": dtype_name, "targets": list(cfg.targets), "keep": list(cfg.keep)}
    return store.produce(
        QUANTIZE_STAGE, key, {"base": base_digest}, code_version(sys.modules[__name__]), build
    )
