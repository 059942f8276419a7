"""How the rollout engine is set up: which base it serves, and a standalone evaluation's engine config.

- **Which base the engine serves** (``needs_twin``): the dequantized twin is built when the rollout
  engine cannot serve NVFP4 itself: every CPU engine, and the transformers engine anywhere. vLLM on
  CUDA serves the NVFP4 (or NF4) checkpoint. An unquantized base (``quantize.scheme: none``) is served as is
  and has no twin. The flow and ``qerl eval`` both ask here.
- **A standalone evaluation's engine** (``eval_rollout_config``): sampled as the eval config says,
  no logprobs; the context is the rollout default capped by the model's ``max_position_embeddings``
  and the LoRA slot is the smallest rank vLLM accepts that holds the adapter (read from the adapter).
"""

from __future__ import annotations

import json
from pathlib import Path

from qerl.pipeline.config import apply_overrides
from qerl.pipeline.evaluation.eval_config import EvalConfig
from qerl.pipeline.rollout.config import RolloutConfig

# vLLM 0.32's ``LoRAConfig.max_lora_rank`` (``MaxLoRARanks``): any other value fails at engine start
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def needs_twin(engine: str, scheme: str = "nvfp4") -> bool:
    """Whether the rollout engine ``engine`` (``vllm`` or ``hf``) serves the dequantized twin of a
    ``scheme`` base on this machine (see the module docstring)."""
    from qerl.pipeline.runtime import device

    if scheme == "none":
        return False
    return engine == "hf" or not device.cuda_available()


def vllm_lora_rank(r: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds a rank-``r`` adapter."""
    for rank in VLLM_LORA_RANKS:
        if rank >= r:
            return rank
    raise ValueError(f"LoRA rank {r} exceeds vLLM's largest max_lora_rank {VLLM_LORA_RANKS[-1]}")


def adapter_rank(adapter_dir: str | Path) -> int:
    """The largest LoRA rank in a peft adapter folder (``r`` and any per-module ``rank_pattern``)."""
    path = Path(adapter_dir) / "adapter_config.json"
    if not path.is_file():
        raise ValueError(f"LoRA adapter directory {adapter_dir} has no adapter_config.json")
    config = json.loads(path.read_text())
    ranks = [config.get("r")] + list((config.get("rank_pattern") or {}).values())
    if not isinstance(config.get("r"), int) or not all(isinstance(x, int) and x > 0 for x in ranks):
        raise ValueError(f"{path}: 'r' / 'rank_pattern' must be positive integers, got {ranks}")
    return max(ranks)


def eval_rollout_config(
    cfg: EvalConfig,
    engine: str,
    model_dir: str | Path,
    adapter_dir: str | Path | None,
    overrides: list[str] | None = None,
) -> RolloutConfig:
    """The engine config of a standalone evaluation (``qerl eval``): sampled as ``cfg`` says, no logprobs.

    Derived rather than fixed: the context is the rollout default capped by the model's
    ``max_position_embeddings``, the LoRA slot is the smallest vLLM rank that holds the adapter (no
    LoRA without one). ``overrides`` (``key=value``, RolloutConfig keys) are applied last, and the
    context is checked against the model after them (``run_checks.check_context``).
    """
    from qerl.pipeline.planning.run_checks import check_context  # which imports this module

    default_len = RolloutConfig.model_fields["max_model_len"].default
    model_config = json.loads((Path(model_dir) / "config.json").read_text())
    positions = model_config.get("max_position_embeddings")
    derived = RolloutConfig.model_construct(  # validated once, with the overrides, below
        engine=engine,
        n_samples=cfg.n_samples,
        temperature=cfg.sampling_temperature,
        top_p=cfg.sampling_top_p,
        max_new_tokens=cfg.max_new_tokens,
        max_model_len=min(default_len, int(positions or default_len)),
        template=cfg.benchmark.template,
        enable_lora=adapter_dir is not None,
        max_lora_rank=vllm_lora_rank(adapter_rank(adapter_dir))
        if adapter_dir is not None
        else RolloutConfig.model_fields["max_lora_rank"].default,
        logprobs=False,
    )
    rollout = apply_overrides(derived, overrides, prefix="rollout")
    check_context(rollout, model_config)  # an override past the model's positions
    return rollout
