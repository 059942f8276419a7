"""GRPO objective as pure tensor functions: advantages, clipped ratio loss, aggregation, KL, metrics.

What: the pieces of the GRPO/DAPO policy-gradient loss used by the train stage, each a pure function
of tensors so that it can be checked against hand-derived numbers (tests/pipeline/test_grpo.py).

How (shapes: B sequences, T completion positions, ``mask`` 1 on real completion tokens):

* ``group_advantages``: ``A = (r - mean_g) / (std_g + eps)`` per prompt group, or ``r - mean_g``
  when ``scale_rewards="none"`` (Dr. GRPO). ``std_g`` is the sample standard deviation (Bessel, as
  TRL and DeepSeekMath use); a group of one has no spread and gets advantage 0.
* ``per_token_loss``: ``-min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A)`` with
  ``rho = exp(logp - old_logp)``; the asymmetric ``eps_high`` is DAPO's clip-higher. With
  ``dual_clip = c`` (dual-clip PPO, Ye et al. 2020) a token with ``A < 0`` costs at most ``-c * A``:
  without it the loss of a negative-advantage token grows without bound in ``rho``.
* The anchor (``old_logp``) is, by default, the *trainer's* own logprob of the token before this RL
  step's first update, and each token is weighted by the truncated importance weight
  ``min(pi_trainer / pi_sampler, tis_cap)`` (``tis_weights``), which corrects for the sampler being a
  different policy: vLLM's FP4 Marlin kernel, AQN's noisy norms (under the default
  ``aqn_objective``; the next item), a different accumulation order.
* AQN and the objective (``aqn_objective``). The rollout of step t samples from the noisy policy
  ``pi_s ~ pi_old^z`` (the engine's numerics on top of the trainer's policy with the step's norm noise
  ``z``); ``pi_old`` is the clean trainer before the step's first update, ``pi_old^z`` the same with
  ``z`` applied. The exact importance weight to the clean policy factors as
  ``pi_old / pi_s = (pi_old / pi_old^z) * (pi_old^z / pi_s)``: a noise factor and an engine factor.

  - ``clean_is`` (the default): ``rho = pi / pi_old``, weight ``min(pi_old / pi_s, tis_cap)``: both
    factors, each token reweighted toward the clean policy. It is not unbiased: the weight is
    per token, while each token's prefix was drawn from the noisy policy (a sequence-level correction
    would need the product of the weights, whose variance explodes with length), and the cap, where
    it binds, clips exactly the tokens the noise made much likelier. It down-weights those tokens;
    it does not remove the noise's effect on which prefixes were sampled.
  - ``on_policy``: ``rho = pi / pi_old`` (clean; the gradient flows through the clean policy), weight
    ``min(pi_old^z / pi_s, tis_cap)`` with ``pi_old^z`` a no-grad pass of the trainer with the step's
    noise: the engine factor only. The noise factor is dropped, i.e. the noisy samples count as
    samples of the policy being trained, which is what the paper's released code does (one update
    per rollout, ratio 1, no correction), here with the engine/quantization mismatch still corrected
    (``tis_cap: null`` drops that too: the paper's objective exactly). The mismatch metrics compare
    ``pi_old^z`` with the sampler (engine numerics only). It needs the trainer anchor: with ``anchor:
    sampler`` the ratio's denominator would be the noisy sampler, whose clip removes the noise again.
    Costs one extra no-grad forward per sample on a noisy step.
  - ``noisy_trainer``: the trainer applies the same ``z`` (the rollout's seed and sigma) for its old
    logprobs and for the forward/backward it trains: ``rho = pi^z / pi_old^z``, weight
    ``min(pi_old^z / pi_s, tis_cap)``. No sampler/trainer gap comes from the noise; the gradient is
    the noisy policy's (parameter-space exploration: the LoRA is trained at the perturbed point).
    The reference-KL pass (``beta > 0``) runs on the clean base.

  With sigma = 0 (stage 0 of the schedule, or AQN off) the three are the same objective, bit for bit.
  Which one the paper is: ``on_policy`` (its code never corrects for the noise). Why ``clean_is`` is
  the default anyway: of the three it is the closest estimate of the clean policy's gradient (the
  token-level correction, biased as above but toward the policy being trained), and the SmolLM2-135M
  ablation (docs/results/ablation-smollm2-fidelity.md) cannot tell the three apart, nor any of them
  from no AQN, so no measurement favours a change.
* ``aggregate``: ``grpo`` (mean over each sequence's tokens, then over the sequences that have any),
  ``bnpo`` (token mean over the minibatch), ``dapo`` (token sum over the *whole optimizer step*
  divided by its token count) and ``dr_grpo`` (token sum / (sequences * max_len)). The step-level
  normalisers are passed in, so that gradient accumulation over minibatches gives the same gradient
  as one big batch (except ``bnpo``, which by definition normalises each minibatch, as in TRL).
  A fully masked row (a truncated completion under ``mask_truncated``) is a dropped sample: it is
  not a sequence of ``grpo``'s mean (TRL counts it, shrinking every other sequence's weight by the
  share of truncated rows). ``dr_grpo`` keeps counting it: its normaliser is meant to be a constant
  (samples x generation budget) that no sampled length, truncation included, may change.
* ``k3_kl``: Schulman's k3 estimator ``exp(ref - logp) - (ref - logp) - 1`` of KL(pi || ref).
* ``mismatch_sums``: how far the sampler is from the trainer on the sampled tokens (k3 KL, mean
  absolute logprob gap, share outside the clip range, share where the TIS cap binds).

Departures from the paper/TRL, and why:
* The default anchor is the trainer with TIS (cap 2, as in "Your efficient RL framework secretly
  brings you off-policy RL training", Yao et al. 2025) and dual clip 3, not the sampler's logprobs:
  with the sampler as anchor, a token on which the noisy or differently computed sampler disagrees
  with the trainer beyond the clip range is clipped from the first update on and gets no gradient at
  all, so AQN's noise acts as extra clipping rather than exploration, and without dual clip a
  negative-advantage token with a large ratio has an unbounded loss. ``anchor: sampler`` with
  ``tis_cap: null`` (and ``dual_clip: null``) gives the sampler-anchored objective.
* Metrics are returned as sums and counts, not means, so the caller can combine minibatches exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from pydantic import Field, model_validator
from qerl.pipeline.config import StrictModel

__all__ = [
    "GRPOConfig",
    "aggregate",
    "clip_masks",
    "entropy_from_logits",
    "group_advantages",
    "grpo_token_objective",
    "k3_kl",
    "mismatch_sums",
    "per_token_loss",
    "tis_weights",
]

LossType = Literal["grpo", "bnpo", "dapo", "dr_grpo"]


class GRPOConfig(StrictModel):
    """GRPO loss settings; defaults follow the QeRL recipe (DAPO-style clip-higher, no KL), with the
    trainer as the ratio's anchor, TIS against the sampler and dual clip (see the module notes)."""

    eps_low: float = Field(0.2, ge=0.0, lt=1.0, description="lower clip: rho >= 1 - eps_low")
    eps_high: float = Field(0.28, ge=0.0, description="upper clip: rho <= 1 + eps_high (DAPO clip-higher)")
    beta: float = Field(0.0, ge=0.0, description="weight of the k3 KL to the base (adapter disabled)")
    loss_type: LossType = "dapo"
    scale_rewards: Literal["group", "none"] = "group"
    adv_eps: float = Field(1e-4, gt=0.0, description="added to the group std before dividing")
    anchor: Literal["trainer", "sampler"] = Field(
        "trainer",
        description="the ratio's denominator: the trainer's logprobs before the step's first update, "
        "or the sampler's (the old objective: sampler/trainer gaps beyond the clip range get no gradient)",
    )
    tis_cap: float | None = Field(
        2.0,
        gt=0.0,
        description="truncated importance weight min(pi_trainer/pi_sampler, cap) per token (anchor "
        "trainer only); null = off",
    )
    dual_clip: float | None = Field(
        3.0, gt=1.0, description="dual-clip PPO: a token with A < 0 costs at most dual_clip * |A|; null = off"
    )
    aqn_objective: Literal["clean_is", "on_policy", "noisy_trainer"] = Field(
        "clean_is",
        description="how the ratio and TIS treat the rollout's AQN noise: clean_is (TIS against the clean "
        "trainer also removes the noise's effect), on_policy (noisy samples count as on-policy: TIS "
        "against the trainer with the step's noise, ratio and gradient on the clean policy; the "
        "paper's code), noisy_trainer (the trainer applies the step's noise for its old logprobs and "
        "its forward/backward); see qerl.pipeline.rl.objective",
    )
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
        if self.anchor == "sampler" and self.tis_cap is not None:
            raise ValueError(
                f"grpo.tis_cap={self.tis_cap} needs grpo.anchor: trainer (with anchor: sampler the ratio is "
                "already taken against the sampler, there is no trainer/sampler weight): set grpo.tis_cap: null"
            )
        if self.anchor == "sampler" and self.aqn_objective == "on_policy":
            raise ValueError(
                "grpo.aqn_objective=on_policy needs grpo.anchor: trainer (with anchor: sampler the ratio's "
                "denominator is the noisy sampler, so the clip removes the noise the objective keeps)"
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
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped surrogate ``-min(rho A, clip(rho) A)`` per token, and the ratio ``rho`` (detached).

    ``advantages`` is [B] (broadcast over tokens) or [B, T]. ``dual_clip = c`` caps the loss of a token
    with ``A < 0`` at ``-c * A`` (no gradient where it binds); ``is_weights`` multiply the result.
    """
    if logp.shape != old_logp.shape:
        raise ValueError(f"logp {tuple(logp.shape)} and old_logp {tuple(old_logp.shape)} differ in shape")
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    ratio = torch.exp(logp - old_logp)
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = -torch.minimum(ratio * adv, clipped * adv)
    if dual_clip is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -dual_clip * adv), loss)
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
    num_rows: int | None = None,
) -> torch.Tensor:
    """Reduce a [B, T] per-token loss to a scalar.

    Step-level normalisers (defaults: this batch's): ``num_sequences``, the sequences with at least one
    unmasked token (``grpo``); ``num_tokens``, the unmasked tokens (``dapo``); ``num_rows``, every
    sequence, fully masked ones included, and ``max_len`` (default: T), dr_grpo's constant length.
    """
    mask = mask.to(per_token.dtype)
    masked = per_token * mask
    if loss_type == "grpo":
        n_seq = int((mask.sum(-1) > 0).sum()) if num_sequences is None else num_sequences
        per_seq = masked.sum(-1) / mask.sum(-1).clamp(min=1.0)
        return per_seq.sum() / max(n_seq, 1)
    if loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dapo":
        total = mask.sum() if num_tokens is None else torch.tensor(float(num_tokens))
        return masked.sum() / total.clamp(min=1.0)
    if loss_type == "dr_grpo":
        rows = per_token.shape[0] if num_rows is None else num_rows
        length = per_token.shape[1] if max_len is None else max_len
        return masked.sum() / max(rows * length, 1)
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


def mismatch_sums(
    old_logp: torch.Tensor,
    sampler_logp: torch.Tensor,
    eps_low: float,
    eps_high: float,
    tis_cap: float | None,
) -> dict[str, float]:
    """Sampler-vs-trainer mismatch over the given (already masked, flat) tokens, as sums.

    ``k3``: k3 estimate of KL(sampler || trainer) (the tokens were drawn by the sampler); ``abs``:
    ``|old - sampler|``; ``out``: tokens whose ``pi_trainer / pi_sampler`` leaves
    ``[1 - eps_low, 1 + eps_high]``; ``capped``: tokens where that ratio exceeds ``tis_cap``.
    """
    delta = old_logp.detach().double() - sampler_logp.double()
    w = torch.exp(delta)
    return {
        "mismatch_tokens": float(delta.numel()),
        "mismatch_k3": float((w - delta - 1.0).sum()),
        "mismatch_abs": float(delta.abs().sum()),
        "mismatch_out": float(((w < 1.0 - eps_low) | (w > 1.0 + eps_high)).sum()),
        "tis_capped": float((w > tis_cap).sum()) if tis_cap is not None else 0.0,
    }


def grpo_token_objective(
    logp: torch.Tensor,
    sampler_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: GRPOConfig,
    *,
    old_logp: torch.Tensor | None = None,
    noisy_old_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    num_sequences: int | None = None,
    num_tokens: float | None = None,
    max_len: int | None = None,
    num_rows: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The full minibatch loss (scalar) and metric *sums* over its masked tokens.

    ``anchor: trainer``: the ratio is taken against ``old_logp`` (the trainer's own logprobs before
    this RL step's first update; required), each token weighted by ``min(exp(old - sampler), tis_cap)``
    when ``tis_cap`` is set. ``anchor: sampler``: the ratio is taken against ``sampler_logp``.
    ``noisy_old_logp`` (``aqn_objective: on_policy`` on a noisy step only): the trainer's old logprobs
    with the step's AQN noise applied; the TIS weight is taken against them instead of ``old_logp``,
    so it measures the engine mismatch and not the noise (module notes).
    """
    if noisy_old_logp is not None and cfg.aqn_objective != "on_policy":
        raise ValueError(
            f"noisy_old_logp is only used by grpo.aqn_objective=on_policy, not {cfg.aqn_objective!r}"
        )
    weights = None
    if cfg.anchor == "trainer":
        if old_logp is None:
            raise ValueError(
                "grpo.anchor is 'trainer' but no old_logp (trainer logprobs before the update) given"
            )
        denominator = old_logp.detach()
        if cfg.tis_cap is not None:
            reference = old_logp if noisy_old_logp is None else noisy_old_logp
            weights = tis_weights(reference, sampler_logp, cfg.tis_cap)
    else:
        denominator = sampler_logp
    loss_tok, ratio = per_token_loss(
        logp, denominator, advantages, cfg.eps_low, cfg.eps_high, weights, cfg.dual_clip
    )
    kl_sum = 0.0
    if cfg.beta > 0.0:
        if ref_logp is None:
            raise ValueError("grpo.beta > 0 needs ref_logp (base-model logprobs, adapter disabled)")
        kl = k3_kl(logp, ref_logp)
        loss_tok = loss_tok + cfg.beta * kl
        kl_sum = float((kl.detach() * mask).sum())
    loss = aggregate(
        loss_tok,
        mask,
        cfg.loss_type,
        num_sequences=num_sequences,
        num_tokens=num_tokens,
        max_len=max_len,
        num_rows=num_rows,
    )
    low, high = clip_masks(ratio, advantages, cfg.eps_low, cfg.eps_high)
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    dual = (ratio > cfg.dual_clip) & (adv < 0) if cfg.dual_clip is not None else torch.zeros_like(low)
    m = mask.bool()
    stats = {
        "tokens": float(m.sum()),
        "clip_low": float((low & m).sum()),
        "clip_high": float((high & m).sum()),
        "clip_dual": float((dual & m).sum()),
        "kl": kl_sum,
        "ratio": float((ratio * m).sum()),
    }
    return loss, stats
