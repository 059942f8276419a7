"""Stage ``demo-base``: build (once, cached) the embedded demo's warmed-up tiny base model.

The output directory is an ordinary Hugging Face model directory, so the quantize stage treats it
like any downloaded checkpoint. Keyed by the demo config, the groups of problems its warm-up leaves
out (a run's validation split: the base never saw a problem promotion decides on, in any phrasing)
and the code of this stage's import closure (the demo model, its data and tokenizer), so it is built
once per machine and reused by every demo run.
"""

from __future__ import annotations

import sys
from pathlib import Path

from qerl.pipeline.demo import base_model as demo
from qerl.pipeline.store.artifact_store import ArtifactStore
from qerl.pipeline.store.code_version import code_version
from qerl.pipeline.store.files import sha256_json
from qerl.pipeline.store.manifest import BuildResult, Manifest

STAGE = "demo-base"


def run(cfg: demo.DemoBaseConfig, store: ArtifactStore, exclude: frozenset[str] = frozenset()) -> Manifest:
    """The cached demo base model's manifest (its directory is the HF model); its warm-up holds no
    problem of a group in ``exclude``."""

    def build(tmp: Path) -> BuildResult:
        metrics = demo.build_demo_base(tmp, cfg, exclude)
        extra = {"architecture": "Qwen2ForCausalLM", "excluded_groups": len(exclude)}
        return BuildResult(mode="demo", metrics=metrics, extra=extra)

    code = code_version(sys.modules[__name__])
    inputs = {"excluded": sha256_json(sorted(exclude))} if exclude else {}
    manifest, _ = store.produce(STAGE, cfg, inputs=inputs, code=code, build=build)
    return manifest
