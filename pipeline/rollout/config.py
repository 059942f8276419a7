"""The rollout section of a run's config: which engine, how it samples, how much memory it takes.

``RolloutConfig`` holds the engine choice (``vllm`` or ``hf``), the sampling (defaults: the QeRL
recipe's rollout; ``sampling()`` gives the engine's ``SamplingSpec``), vLLM's sizing and the HF
engine's batch. The sizing fields (memory, batching, parallelism, start-up mode: ``resource_field``)
stay out of cache keys and the run id: they change how fast and in how much memory the rollouts are
drawn, not from which distribution (the bytes of a rebuild may differ, as batch composition changes
floating-point order and the HF engine seeds per batch). Cross-field checks that need only this
section live here; those that need the model or the train section live in
``qerl.pipeline.planning.run_checks``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator
from qerl.pipeline.config import StrictModel, resource_field
from qerl.pipeline.data.prompts import template_names
from qerl.pipeline.rollout.protocol import SamplingSpec

__all__ = ["RolloutConfig"]


class RolloutConfig(StrictModel):
    """Rollout engine and sampling settings (defaults: the QeRL recipe's rollout)."""

    engine: Literal["vllm", "hf"] = "vllm"
    n_samples: int = Field(8, ge=1, description="completions per prompt (the GRPO group size)")
    temperature: float = Field(1.0, ge=0.0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, description="-1 or 0 = off")
    max_new_tokens: int = Field(256, ge=1)
    max_model_len: int = Field(2048, ge=16)
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    template: str = "boxed"
    seed: int = 0
    enable_lora: bool = True
    max_lora_rank: int = resource_field(32, ge=1, description="vLLM's LoRA slot size (>= train.lora_r)")
    kv_cache_gib: float = resource_field(
        1.0,
        gt=0.0,
        description="vLLM KV cache size on CPU (the environment's VLLM_CPU_KVCACHE_SPACE, if set, wins)",
    )
    gpu_memory_utilization: float = resource_field(0.5, gt=0.0, le=1.0)
    max_num_seqs: int = resource_field(64, ge=1)
    max_num_batched_tokens: int | None = resource_field(
        None,
        ge=16,
        description="vLLM tokens per engine step (None: vLLM's default; at least max_model_len on CPU)",
    )
    kv_block_size: int | None = resource_field(
        None,
        ge=16,
        description="vLLM KV-cache block (tokens). A group shares its prompt's full blocks only "
        "(None: vLLM's default on GPU, 32 on CPU, where vLLM's 128 is longer than most prompts)",
    )
    enforce_eager: bool = resource_field(False, description="no CUDA graphs / compilation (fast startup)")
    in_process: bool = resource_field(
        False, description="vLLM engine core and worker in this process (fast CPU startup; one GPU only)"
    )
    hf_batch_size: int = resource_field(16, ge=1, description="sequences per transformers generate call")
    logprobs: bool = Field(
        True,
        description="record the sampler's per-token logprobs (GRPO needs them); false: an evaluation "
        "engine, any temperature/top-p",
    )
    tensor_parallel_size: int = resource_field(
        1, ge=1, description="GPUs the vLLM engine is split over (must divide the attention heads; 1 on CPU)"
    )

    @model_validator(mode="after")
    def _check(self) -> RolloutConfig:
        if self.template not in template_names():
            raise ValueError(f"unknown template '{self.template}'; valid: {', '.join(template_names())}")
        if self.in_process and self.tensor_parallel_size > 1:
            raise ValueError(
                "rollout.in_process runs one vLLM worker in this process: it needs tensor_parallel_size 1, "
                f"got {self.tensor_parallel_size}"
            )
        if self.max_new_tokens >= self.max_model_len:
            raise ValueError(
                f"max_new_tokens {self.max_new_tokens} must be < max_model_len {self.max_model_len}"
            )
        return self

    def sampling(self) -> SamplingSpec:
        return SamplingSpec(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_new_tokens=self.max_new_tokens,
            logprobs=self.logprobs,
        )
