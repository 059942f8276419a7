"""Stage ``quality``: what quantization cost, measured on a checkpoint already written.

What: ``run(cfg, quantized, src, store, texts)`` measures an NVFP4 or NF4 checkpoint (the quantize
stage's artifact) against the model it was quantized from (``qerl.pipeline.nvfp4.quality``: per-linear
weight error; KL, top-1 and both perplexities on held-out prompt + completion texts) and keeps the
section as ``quality.json`` and in its manifest (``extra["quality"]``), its time in
``metrics["seconds"]``. ``texts`` is ``qerl.pipeline.data.heldout``'s (label, items, digest): in a
run, its validation split with reference completions where the data has them (``validation_texts``),
else the source ``quantize.quality.source`` names (test splits).

Why a stage of its own, not part of the quantize build: the report loads two whole models, which
can run out of memory where GPTQ fit (from 14B up on an 80 GB GPU); inside the build, a failure
would throw the finished checkpoint away with it. Here the checkpoint is committed first, and a report that
fails costs the report only. Its key is the checkpoint's content digest, the base's digest, the
settings and the texts' digest, so changing a quality setting, or the texts (a data directory
appearing, another validation split), re-measures and never re-quantizes.

The base model's logits are spilled under the build's own folder, in the store on the work
directory's disk, not in ``$TMPDIR``, and counted before a model loads (``check_spill_space``: the
completion tokens times the vocabulary in float32; too little free space is an error with both
numbers); the file is unlinked as it is made, so it never becomes part of the artifact. On a GPU the
device's cache is emptied after the two passes, before the rollout engine asks for its share.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from qerl.pipeline.nvfp4.quality import QualityConfig, check_texts, quality_section
from qerl.pipeline.runtime.device import free_device_cache
from qerl.pipeline.schemes import mode_scheme, scheme_module, scheme_module_name
from qerl.pipeline.store.artifact_store import ArtifactStore
from qerl.pipeline.store.code_version import code_version
from qerl.pipeline.store.files import atomic_write_json
from qerl.pipeline.store.layout import QUANTIZE_STAGE
from qerl.pipeline.store.manifest import ArtifactError, BuildResult, Manifest

__all__ = ["STAGE", "run"]

STAGE = "quality"
QUALITY_FILE = "quality.json"


def run(
    cfg: QualityConfig,
    quantized: Manifest,
    src: str | Path,
    store: ArtifactStore,
    texts: tuple[str, list[dict[str, Any]], str] | None,
) -> Manifest:
    """The quality section of ``quantized`` (a quantize artifact of the model in ``src``), cached."""
    scheme = mode_scheme(quantized.mode)
    if quantized.stage != QUANTIZE_STAGE or "base_digest" not in quantized.extra or scheme == "none":
        raise ArtifactError(
            f"the quality stage measures a quantized 'quantize' artifact, not {quantized.stage} "
            f"({quantized.mode}) {quantized.dir}"
        )
    src_dir = Path(src)

    def build(tmp: Path) -> BuildResult:
        t0 = time.perf_counter()
        check_texts(cfg, src_dir, texts)  # no tokenizer, no chat template, a prompt too long: named first
        try:
            section = quality_section(cfg, src_dir, quantized.dir, texts, tmp, scheme_module(scheme))
        finally:
            free_device_cache()
        atomic_write_json(tmp / QUALITY_FILE, section)
        return BuildResult(
            mode="quality", metrics={"seconds": time.perf_counter() - t0}, extra={"quality": section}
        )

    inputs = {
        "checkpoint": quantized.digest,
        "base": str(quantized.extra["base_digest"]),
        "texts": texts[2] if texts is not None and cfg.texts > 0 else "none",
    }
    # which texts is the texts' digest; how they are put to the models is the settings'
    settings = {"prompt": cfg.prompt, "max_tokens": cfg.max_tokens, "dtype": cfg.dtype}
    # this module's closure (the report's code) and the scheme's decoding module
    code = code_version(sys.modules[__name__], scheme_module_name(scheme))
    return store.produce(STAGE, settings, inputs, code, build)[0]
