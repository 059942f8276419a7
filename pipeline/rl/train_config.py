"""The train stage's settings: LoRA shape, optimizer and schedule, minibatching, and the GRPO objective.

``TrainConfig`` holds the QeRL recipe's defaults. LoRA goes on the projections inside the decoder
layers only (``ALL_PROJECTIONS`` by default): the fused logprob head applies ``lm_head`` as a plain
linear layer, and the embedding is tied to it, so neither may carry an adapter. The GRPO settings are
``qerl.pipeline.rl.objective.GRPOConfig``.

Results and resources (``qerl.pipeline.config``): ``gradient_checkpointing`` only trades compute for
memory, and how an update is cut into minibatches only sets the memory of a forward/backward (the
loss normalisers are the update's, ``qerl.pipeline.rl.step``): ``minibatch_size`` and ``grad_accum``
are resource fields, and the key holds their product, the update size (``key_extra``). So ``qerl
plan``'s advice (lower the minibatch, raise grad_accum) keeps every cached step. The exception is
``grpo.loss_type: bnpo``, whose loss is a mean over each minibatch's tokens: there the minibatch size
changes the result and is in the key too.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator
from qerl.pipeline.config import StrictModel, resource_field
from qerl.pipeline.rl.objective import GRPOConfig

__all__ = ["ALL_PROJECTIONS", "TrainConfig"]

ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class TrainConfig(StrictModel):
    """LoRA + optimizer + GRPO settings of the train stage (QeRL recipe defaults)."""

    lora_r: int = Field(16, gt=0)
    lora_alpha: int = Field(32, gt=0)
    lora_dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: tuple[str, ...] = ALL_PROJECTIONS
    lr: float = Field(1e-5, gt=0.0)
    warmup_steps: int = Field(0, ge=0, description="optimizer updates of linear warmup")
    total_steps: int | None = Field(
        None,
        gt=0,
        description="optimizer updates over which the cosine decays; null: in a run, the loop's total "
        "updates (loop.steps x updates per step); standalone, no decay after warmup",
    )
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)
    mu: int = Field(1, ge=1, description="passes over the step's samples")
    minibatch_size: int = resource_field(8, ge=1, description="sequences per forward/backward")
    grad_accum: int = resource_field(
        1, ge=1, description="minibatches per optimizer update (keys hold minibatch_size x grad_accum)"
    )
    max_grad_norm: float = Field(0.2, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    gradient_checkpointing: bool = resource_field(
        False, description="recompute activations in the backward (less memory, same gradient)"
    )
    lora_autocast: bool = Field(
        True,
        description="LoRA matmuls in the base dtype (bf16), fp32 master weights/grads/AdamW; false: all fp32",
    )
    deterministic: bool = resource_field(
        True,
        description="CUDA: deterministic kernels during the step (torch.use_deterministic_algorithms, "
        "cuDNN, the cuBLAS workspace config), so a rebuilt checkpoint (resume, heal) has the first "
        "build's bytes; false: faster where they cost (qerl.pipeline.runtime.determinism). The CPU "
        "trainer is deterministic either way",
    )
    seed: int = 0
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    temperature: float = Field(1.0, gt=0.0, description="must equal the rollout temperature")
    grpo: GRPOConfig = GRPOConfig()

    def key_extra(self) -> dict[str, int]:
        """The update size: what the minibatch split (two resource fields) changes in the result; with
        ``bnpo``, which normalises each minibatch by its own token count, the split itself."""
        extra = {"update_size": self.minibatch_size * self.grad_accum}
        if self.grpo.loss_type == "bnpo":
            extra["bnpo_minibatch_size"] = self.minibatch_size
        return extra

    @field_validator("target_modules")
    @classmethod
    def _frozen_head_and_embeddings(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        # The fused logprob head (``_TokenLogprobs``) applies the lm_head as a plain Linear, so a
        # peft-wrapped head would be skipped; the embedding is tied to it: neither may carry a LoRA.
        bad = [m for m in value if m in ("lm_head", "embed_tokens")]
        if bad:
            raise ValueError(f"target_modules may not include {bad}: only projections inside the layers")
        return value
