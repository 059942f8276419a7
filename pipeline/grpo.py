"""GRPO objective as pure tensor functions: advantages, clipped ratio loss, aggregation, KL, metrics.

What: the pieces of the GRPO/DAPO policy-gradient loss used by the train stage, each a pure function
of tensors so that it can be checked against hand-derived numbers (tests/test_grpo.py).

How (shapes: B sequences, T completion positions, ``mask`` 1 on real completion tokens):

* ``group_advantages``: ``A = (r - mean_g) / (std_g + eps)`` per prompt group, or ``r - mean_g``
  when ``scale_rewards="none"`` (Dr. GRPO). ``std_g`` is the sample standard deviation (Bessel, as
  TRL and DeepSeekMath use); a group of one has no spread and gets advantage 0.
* ``per_token_loss``: ``-min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A)`` with
  ``rho = exp(logp - old_logp)``; the asymmetric ``eps_high`` is DAPO's clip-higher.
* ``aggregate``: ``grpo`` (mean over each sequence's tokens, then over sequences), ``bnpo`` (token
  mean over the minibatch), ``dapo`` (token sum over the *whole optimizer step* divided by its token
  count) and ``dr_grpo`` (token sum / (sequences * max_len)). The step-level normalisers are passed
  in, so that gradient accumulation over minibatches gives the same gradient as one big batch
  (except ``bnpo``, which by definition normalises each minibatch, as in TRL).
* ``k3_kl``: Schulman's k3 estimator ``exp(ref - logp) - (ref - logp) - 1`` of KL(pi || ref).
* ``tis_weights``: truncated importance sampling, ``min(exp(old_logp - sampler_logp), cap)``.

Departures from the paper/TRL, and why:
* The ratio's denominator is the *sampler's* logprob (vLLM, 4-bit base + AQN noise) unless
  ``tis_cap`` is set. QeRL trains on exactly what the noisy sampler produced; treating the sampler as
  the behaviour policy makes the AQN exploration noise visible to the clipped objective instead of
  hiding it in a recomputed "old" logprob. With ``tis_cap`` the trainer recomputes old logprobs
  without noise (the TRL/"your efficient RL framework is secretly off-policy" fix) and reweights each
  token by the capped trainer/sampler ratio.
* Metrics are returned as sums and counts, not means, so the caller can combine minibatches exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from pydantic import Field, model_validator

from pipeline.config import StrictModel

__all__ = [
    "GRPOConfig",
    "aggregate",
    "clip_masks",
    "entropy_from_logits",
    "group_advantages",
    "grpo_token_objective",
    "k3_kl",
    "per_token_loss",
    "tis_weights",
]

LossType = Literal["grpo", "bnpo", "dapo", "dr_grpo"]


class GRPOConfig(StrictModel):
    """GRPO loss settings; defaults follow the QeRL recipe (DAPO-style clip-higher, no KL)."""

    eps_low: float = Field(0.2, ge=0.0, lt=1.0, description="lower clip: rho >= 1 - eps_low")
    eps_high: float = Field(0.28, ge=0.0, description="upper clip: rho <= 1 + eps_high (DAPO clip-higher)")
    beta: float = Field(0.0, ge=0.0, description="weight of the k3 KL to the base (adapter disabled)")
    loss_type: LossType = "dapo"
    scale_rewards: Literal["group", "none"] = "group"
    adv_eps: float = Field(1e-4, gt=0.0, description="added to the group std before dividing")
    tis_cap: float | None = Field(None, gt=0.0, description="truncated importance-sampling cap; None = off")
    mask_truncated: bool = Field(True, description="drop completions that hit the length limit")
    max_completion_length: int | None = Field(
        None, gt=0, description="dr_grpo normaliser; None = longest completion in the step's batch"
    )

    @model_validator(mode="after")
    def _check(self) -> GRPOConfig:
        if self.tis_cap is not None and self.tis_cap < 1.0:
            raise ValueError(
                f"grpo.tis_cap={self.tis_cap} must be >= 1 (a cap below 1 down-weights every token)"
            )
        return self


def group_advantages(
    rewards: torch.Tensor,
    group_ids: Sequence[object] | torch.Tensor,
    scale: Literal["group", "none"] = "group",
    eps: float = 1e-4,
) -> torch.Tensor:
    """Per-sample advantage relative to its prompt group (float32, same order as ``rewards``)."""
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D, got shape {tuple(rewards.shape)}")
    ids = group_ids.tolist() if isinstance(group_ids, torch.Tensor) else list(group_ids)
    if len(ids) != rewards.numel():
        raise ValueError(f"{len(ids)} group ids for {rewards.numel()} rewards")
    if scale not in ("group", "none"):
        raise ValueError(f"scale_rewards must be 'group' or 'none', got {scale!r}")
    index: dict[object, list[int]] = {}
    for i, gid in enumerate(ids):
        index.setdefault(gid, []).append(i)
    adv = torch.zeros_like(rewards)
    for members in index.values():
        idx = torch.tensor(members)
        r = rewards[idx]
        centred = r - r.mean()
        if scale == "group":
            std = r.std(unbiased=True) if len(members) > 1 else torch.zeros(())
            centred = centred / (std + eps)
        adv[idx] = centred
    return adv


def tis_weights(old_logp: torch.Tensor, sampler_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance weights ``min(pi_old / pi_sampler, cap)`` per token (no gradient)."""
    return torch.exp(old_logp.detach() - sampler_logp).clamp(max=cap)


def per_token_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    eps_low: float,
    eps_high: float,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped surrogate ``-min(rho A, clip(rho) A)`` per token, and the ratio ``rho`` (detached).

    ``advantages`` is [B] (broadcast over tokens) or [B, T].
    """
    if logp.shape != old_logp.shape:
        raise ValueError(f"logp {tuple(logp.shape)} and old_logp {tuple(old_logp.shape)} differ in shape")
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    ratio = torch.exp(logp - old_logp)
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = -torch.minimum(ratio * adv, clipped * adv)
    if is_weights is not None:
        loss = loss * is_weights
    return loss, ratio.detach()


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || ref): ``exp(ref - logp) - (ref - logp) - 1`` (>= 0)."""
    delta = ref_logp - logp
    return torch.exp(delta) - delta - 1.0


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    loss_type: LossType,
    *,
    num_sequences: int | None = None,
    num_tokens: float | None = None,
    max_len: int | None = None,
) -> torch.Tensor:
    """Reduce a [B, T] per-token loss to a scalar.

    ``num_sequences`` / ``num_tokens`` are the sequence and token counts of the whole optimizer step
    (defaults: this batch's); ``max_len`` is dr_grpo's constant length (default: T).
    """
    mask = mask.to(per_token.dtype)
    masked = per_token * mask
    n_seq = per_token.shape[0] if num_sequences is None else num_sequences
    if loss_type == "grpo":
        per_seq = masked.sum(-1) / mask.sum(-1).clamp(min=1.0)
        return per_seq.sum() / n_seq
    if loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dapo":
        total = mask.sum() if num_tokens is None else torch.tensor(float(num_tokens))
        return masked.sum() / total.clamp(min=1.0)
    if loss_type == "dr_grpo":
        length = per_token.shape[1] if max_len is None else max_len
        return masked.sum() / (n_seq * length)
    raise ValueError(f"unknown loss_type {loss_type!r}; valid: grpo, bnpo, dapo, dr_grpo")


def entropy_from_logits(logits: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """Entropy of the softmax over the last dim, [..., V] -> [...], chunked to bound memory."""
    flat = logits.reshape(-1, logits.shape[-1])
    out = []
    for part in flat.split(chunk):
        logp = torch.log_softmax(part.float(), dim=-1)
        out.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(out).reshape(logits.shape[:-1])


def clip_masks(
    ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens where clipping is active: low (rho < 1-eps_low, A < 0) and high (rho > 1+eps_high, A > 0)."""
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    low = (ratio < 1.0 - eps_low) & (adv < 0)
    high = (ratio > 1.0 + eps_high) & (adv > 0)
    return low, high


def grpo_token_objective(
    logp: torch.Tensor,
    sampler_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: GRPOConfig,
    *,
    old_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    num_sequences: int | None = None,
    num_tokens: float | None = None,
    max_len: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The full minibatch loss (scalar) and metric *sums* over its masked tokens.

    Without ``tis_cap`` the ratio is taken against the sampler; with it, against ``old_logp`` (the
    trainer's own logprobs before the update) with tokens reweighted by the capped trainer/sampler
    ratio.
    """
    weights = None
    denominator = sampler_logp
    if cfg.tis_cap is not None:
        if old_logp is None:
            raise ValueError("grpo.tis_cap is set but no old_logp (trainer logprobs before the update) given")
        weights = tis_weights(old_logp, sampler_logp, cfg.tis_cap)
        denominator = old_logp.detach()
    loss_tok, ratio = per_token_loss(logp, denominator, advantages, cfg.eps_low, cfg.eps_high, weights)
    kl_sum = 0.0
    if cfg.beta > 0.0:
        if ref_logp is None:
            raise ValueError("grpo.beta > 0 needs ref_logp (base-model logprobs, adapter disabled)")
        kl = k3_kl(logp, ref_logp)
        loss_tok = loss_tok + cfg.beta * kl
        kl_sum = float((kl.detach() * mask).sum())
    loss = aggregate(
        loss_tok, mask, cfg.loss_type, num_sequences=num_sequences, num_tokens=num_tokens, max_len=max_len
    )
    low, high = clip_masks(ratio, advantages, cfg.eps_low, cfg.eps_high)
    m = mask.bool()
    stats = {
        "tokens": float(m.sum()),
        "clip_low": float((low & m).sum()),
        "clip_high": float((high & m).sum()),
        "kl": kl_sum,
        "ratio": float((ratio * m).sum()),
    }
    return loss, stats
