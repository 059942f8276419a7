"""Stage ``demo-base``: build (once, cached) the embedded demo's warmed-up tiny base model.

The output directory is an ordinary Hugging Face model directory, so the quantize stage treats it
like any downloaded checkpoint. Keyed by the demo config and the code of this stage's import closure
(the demo model, its data and tokenizer), so it is built once per machine and reused by every demo run.
"""

from __future__ import annotations

import sys
from pathlib import Path

from qerl.pipeline.demo import base_model as demo
from qerl.pipeline.store.artifact_store import ArtifactStore
from qerl.pipeline.store.code_version import code_version
from qerl.pipeline.store.manifest import BuildResult, Manifest

STAGE = "demo-base"


def run(cfg: demo.DemoBaseConfig, store: ArtifactStore) -> Manifest:
    """The cached demo base model's manifest (its directory is the HF model)."""

    def build(tmp: Path) -> BuildResult:
        metrics = demo.build_demo_base(tmp, cfg)
        return BuildResult(mode="demo", metrics=metrics, extra={"architecture": "Qwen2ForCausalLM"})

    code = code_version(sys.modules[__name__])
    manifest, _ = store.produce(STAGE, cfg, inputs={}, code=code, build=build)
    return manifest
