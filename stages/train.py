"""Train stage: one RL step's LoRA GRPO update on the NVFP4 base, from scored rollouts.

What: ``run(cfg, base, scored, prev, step, store)`` loads the quantize stage's checkpoint as packed
NVFP4 layers (pipeline.qlinear), restores the previous step's adapter/optimizer/scheduler/RNG
checkpoint (or initialises LoRA from ``cfg.seed`` at step 0), applies ``pipeline.training.train_step``
to ``scored.parquet`` and writes the next checkpoint:

    adapter/                  plain peft adapter (adapter_config.json + adapter_model.safetensors);
                              base_model_name_or_path = the quantized base's directory
    optimizer.safetensors     AdamW moments and step counts
    trainer_state.json        RL step, optimizer updates, param groups, scheduler and RNG state

How it fits the store: the key covers the config, the step number and the digests of base, scored
rollouts and previous checkpoint, so a re-run after a crash finds finished steps and a changed input
retrains from there. Re-running a step gives the same bytes on CPU (seeded shuffling, restored RNG,
deterministic kernels). The manifest's ``mode`` says how the base ran: "nvfp4-torch-reference"
(CPU: PyTorch dequantizer), "nvfp4-triton" (CUDA) or "hf-<dtype>" for an unquantized base (used by
benchmarks and tests); a non-finite update is reported in the metrics (``skipped``), not hidden.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import torch

import kernels.nvfp4
import pipeline.grpo
import pipeline.qlinear
import pipeline.training
from pipeline.artifacts import ArtifactError, ArtifactStore, BuildResult, Manifest, code_version
from pipeline.training import (
    TrainConfig,
    init_state,
    load_checkpoint,
    load_rollout_batch,
    save_checkpoint,
    train_step,
)

log = logging.getLogger("qerl.stages.train")

STAGE = "train"
SCORED_FILE = "scored.parquet"


def _pad_id(base_dir: Path) -> int:
    """The tokenizer's pad id (any id works under the attention mask; this keeps inputs sensible)."""
    for name in ("generation_config.json", "config.json"):
        path = base_dir / name
        if path.is_file():
            value = json.loads(path.read_text()).get("pad_token_id")
            if isinstance(value, int):
                return value
    return 0


def _mode(state_format: str, cfg: TrainConfig, device: str) -> str:
    if state_format == "nvfp4":
        return "nvfp4-triton" if device.startswith("cuda") else "nvfp4-torch-reference"
    return f"hf-{cfg.dtype}"


def run(
    cfg: TrainConfig,
    base: Manifest,
    scored: Manifest,
    prev: Manifest | None,
    step: int,
    store: ArtifactStore,
) -> Manifest:
    """Produce (or find cached) the checkpoint after RL step ``step`` (0-based)."""
    if prev is None and step != 0:
        raise ArtifactError(f"train step {step} needs the previous train checkpoint (prev is None)")
    if prev is not None and prev.stage != STAGE:
        raise ArtifactError(f"prev must be a '{STAGE}' artifact, got '{prev.stage}' at {prev.dir}")
    scored_path = scored.file(SCORED_FILE)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    code = code_version(
        sys.modules[__name__], pipeline.training, pipeline.grpo, pipeline.qlinear, kernels.nvfp4
    )
    inputs = {
        "base": base.digest,
        "scored": scored.digest,
        "prev": prev.digest if prev is not None else "none",
    }
    config = {"train": cfg.model_dump(mode="json"), "step": step}

    def build(tmp: Path) -> BuildResult:
        if prev is None:
            state = init_state(base.dir, cfg, device)
        else:
            state = load_checkpoint(base.dir, cfg, prev.dir, device)
            if state.step != step:
                raise ArtifactError(
                    f"{prev.dir} holds the state after {state.step} steps, but step {step} was asked"
                )
        batch = load_rollout_batch(scored_path, temperature=cfg.temperature)
        metrics = train_step(state, batch, cfg, pad_id=_pad_id(base.dir))
        save_checkpoint(state, tmp)
        mode = _mode(state.base_format, cfg, device)
        if metrics["skipped"]:
            log.warning(
                "train step %d: %d update(s) skipped for a non-finite loss/gradient",
                step,
                metrics["skipped_updates"],
            )
        log.info(
            "train step %d (%s): loss %.4g, grad norm %.3g, reward %.3f, %d updates in %.1f s",
            step,
            mode,
            metrics["loss"],
            metrics["grad_norm"],
            metrics["reward_mean"],
            metrics["updates"],
            metrics["step_time_s"],
        )
        return BuildResult(
            mode=mode,
            metrics=metrics,
            extra={
                "step": step,
                "steps_done": state.step,
                "updates_done": state.updates,
                "adapter": "adapter",
            },
        )

    manifest, cached = store.produce(STAGE, config, inputs, code, build)
    if cached:
        log.info("train step %d: cached at %s", step, manifest.dir)
    return manifest
