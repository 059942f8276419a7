"""The run config's cross-field rules: the settings derived from others, and the combinations refused.

The rules run when a ``RunConfig`` is validated (its ``model_validator``s call ``derived_settings``
and ``check_consistent``), not in the stages, so a bad combination fails when the config is loaded
rather than after the first step:

- the train stage's sampling temperature equals the rollout engine's, and a group has >= 2 samples;
- the LR schedule spans the loop: ``train.total_steps: null`` (the default) is derived as
  ``loop.steps`` x the optimizer updates of one RL step, ``mu * ceil(ceil(prompts_per_step *
  n_samples / minibatch_size) / grad_accum)`` (what ``qerl.pipeline.rl.step`` runs); an explicit value
  shorter than that is rejected, since the cosine would then hold lr at its floor for the rest of
  the run (a longer one is allowed: the run stops before the end of the decay);
- sampler and trainer hold the same weights: the dequantized twin (what vLLM serves on a CPU and
  the HF engine runs) is stored in ``train.dtype`` (``quantize.twin_dtype: null`` derives it; any
  other value is rejected), and the rollout dtype is ``train.dtype`` or ``auto``. ``auto`` is
  refused for a float32 trainer on vLLM, which serves float32 checkpoints in bfloat16 under
  ``auto``. A twin in another dtype than the trainer's differs from the trainer's weights, so the
  importance ratio would compare two different functions;
- the adapter fits the engine: LoRA is on and ``train.lora_r <= rollout.max_lora_rank``, one of the
  ranks vLLM accepts;
- the evaluation fits the engine: ``eval.max_new_tokens < rollout.max_model_len`` (the flow's one
  engine evaluates too), else every evaluation would fail after the last step; evaluation items whose
  prompt leaves too little room are dropped and counted when evaluated (``prompt_fit``);
- one data directory: with ``data.root`` set, a named benchmark of ``eval.benchmark`` or ``eval.also``
  without a ``root`` of its own takes it (derived here, so the run record and the evaluation's cache key
  say where the items came from); one with its own root keeps it, and a procedural set or a file path
  has no use for one. ``$QERL_DATA_DIR`` needs nothing derived: every load without a root reads it
  (``qerl.pipeline.data.datasets.data_root``), training and evaluation alike;
- the engine fits the model (``check_model``): tensor parallelism fits its heads
  (``check_parallelism``), and ``rollout.max_model_len`` is no longer than its
  ``max_position_embeddings`` unless a RoPE scaling extends them (``check_context``; vLLM refuses such
  an engine, the HF engine would run past the positions it was trained for). They need the model's
  config.json, so they run where that is known rather than in the validators: in ``load_run_config``
  for a local model directory, and after the base stage for any other source (the demo model, the
  catalogue, the hub), before the quantize stage;
- the engine can serve the run on this machine (``check_serving``): on CUDA, vLLM serves the NVFP4
  checkpoint on FP4 Marlin, in bfloat16 or float16 only, so a float32 run (the embedded demo's
  dtype) is refused when its config is loaded there, before the quantize stage, rather than in the
  engine's start; and it serves an NF4 base through bitsandbytes, which the installed vLLM must have.
  It depends on the machine, so it runs in ``load_run_config``, not in the validators (a config is
  valid on a CPU), and ``qerl plan``, whose plan is for a CUDA machine, runs the dtype part as if
  there were one.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from qerl.pipeline.config import ConfigError
from qerl.pipeline.data.datasets import NAMED, DataConfig
from qerl.pipeline.planning.engine_setup import VLLM_LORA_RANKS
from qerl.pipeline.rollout.config import RolloutConfig
from qerl.pipeline.rollout.factory import planned_mode, serving_error

if TYPE_CHECKING:
    from qerl.pipeline.planning.run_config import RunConfig


def derived_settings(cfg: RunConfig) -> dict[str, dict[str, Any]]:
    """The settings that follow from others (null = derived), by section; empty when none changes."""
    derived: dict[str, dict[str, Any]] = {}
    if cfg.train.total_steps is None:
        derived["train"] = {"total_steps": cfg.loop.steps * updates_per_step(cfg)}
    if cfg.quantize.twin_dtype is None:
        derived["quantize"] = {"twin_dtype": cfg.train.dtype}
    roots = _eval_roots(cfg)
    if roots:
        derived["eval"] = roots
    return derived


def check_consistent(cfg: RunConfig) -> None:
    """The cross-field rules of the module docstring that reject a combination (a ValueError each)."""
    if cfg.train.temperature != cfg.rollout.temperature:
        raise ValueError(
            f"train.temperature ({cfg.train.temperature}) must equal rollout.temperature "
            f"({cfg.rollout.temperature}): the importance ratio compares the same distribution"
        )
    if cfg.rollout.n_samples < 2:
        raise ValueError("rollout.n_samples must be >= 2: GRPO needs a group to compare against")
    if not cfg.rollout.logprobs:
        raise ValueError("rollout.logprobs is false: GRPO needs the sampler's per-token logprobs")
    _check_schedule(cfg)
    _check_dtypes(cfg)
    _check_lora(cfg)
    if cfg.eval.max_new_tokens >= cfg.rollout.max_model_len:
        raise ValueError(
            f"eval.max_new_tokens ({cfg.eval.max_new_tokens}) leaves no room for a prompt in the engine's "
            f"context (rollout.max_model_len {cfg.rollout.max_model_len}): every evaluation would fail after "
            f"training. Lower eval.max_new_tokens below {cfg.rollout.max_model_len} (with room for the "
            "prompts) or raise rollout.max_model_len"
        )


def _check_schedule(cfg: RunConfig) -> None:
    train, loop = cfg.train, cfg.loop
    per_step = updates_per_step(cfg)
    needed = loop.steps * per_step
    if train.total_steps is not None and train.total_steps < needed:
        raise ValueError(
            f"train.total_steps ({train.total_steps}) is shorter than the run's {needed} optimizer "
            f"updates (loop.steps {loop.steps} x {per_step} per step: {loop.prompts_per_step} prompts x "
            f"{cfg.rollout.n_samples} samples in minibatches of {train.minibatch_size}, grad_accum "
            f"{train.grad_accum}, mu {train.mu}): after update {train.total_steps} the cosine would hold "
            f"the lr at min_lr_ratio x lr ({train.min_lr_ratio * train.lr:g}) for the rest of the run. "
            f"Set train.total_steps: null to derive it, or >= {needed}"
        )
    total = train.total_steps if train.total_steps is not None else needed
    if train.warmup_steps >= total:
        raise ValueError(
            f"train.warmup_steps ({train.warmup_steps}) must be < the schedule's {total} updates"
        )


def _check_dtypes(cfg: RunConfig) -> None:
    train_dtype, twin, served = cfg.train.dtype, cfg.quantize.twin_dtype, cfg.rollout.dtype
    if twin is not None and twin != train_dtype:
        raise ValueError(
            f"quantize.twin_dtype ({twin}) must equal train.dtype ({train_dtype}): the twin is what "
            "the sampler serves on a CPU, so any other dtype samples from different weights than "
            "the trainer's (set quantize.twin_dtype: null to follow train.dtype)"
        )
    if served not in ("auto", train_dtype):
        raise ValueError(
            f"rollout.dtype ({served}) must be train.dtype ({train_dtype}) or auto: the sampler's "
            "logprobs must come from the trainer's weights and precision"
        )
    if served == "auto" and train_dtype == "float32" and cfg.rollout.engine == "vllm":
        raise ValueError(
            "rollout.dtype auto with train.dtype float32: vLLM serves a float32 checkpoint in "
            "bfloat16 under auto; set rollout.dtype: float32"
        )


def _check_lora(cfg: RunConfig) -> None:
    rollout, r = cfg.rollout, cfg.train.lora_r
    if not rollout.enable_lora:
        raise ValueError(
            "rollout.enable_lora is false: the rollout engine must serve each step's LoRA adapter"
        )
    if rollout.engine != "vllm":  # transformers applies the peft adapter as saved: no LoRA slots
        return
    if r > rollout.max_lora_rank:
        raise ValueError(
            f"train.lora_r ({r}) exceeds rollout.max_lora_rank ({rollout.max_lora_rank}): the engine "
            f"could not load the adapter; raise rollout.max_lora_rank to >= {r}"
        )
    if rollout.max_lora_rank not in VLLM_LORA_RANKS:
        raise ValueError(
            f"rollout.max_lora_rank ({rollout.max_lora_rank}) is not one vLLM accepts: "
            f"{', '.join(map(str, VLLM_LORA_RANKS))}"
        )


def _eval_roots(cfg: RunConfig) -> dict[str, Any] | None:
    """``eval.benchmark``/``eval.also`` with ``data.root`` filled in where a named benchmark has no root
    of its own (module docstring); None when nothing changes."""
    root = cfg.data.root

    def needs(bench: DataConfig) -> bool:
        return root is not None and bench.root is None and bench.dataset in NAMED

    benches = [cfg.eval.benchmark, *cfg.eval.also]
    if not any(needs(b) for b in benches):
        return None
    filled = [{**b.model_dump(), "root": root} if needs(b) else b.model_dump() for b in benches]
    return {"benchmark": filled[0], "also": filled[1:]}


def updates_per_step(cfg: RunConfig) -> int:
    """Optimizer updates of one RL step (``qerl.pipeline.rl.step._update_groups`` makes exactly these)."""
    samples = cfg.loop.prompts_per_step * cfg.rollout.n_samples
    minibatches = math.ceil(samples / cfg.train.minibatch_size)
    return cfg.train.mu * math.ceil(minibatches / cfg.train.grad_accum)


def check_serving(cfg: RunConfig, mode: str | None = None) -> None:
    """The rollout engine can serve ``cfg`` in ``mode`` (default: the mode it runs in on this machine,
    ``planned_mode``); a ConfigError names the settings or the install to change."""
    if mode is None:
        mode = planned_mode(cfg.rollout, cfg.quantize.scheme)[0]
    problem = serving_error(cfg.rollout, mode)
    if problem:
        raise ConfigError(problem)


def check_model(rollout: RolloutConfig, model_config: dict[str, Any]) -> None:
    """The engine's settings against the model's config.json: context (``check_context``) and, for
    more than one GPU, tensor parallelism (``check_parallelism``, which asks whether CUDA is here)."""
    check_context(rollout, model_config)
    if rollout.tensor_parallel_size > 1:  # 1 is valid everywhere; asking for CUDA imports torch
        from qerl.pipeline.runtime.device import cuda_available

        check_parallelism(rollout, model_config, cuda_available())


def check_context(rollout: RolloutConfig, model_config: dict[str, Any]) -> None:
    """``rollout.max_model_len`` within the model's ``max_position_embeddings``; a model with a RoPE
    scaling other than the default is left to vLLM, which derives its longer context itself."""
    positions = model_config.get("max_position_embeddings")
    scalings = (model_config.get("rope_scaling"), model_config.get("rope_parameters"))
    scaled = any(
        isinstance(s, dict) and s.get("rope_type", s.get("type")) not in (None, "default") for s in scalings
    )
    if isinstance(positions, int) and not scaled and rollout.max_model_len > positions:
        raise ConfigError(
            f"rollout.max_model_len {rollout.max_model_len} is longer than the model's "
            f"max_position_embeddings {positions}: set it to {positions} or less "
            f"(--set rollout.max_model_len={positions})"
        )


def check_parallelism(rollout: RolloutConfig, model_config: dict[str, Any], cuda: bool) -> None:
    """vLLM's tensor-parallel rules for this model on this machine; a ConfigError names the setting.

    It needs the model's config.json, so it runs where that is known (``check_model``, and ``qerl
    plan`` once it has a hub model's config).
    vLLM shards the attention heads over the GPUs (``num_attention_heads % tp == 0``) and splits or
    replicates the KV heads (``num_key_value_heads % tp == 0`` or ``tp % num_key_value_heads == 0``);
    on a CPU it runs a single worker.
    """
    tp = rollout.tensor_parallel_size
    if tp == 1:
        return
    if not cuda:
        raise ConfigError(
            f"rollout.tensor_parallel_size is {tp} but this machine has no CUDA device: vLLM on a CPU runs "
            "one worker, set rollout.tensor_parallel_size: 1"
        )
    heads = int(model_config.get("num_attention_heads") or 0)
    kv_heads = int(model_config.get("num_key_value_heads") or heads)
    if heads <= 0:
        raise ConfigError("the model's config.json has no num_attention_heads to check tensor_parallel_size")
    valid = [d for d in range(1, heads + 1) if heads % d == 0 and (kv_heads % d == 0 or d % kv_heads == 0)]
    if tp not in valid:
        raise ConfigError(
            f"rollout.tensor_parallel_size {tp} does not fit the model's {heads} attention heads and "
            f"{kv_heads} KV heads (vLLM shards the heads across GPUs: tp must divide them, and divide or "
            f"be a multiple of the KV heads); valid sizes: {', '.join(map(str, valid))}"
        )
