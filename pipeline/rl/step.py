"""One RL step's update: advantages, minibatches, gradient accumulation, and the step's metrics.

How one RL step runs: advantages are computed once over the whole step's samples (groups by
``group_id``); the samples are shuffled by a generator seeded from (seed, step), cut into minibatches
of ``minibatch_size`` and every ``grad_accum`` minibatches make one optimizer update; ``mu`` passes over
the data. Loss normalisers (sequence/token counts, dr_grpo's length) are those of the whole update,
so ``minibatch_size=4, grad_accum=1`` and ``2, 2`` give the same gradient. Logprobs are
``log_softmax(logits / temperature)``, matching what the sampler recorded. A non-finite loss or
gradient norm discards that update's gradients (adapter and optimizer state untouched, the schedule
not advanced) and is counted in the metrics.

Old logprobs (the ratio's anchor, ``grpo.anchor: trainer``, and the sampler-mismatch metrics): the
trainer's logprob of every sampled token under the parameters the RL step starts from, kept per
sample at its own completion length and scattered by row into whichever (reshuffled, differently
padded) minibatch trains it. Until the step's first optimizer update the forward pass being trained
runs on exactly those parameters, so its ``logp.detach()`` *is* the old logprob and costs nothing:
the samples of the first update take theirs from it. Only samples first trained after an update (more
than one update per step, or ``mu > 1``) need a no-grad forward beforehand (``step_context``, in row
order, one minibatch at a time): with the 7B preset's 4 updates of 32 samples, 96 of 128 samples;
with one update per step, none. (0.75 of a forward per sample against about 4 forward-equivalents for a
checkpointed forward and backward: about 19% more compute for the 7B preset.) Every pass is in a fixed
order and draws from the torch RNG only through dropout, whose state the checkpoint restores, so a
resumed run stays bit-identical. Each step's metrics include the sampler/trainer mismatch
(``mismatch_kl``, ``mismatch_abs``, ``mismatch_out``, ``tis_capped``; see ``train_step``).

AQN noise in the trainer (``grpo.aqn_objective``, qerl.pipeline.rl.objective): on a noisy step
(the rollouts' ``sigma > 0``) ``noisy_trainer`` runs the old-logprob pass and every trained
forward/backward with the rollout's noise on the norm weights, and ``on_policy`` adds one no-grad
pass over all samples with that noise (the TIS reference, ``noisy_old``). The noise comes from
``noise_fn`` (the stage passes ``qerl.pipeline.rollout.aqn.apply_to_hf_model``: ``rl`` may not import
``rollout``, same layer) with the rollout's recorded seed and sigma, and each noisy stretch restores
the clean weights (sigma 0) when it ends, even on an error: between the functions here the model is
always clean, so the saved adapter, the resident policy and the reference-KL pass (which runs before
the noisy forward, so the noise stays in place from a forward to its backward) never see it.
``clean_is`` and any noise-free step touch no norm weight.

Metrics of a step that trained no token: every row empty or masked (all truncated under
``mask_truncated``), so no token reached the loss. The per-token means (``TOKEN_MEAN_METRICS``:
entropy, KL, clip shares, mismatch) are then ``None`` (JSON null), not 0: the entropy of nothing is
undefined, and a 0 would read as a collapsed policy in a curve or an average. A step whose groups
all had one reward (advantage 0 everywhere) is not such a step: its tokens go through the loss with
zero weight, so entropy and mismatch are measured as usual, only the gradient is 0.

Departure: the ratio's anchor is the trainer's recomputed logprob, as in TRL, but with a truncated
importance weight against the sampler and dual clip on by default (see qerl.pipeline.rl.objective
for why).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from qerl.pipeline.rl.batch import RolloutBatch, collate
from qerl.pipeline.rl.logprobs import completion_logprobs
from qerl.pipeline.rl.objective import group_advantages, grpo_token_objective, mismatch_sums
from qerl.pipeline.rl.policy import TrainState, trainable_parameters
from qerl.pipeline.rl.train_config import TrainConfig

__all__ = [
    "MISMATCH_METRICS",
    "NoiseFn",
    "TOKEN_MEAN_METRICS",
    "accumulate_gradients",
    "step_context",
    "train_step",
]

log = logging.getLogger("qerl.training")

MISMATCH_METRICS = ("mismatch_kl", "mismatch_abs", "mismatch_out", "tis_capped")
# averages over the step's trained tokens: None for a step that trained none (module docstring)
TOKEN_MEAN_METRICS = ("clip_frac_low", "clip_frac_high", "clip_frac_dual", "entropy", "kl", "ratio_mean",
                      *MISMATCH_METRICS)  # fmt: skip

# ``fn(model, sigma, seed)``: AQN noise on a (peft-wrapped) HF model's norm weights, sigma 0 restoring
# the clean ones: qerl.pipeline.rollout.aqn.apply_to_hf_model's signature.
NoiseFn = Callable[[Any, float, int], object]


@dataclass(frozen=True)
class _Noise:
    sigma: float
    seed: int
    apply: NoiseFn


@contextmanager
def _noised(model: Any, noise: _Noise | None) -> Iterator[None]:
    """``noise`` on the model's norms for the block, the clean weights after it (even on an error)."""
    if noise is None:
        yield
        return
    noise.apply(model, noise.sigma, noise.seed)
    try:
        yield
    finally:
        noise.apply(model, 0.0, noise.seed)


def _step_noise(batch: RolloutBatch, cfg: TrainConfig, noise_fn: NoiseFn | None) -> _Noise | None:
    """The rollout's noise if the objective applies it in the trainer (None: clean_is, or sigma 0)."""
    choice = cfg.grpo.aqn_objective
    if choice == "clean_is" or batch.sigma == 0.0:
        return None
    if batch.noise_seed is None:
        raise ValueError(
            f"{batch.source}: grpo.aqn_objective={choice} needs the rollout's AQN noise seed, but these "
            f"rollouts (sigma {batch.sigma}) do not record one (no noise_seed column: re-run the rollout "
            "stage, or use grpo.aqn_objective: clean_is)"
        )
    if noise_fn is None:
        raise ValueError(
            f"grpo.aqn_objective={choice} on a noisy step (sigma {batch.sigma}) needs noise_fn "
            "(qerl.pipeline.rollout.aqn.apply_to_hf_model) to apply the rollout's noise in the trainer"
        )
    return _Noise(float(batch.sigma), int(batch.noise_seed), noise_fn)


def _update_groups(n: int, cfg: TrainConfig, generator: torch.Generator) -> list[list[list[int]]]:
    """mu passes of shuffled minibatches, grouped ``grad_accum`` at a time into optimizer updates."""
    updates = []
    for _ in range(cfg.mu):
        perm = torch.randperm(n, generator=generator).tolist()
        minibatches = [perm[i : i + cfg.minibatch_size] for i in range(0, n, cfg.minibatch_size)]
        updates += [minibatches[i : i + cfg.grad_accum] for i in range(0, len(minibatches), cfg.grad_accum)]
    return updates


@dataclass
class _StepContext:
    batch: RolloutBatch
    rewards: torch.Tensor
    adv: torch.Tensor
    row_mask: torch.Tensor
    lengths: torch.Tensor
    max_len: int
    pad_id: int
    # The trainer's logprobs of each sample's completion under the step's starting parameters
    # (unpadded, one entry per row), filled by ``step_context`` and by the first update's forward.
    old_logp: dict[int, torch.Tensor]
    updated: bool = False  # an optimizer step has changed the parameters since the step began
    noise: _Noise | None = None  # on the norms for every trained forward/backward (noisy_trainer)
    # on_policy, noisy step: the old logprobs with the rollout's noise, per row (the TIS reference)
    noisy_old: dict[int, torch.Tensor] | None = None


@contextmanager
def _measuring(model: Any) -> Iterator[None]:
    """No grad and eval mode (no LoRA dropout) for a pass that measures the policy rather than
    trains it: old logprobs and the reference. Dropout there would add noise of its own to the ratio
    and the KL, and draw from torch's global generator."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def _old_logprobs(
    model: Any, batch: RolloutBatch, rows: list[int], cfg: TrainConfig, pad_id: int, row_mask: torch.Tensor
) -> dict[int, torch.Tensor]:
    """No-grad logprobs of ``rows`` (in this order, ``minibatch_size`` at a time), each unpadded."""
    out: dict[int, torch.Tensor] = {}
    with _measuring(model):
        for i in range(0, len(rows), cfg.minibatch_size):
            chunk = rows[i : i + cfg.minibatch_size]
            mb = collate(batch, chunk, row_mask, pad_id)
            lp, _ = completion_logprobs(model, mb, cfg.temperature, lora_autocast=cfg.lora_autocast)
            for b, r in enumerate(chunk):
                out[r] = lp[b, : len(batch.completion_ids[r])].clone()
    return out


def step_context(
    state: TrainState,
    batch: RolloutBatch,
    cfg: TrainConfig,
    pad_id: int = 0,
    *,
    first_update: list[list[int]] | None = None,
    noise_fn: NoiseFn | None = None,
) -> _StepContext:
    """Everything fixed for the whole RL step: advantages, masks, normalisers, old logprobs.

    ``first_update``: the minibatches of the step's first optimizer update; their samples' old
    logprobs come from that update's own forward (same parameters, no extra pass). Every other
    sample's are computed here, before any update. ``None``: all samples' are computed here.
    ``noise_fn``: applies the rollout's AQN noise when ``grpo.aqn_objective`` needs it (module notes).
    """
    g = cfg.grpo
    n = len(batch)
    if n == 0:
        raise ValueError(f"{batch.source}: no samples to train on")
    rewards = torch.tensor(batch.rewards, dtype=torch.float32)
    adv = group_advantages(rewards, batch.group_ids, g.scale_rewards, g.adv_eps)
    lengths = torch.tensor([len(c) for c in batch.completion_ids], dtype=torch.float32)
    row_mask = (lengths > 0).float()
    if g.mask_truncated:
        row_mask = row_mask * (1.0 - torch.tensor(batch.truncated, dtype=torch.float32))
    max_len = g.max_completion_length or int(lengths.max().item()) or 1
    free = {r for mb in first_update or [] for r in mb}
    rows = [r for r in range(n) if r not in free]
    noise = _step_noise(batch, cfg, noise_fn)
    trained_noise = noise if g.aqn_objective == "noisy_trainer" else None
    with _noised(state.model, trained_noise if rows else None):
        old_logp = _old_logprobs(state.model, batch, rows, cfg, pad_id, row_mask)
    noisy_old = None
    if noise is not None and g.aqn_objective == "on_policy":
        with _noised(state.model, noise):
            noisy_old = _old_logprobs(state.model, batch, list(range(n)), cfg, pad_id, row_mask)
    ctx = _StepContext(batch, rewards, adv, row_mask, lengths, max_len, pad_id, old_logp)
    ctx.noise, ctx.noisy_old = trained_noise, noisy_old
    return ctx


def _scatter_old(ctx: _StepContext, rows: list[int], logp: torch.Tensor) -> torch.Tensor:
    """The minibatch's [B, C] old logprobs by row; a row without one takes this forward's (which are
    the old ones as long as no update has happened in this step) and keeps it for later minibatches."""
    old = logp.detach().clone()
    for b, r in enumerate(rows):
        length = len(ctx.batch.completion_ids[r])
        if r not in ctx.old_logp:
            if ctx.updated:
                raise RuntimeError(f"row {r} has no old logprobs and the parameters already changed")
            ctx.old_logp[r] = old[b, :length].clone()
        old[b, :length] = ctx.old_logp[r].to(old.device)
    return old


def _gather_noisy_old(ctx: _StepContext, rows: list[int], like: torch.Tensor) -> torch.Tensor | None:
    """The minibatch's [B, C] noisy old logprobs (on_policy, noisy step), else None; padding 0."""
    if ctx.noisy_old is None:
        return None
    out = torch.zeros_like(like)
    for b, r in enumerate(rows):
        out[b, : len(ctx.batch.completion_ids[r])] = ctx.noisy_old[r].to(out.device)
    return out


def accumulate_gradients(
    model: Any, ctx: _StepContext, update: list[list[int]], cfg: TrainConfig, totals: dict[str, float]
) -> tuple[float, bool]:
    """Forward/backward every minibatch of one optimizer update, summing into ``.grad``.

    Normalisers are the update's own sequence/token counts, so the result does not depend on how the
    update is split into minibatches. Returns (loss, all minibatch losses finite); adds metric sums
    into ``totals``.
    """
    g = cfg.grpo
    rows_all = [r for mb in update for r in mb]
    n_rows = len(rows_all)
    n_seq = sum(1 for r in rows_all if ctx.row_mask[r] * ctx.lengths[r] > 0)  # fully masked rows are dropped
    n_tok = float(sum(ctx.row_mask[r] * ctx.lengths[r] for r in rows_all))
    # bnpo: each minibatch's token mean, averaged over the minibatches that have tokens
    n_mb = max(1, sum(1 for mb in update if any(ctx.row_mask[r] * ctx.lengths[r] > 0 for r in mb)))
    update_loss, finite = 0.0, True
    for rows in update:
        mb = collate(ctx.batch, rows, ctx.row_mask, ctx.pad_id)
        ref = None
        if g.beta > 0.0:  # the clean base, before the (possibly noisy) forward: see the module notes
            with _measuring(model), model.disable_adapter():
                ref, _ = completion_logprobs(model, mb, cfg.temperature, lora_autocast=cfg.lora_autocast)
        with _noised(model, ctx.noise):  # the noise stays on from the forward through its backward
            logp, entropy = completion_logprobs(
                model, mb, cfg.temperature, with_entropy=True, lora_autocast=cfg.lora_autocast
            )
            device = logp.device
            loss, stats = grpo_token_objective(
                logp,
                mb["sampler_logp"].to(device),
                ctx.adv[rows].to(device),
                mb["mask"].to(device),
                g,
                old_logp=_scatter_old(ctx, rows, logp),
                noisy_old_logp=_gather_noisy_old(ctx, rows, logp),
                ref_logp=ref,
                num_sequences=n_seq,
                num_tokens=n_tok,
                max_len=ctx.max_len,
                num_rows=n_rows,
            )
            if g.loss_type == "bnpo":
                loss = loss / n_mb
            finite = finite and bool(torch.isfinite(loss.detach()))
            loss.backward()
        update_loss += float(loss.detach())
        for k in ("tokens", "clip_low", "clip_high", "clip_dual", "kl", "ratio"):
            totals[k] = totals.get(k, 0.0) + stats[k]
        totals["entropy"] = totals.get("entropy", 0.0) + float((entropy * mb["mask"].to(device)).sum())
    return update_loss, finite


def _mismatch_metrics(ctx: _StepContext, cfg: TrainConfig) -> dict[str, float | None]:
    """Sampler vs trainer (old logprobs; on_policy's noisy ones, the TIS reference) over every trained
    token of the step, once per sample (``None`` each when no token was trained: module docstring)."""
    rows = [r for r in range(len(ctx.batch)) if ctx.row_mask[r] * ctx.lengths[r] > 0]
    if not rows:
        return dict.fromkeys(MISMATCH_METRICS)
    trainer = ctx.noisy_old if ctx.noisy_old is not None else ctx.old_logp
    old = torch.cat([trainer[r].float().cpu() for r in rows])
    sampler = torch.cat([torch.tensor(ctx.batch.sampler_logprobs[r], dtype=torch.float32) for r in rows])
    g = cfg.grpo
    sums = mismatch_sums(old, sampler, g.eps_low, g.eps_high, g.tis_cap if g.anchor == "trainer" else None)
    tok = sums["mismatch_tokens"]
    return {
        "mismatch_kl": sums["mismatch_k3"] / tok,
        "mismatch_abs": sums["mismatch_abs"] / tok,
        "mismatch_out": sums["mismatch_out"] / tok,
        "tis_capped": sums["tis_capped"] / tok,
    }


def train_step(
    state: TrainState,
    batch: RolloutBatch,
    cfg: TrainConfig,
    pad_id: int = 0,
    *,
    noise_fn: NoiseFn | None = None,
) -> dict[str, Any]:
    """Apply one RL step's update(s) in place; returns the step's metrics.

    Besides loss, gradient norm, clip shares (``clip_frac_low``/``high``/``dual``), entropy and KL, the
    sampler-vs-trainer mismatch over the step's trained tokens (trainer = old logprobs): ``mismatch_kl``
    (k3 estimate of KL(sampler || trainer)), ``mismatch_abs`` (mean ``|logp_trainer - logp_sampler|``),
    ``mismatch_out`` (share with ``pi_trainer / pi_sampler`` outside ``[1 - eps_low, 1 + eps_high]``:
    what the sampler anchor would clip before any update) and ``tis_capped`` (share where the TIS cap
    binds; 0 without TIS). The per-token means are ``None`` when no token was trained. Under
    ``aqn_objective`` on_policy / noisy_trainer the trainer side carries the rollout's noise, so these
    measure the engine's numerics only. ``noise_fn``: see ``step_context``.
    """
    t0 = time.perf_counter()
    model = state.model
    model.train()
    generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + state.step)
    updates = _update_groups(len(batch), cfg, generator)
    ctx = step_context(
        state, batch, cfg, pad_id, first_update=updates[0] if updates else None, noise_fn=noise_fn
    )
    params = [p for _, p in trainable_parameters(model)]
    n, rewards, adv, lengths, row_mask = len(batch), ctx.rewards, ctx.adv, ctx.lengths, ctx.row_mask
    totals = dict.fromkeys(("tokens", "clip_low", "clip_high", "clip_dual", "kl", "ratio", "entropy"), 0.0)
    losses, norms, skipped, lrs = [], [], 0, []
    for update in updates:
        update_loss, finite = accumulate_gradients(model, ctx, update, cfg, totals)
        norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        if not finite or not bool(torch.isfinite(norm)):
            log.warning(
                "step %d: non-finite loss (%s) or grad norm (%s): update skipped",
                state.step,
                update_loss,
                float(norm),
            )
            state.optimizer.zero_grad(set_to_none=True)
            skipped += 1
            continue
        lrs.append(state.optimizer.param_groups[0]["lr"])
        state.optimizer.step()
        ctx.updated = True
        state.scheduler.step()
        state.optimizer.zero_grad(set_to_none=True)
        state.updates += 1
        losses.append(update_loss)
        norms.append(float(norm))
    state.step += 1
    tok = max(totals["tokens"], 1.0)
    metrics = {
        "loss": sum(losses) / len(losses) if losses else float("nan"),
        "grad_norm": sum(norms) / len(norms) if norms else float("nan"),
        "clip_frac_low": totals["clip_low"] / tok,
        "clip_frac_high": totals["clip_high"] / tok,
        "clip_frac_dual": totals["clip_dual"] / tok,
        "entropy": totals["entropy"] / tok,
        "kl": totals["kl"] / tok,
        "ratio_mean": totals["ratio"] / tok,
        **_mismatch_metrics(ctx, cfg),
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()) if n > 1 else 0.0,
        "adv_abs_mean": float(adv.abs().mean()),
        "tokens": int(lengths.sum()),
        "tokens_trained": int((lengths * row_mask).sum()),
        "frac_truncated": float(torch.tensor(batch.truncated, dtype=torch.float32).mean()),
        "lr": lrs[-1] if lrs else state.optimizer.param_groups[0]["lr"],
        "updates": len(losses),
        "skipped_updates": skipped,
        "skipped": skipped > 0,
        "step_time_s": time.perf_counter() - t0,
    }
    if totals["tokens"] == 0:  # no token trained: the per-token means are undefined (module docstring)
        metrics.update(dict.fromkeys(TOKEN_MEAN_METRICS))
    return metrics
