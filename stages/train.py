"""Train stage: one RL step's LoRA GRPO update on the NVFP4 base, from scored rollouts.

What: ``run(cfg, base, scored, prev, step, store)`` loads the quantize stage's checkpoint as packed
NVFP4 layers (qerl.pipeline.nvfp4.linear), restores the previous step's adapter/optimizer/scheduler/RNG
checkpoint (or initialises LoRA from ``cfg.seed`` at step 0), applies ``qerl.pipeline.rl.step.train_step``
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

AQN noise: the rollouts carry their step's sigma and noise seed (``sigma``/``noise_seed`` columns);
``grpo.aqn_objective`` (on_policy, noisy_trainer) applies that noise inside the trainer through
``qerl.pipeline.rollout.aqn.apply_to_hf_model`` (``qerl.pipeline.rl.objective`` says what each choice
means), always removed again before the checkpoint is saved. The choice is part of the train config,
so of the cache key, except on a noise-free step (the scored rollouts' ``aqn_sigma`` is 0), where
every choice computes the same update: such a step is keyed as ``clean_is``, so an ablation's arms
that differ only in the objective share AQN's noise-free first stage, as the arms with and without
AQN do. The manifest's ``extra["aqn"]`` records the run's choice with the sigma and seed the step saw
and whether the trainer ran with the noise.

Resident policy. Rebuilding the policy from disk every step (base load, peft wrap, optimizer) costs
seconds per step for a 7B base, so the state a step leaves behind stays in this process, keyed by
what determines it: base digest, train config, device, and the digest of the checkpoint it was
saved as. The next step reuses it only when its ``prev`` is exactly that checkpoint (same digest)
on the same base and config; anything else (a resume after a crash, a changed config, another
chain) reloads from the store, which stays the record: every step still writes its checkpoint.
The resident state equals what ``load_checkpoint`` would rebuild bit for bit (parameters, AdamW
moments and step counts, scheduler, step/update counters); the one thing other stages touch in
between is the global torch RNG, so it is reset to the value saved with the checkpoint, as a
reload does. A step that fails mid-way drops the resident state (``train_step`` mutates it in
place). Whether a step reused or reloaded is logged at INFO and recorded in the manifest's
``extra["policy"]``. ``drop_resident_policy()`` frees it (end of a run, tests).

Threads. The step runs with torch's MKL and OpenMP threading as a fresh process has it (no nested
OpenMP teams, MKL dynamic, no thread-local MKL count) and, on CPU, intra-op thread i pinned to the
i-th allowed CPU, all restored after (``qerl.pipeline.runtime.threads.trainer_threads``). Any earlier
``torch.set_num_threads`` (a vLLM engine start does one) otherwise leaves MKL non-dynamic with a
thread-local count, so it opens a nested team, a new thread, for every GEMM inside torch's parallel
regions and steps slow down many times over. The same GEMMs as in a fresh process run, so the bytes
are a fresh process's.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from qerl.pipeline.rl.batch import RolloutBatch, load_rollout_batch
from qerl.pipeline.rl.checkpoint import load_checkpoint, save_checkpoint
from qerl.pipeline.rl.policy import TrainState, init_state
from qerl.pipeline.rl.step import train_step
from qerl.pipeline.rl.train_config import TrainConfig
from qerl.pipeline.rollout.aqn import apply_to_hf_model
from qerl.pipeline.runtime.determinism import deterministic_kernels
from qerl.pipeline.runtime.device import cuda_available, default_device
from qerl.pipeline.runtime.threads import trainer_threads
from qerl.pipeline.schemes import mode_scheme, scheme_module_name
from qerl.pipeline.store.artifact_store import ArtifactStore
from qerl.pipeline.store.code_version import code_version
from qerl.pipeline.store.layout import OPTIMIZER_FILE, TRAIN_STAGE
from qerl.pipeline.store.manifest import ArtifactError, BuildResult, Manifest

log = logging.getLogger("qerl.stages.train")

STAGE = TRAIN_STAGE
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


@dataclass
class _Resident:
    """The state after a step, with what it was built from and the checkpoint it was saved as."""

    key: dict[str, Any]  # base digest, train config, device
    digest: str  # the saved checkpoint's manifest digest: the state equals that checkpoint
    state: TrainState
    rng: dict[str, Any]  # torch RNG state(s) as saved with the checkpoint


_resident: _Resident | None = None
_resident_lock = threading.Lock()


def drop_resident_policy() -> bool:
    """Free the resident policy (if any); returns whether there was one."""
    global _resident
    with _resident_lock:
        had, _resident = _resident is not None, None
    return had


def _take_resident(key: dict[str, Any], prev: Manifest | None) -> tuple[TrainState | None, str]:
    """The resident state if it is exactly ``prev`` on this base/config (taken out of the cache:
    the step mutates it), else None; always with the reason, for the log."""
    global _resident
    with _resident_lock:
        held, _resident = _resident, None
    if prev is None:
        return None, "step 0: fresh LoRA"
    if held is None:
        return None, "no resident policy in this process"
    if held.digest != prev.digest:
        return None, f"resident policy is checkpoint {held.digest[:12]}, prev is {prev.digest[:12]}"
    if held.key != key:
        changed = sorted(k for k in key if held.key.get(k) != key[k])
        return None, f"resident policy was built with a different {', '.join(changed)}"
    _restore_rng(held.rng)
    return held.state, f"resident policy reused (checkpoint {prev.digest[:12]})"


def _rng_state() -> dict[str, Any]:
    rng: dict[str, Any] = {"torch_cpu": torch.get_rng_state()}
    if cuda_available():
        rng["torch_cuda"] = torch.cuda.get_rng_state_all()
    return rng


def _restore_rng(rng: dict[str, Any]) -> None:
    """Put the global RNG back where the checkpoint left it (other stages may have drawn from it)."""
    torch.set_rng_state(rng["torch_cpu"])
    if "torch_cuda" in rng:
        torch.cuda.set_rng_state_all(rng["torch_cuda"])


def _mode(state_format: str, cfg: TrainConfig, device: str) -> str:
    if state_format == "nvfp4":
        return "nvfp4-triton" if device.startswith("cuda") else "nvfp4-torch-reference"
    if state_format == "nf4":
        return f"nf4-bitsandbytes-{cfg.dtype}"
    return f"hf-{cfg.dtype}"


def code_roots(base: Manifest) -> tuple[str, ...]:
    """The modules a step's code version covers: this one's import closure (rl, the objective) and
    the base's scheme's training loader (``qerl.pipeline.schemes``: NVFP4's packed layers and the
    kernels, or NF4's), chosen by the mode of the quantize artifact the step trains on."""
    scheme = mode_scheme(base.mode)
    return (__name__,) if scheme == "none" else (__name__, scheme_module_name(scheme, training=True))


def _key_parts(
    cfg: TrainConfig, base: Manifest, scored: Manifest, prev: Manifest | None, step: int,
    init_adapter: tuple[Path, str] | None,
) -> tuple[dict[str, Any], dict[str, str], str]:  # fmt: skip
    """(config, inputs, code) of a train step's store key."""
    code = code_version(*code_roots(base))
    inputs = {
        "base": base.digest,
        "scored": scored.digest,
        "prev": prev.digest if prev is not None else "none",
    }
    if init_adapter is not None:  # only then: plain runs keep their cache keys
        inputs["init_adapter"] = init_adapter[1]
    if scored.metrics.get("aqn_sigma") == 0.0 and cfg.grpo.aqn_objective != "clean_is":
        # every objective is the same update on a noise-free step: key it as one (module notes)
        cfg = cfg.model_copy(update={"grpo": cfg.grpo.model_copy(update={"aqn_objective": "clean_is"})})
    return {"train": cfg, "step": step}, inputs, code  # keyed without resource fields (key_payload)


def cached(
    *, cfg: TrainConfig, base: Manifest, scored: Manifest, prev: Manifest | None, step: int,
    store: ArtifactStore, init_adapter: tuple[Path, str] | None = None,
) -> Manifest | None:  # fmt: skip
    """The finished checkpoint of this step if the store has it (no build), else None."""
    config, inputs, code = _key_parts(cfg, base, scored, prev, step, init_adapter)
    return store.get(STAGE, store.key(STAGE, config, inputs, code))


def _check_chain(prev: Manifest | None, step: int, init_adapter: tuple[Path, str] | None) -> None:
    """``prev`` is the previous step's train checkpoint (none at step 0, and only then a warm start)."""
    if init_adapter is not None and prev is not None:
        raise ArtifactError(f"train step {step}: init_adapter is for step 0 only (prev is given)")
    if prev is None and step != 0:
        raise ArtifactError(f"train step {step} needs the previous train checkpoint (prev is None)")
    if prev is not None and prev.stage != STAGE:
        raise ArtifactError(f"prev must be a '{STAGE}' artifact, got '{prev.stage}' at {prev.dir}")


def _policy(
    cfg: TrainConfig, base: Manifest, prev: Manifest | None, step: int, device: str,
    resident_key: dict[str, Any], init_adapter: tuple[Path, str] | None,
) -> tuple[TrainState, bool, float]:  # fmt: skip
    """The state before step ``step``: the resident one if it is ``prev``, else built or reloaded;
    with whether it was resident and the seconds it took."""
    t0 = time.perf_counter()
    state, reason = _take_resident(resident_key, prev)
    reused = state is not None
    if state is None and prev is None:
        state = init_state(base.dir, cfg, device, init_adapter=init_adapter[0] if init_adapter else None)
    elif state is None:
        # a clear error if retention pruned what a reload needs (checked here: a cache hit needs none)
        prev.require("adapter", OPTIMIZER_FILE, "trainer_state.json")
        state = load_checkpoint(base.dir, cfg, prev.dir, device)
    t_load = time.perf_counter() - t0
    how = "" if reused else ("; policy built" if prev is None else "; policy reloaded from the store")
    log.info("train step %d: %s%s (%.2f s)", step, reason, how, t_load)
    if state.step != step:
        raise ArtifactError(f"{prev.dir} holds the state after {state.step} steps, but step {step} was asked")
    return state, reused, t_load


def _aqn_record(cfg: TrainConfig, batch: RolloutBatch) -> dict[str, Any]:
    """The objective's treatment of the rollout's AQN noise, and the noise itself (manifest extra)."""
    choice = cfg.grpo.aqn_objective
    # where the trainer applied the rollout's noise: nowhere, its TIS reference pass, or every forward
    where = {"clean_is": "none", "on_policy": "tis-reference", "noisy_trainer": "forward"}[choice]
    return {
        "objective": choice,
        "sigma": batch.sigma,
        "noise_seed": batch.noise_seed,
        "trainer_noise": where if batch.sigma > 0.0 else "none",
    }


def _log_step(step: int, mode: str, metrics: dict[str, Any]) -> None:
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


def run(
    *,
    cfg: TrainConfig,
    base: Manifest,
    scored: Manifest,
    prev: Manifest | None,
    step: int,
    store: ArtifactStore,
    init_adapter: tuple[Path, str] | None = None,
    heal: bool = False,
) -> Manifest:
    """Produce (or find cached) the checkpoint after RL step ``step`` (0-based).

    ``heal``: a cached checkpoint that retention pruned is rebuilt and its files put back
    (``ArtifactStore.produce``); ``prev`` must then be whole.

    ``init_adapter`` (adapter folder, its digest): step 0 starts from these LoRA weights instead of a
    fresh LoRA (a nightly run's warm start); the digest joins the cache key."""
    _check_chain(prev, step, init_adapter)
    device = default_device()
    config, inputs, code = _key_parts(cfg, base, scored, prev, step, init_adapter)
    resident_key = {"base": base.digest, "train": config["train"], "device": device}
    built: dict[str, Any] = {}

    def build(tmp: Path) -> BuildResult:
        # MKL/OpenMP as in a fresh process, one core per intra-op thread (qerl.pipeline.runtime.threads)
        with trainer_threads(device) as pins, deterministic_kernels(device, cfg.deterministic) as det:
            if pins:
                log.info("train step %d: intra-op threads pinned one per CPU %s", step, pins)
            return _build(tmp, det)

    def _build(tmp: Path, determinism: dict[str, Any]) -> BuildResult:
        state, reused, t_load = _policy(cfg, base, prev, step, device, resident_key, init_adapter)
        # read on a miss only: a cache hit needs no table (retention may have pruned it)
        batch = load_rollout_batch(scored.file(SCORED_FILE), temperature=cfg.temperature)
        metrics = train_step(state, batch, cfg, pad_id=_pad_id(base.dir), noise_fn=apply_to_hf_model)
        save_checkpoint(state, tmp)
        built.update(state=state, rng=_rng_state())
        mode = _mode(state.base_format, cfg, device)
        _log_step(step, mode, metrics)
        return BuildResult(
            mode=mode,
            metrics=metrics,
            extra={
                "step": step,
                "steps_done": state.step,
                "updates_done": state.updates,
                "adapter": "adapter",
                "policy": "resident" if reused else "loaded",
                "policy_load_s": round(t_load, 3),
                "aqn": _aqn_record(cfg, batch),
                **({"determinism": determinism} if determinism else {}),  # CUDA only
            },
        )

    manifest, cached = store.produce(STAGE, config, inputs, code, build, heal=heal)
    if cached:
        log.info("train step %d: cached at %s", step, manifest.dir)
    elif built:
        global _resident
        with _resident_lock:
            _resident = _Resident(resident_key, manifest.digest, built["state"], built["rng"])
    return manifest
