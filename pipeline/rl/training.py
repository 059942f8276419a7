"""LoRA GRPO training on the (NVFP4) base: the policy model, one RL step's update, and its checkpoint.

What: ``init_state`` builds the policy (the NVFP4 base from ``qerl.pipeline.nvfp4.linear`` or a plain HF base,
peft LoRA on top, AdamW, warmup+cosine schedule); ``train_step`` applies one RL step's update from
scored rollouts; ``save_checkpoint``/``load_checkpoint`` persist everything needed to continue bit
for bit (adapter, optimizer moments, scheduler, RNG, step) as safetensors + JSON, never pickle.

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

Metrics of a step that trained no token: every row empty or masked (all truncated under
``mask_truncated``), so no token reached the loss. The per-token means (``TOKEN_MEAN_METRICS``:
entropy, KL, clip shares, mismatch) are then ``None`` (JSON null), not 0: the entropy of nothing is
undefined, and a 0 would read as a collapsed policy in a curve or an average (issue 13). A step whose
groups all had one reward (advantage 0 everywhere) is not such a step: its tokens go through the
loss with zero weight, so entropy and mismatch are measured as usual, only the gradient is 0.

Device settings (``optimizer_impl``, ``qerl.pipeline.rl.logprobs.logprob_chunk_elements`` and
``qerl.pipeline.nvfp4.linear.slice_elements`` choose by ``device.type``): the CPU keeps small logprob slabs,
16 MiB weight slices and the for-loop AdamW, which bound resident memory (the slabs and slices at a
speed cost, measured at each); CUDA takes large slabs, whole-layer decode and the fused AdamW kernel.

Departures: the ratio's anchor is the trainer's recomputed logprob, as in TRL, but with a truncated
importance weight against the sampler and dual clip on by default (see qerl.pipeline.rl.objective for why).
The warmup is ``(u+1)/warmup`` so the first update does not run at lr 0 (transformers' convention
wastes it). Python's and NumPy's RNGs are not saved: nothing in training draws from them.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field, field_validator
from qerl.pipeline.config import StrictModel
from qerl.pipeline.rl.logprobs import (  # re-exported: callers import them from here
    LOGPROB_CHUNK_ELEMENTS,
    LOGPROB_CHUNK_ELEMENTS_CUDA,
    completion_logprobs,
    logprob_chunk_elements,
)
from qerl.pipeline.rl.objective import GRPOConfig, group_advantages, grpo_token_objective, mismatch_sums
from qerl.pipeline.store.artifacts import atomic_write_json
from safetensors.torch import load_file, save_file

log = logging.getLogger("qerl.training")

MISMATCH_METRICS = ("mismatch_kl", "mismatch_abs", "mismatch_out", "tis_capped")
# averages over the step's trained tokens: None for a step that trained none (module docstring)
TOKEN_MEAN_METRICS = ("clip_frac_low", "clip_frac_high", "clip_frac_dual", "entropy", "kl", "ratio_mean",
                      *MISMATCH_METRICS)  # fmt: skip

__all__ = [
    "LOGPROB_CHUNK_ELEMENTS",
    "LOGPROB_CHUNK_ELEMENTS_CUDA",
    "RolloutBatch",
    "TrainConfig",
    "TrainState",
    "completion_logprobs",
    "check_adapter_shape",
    "init_state",
    "is_nvfp4_checkpoint",
    "load_adapter_weights",
    "load_checkpoint",
    "load_rollout_batch",
    "logprob_chunk_elements",
    "accumulate_gradients",
    "optimizer_impl",
    "save_checkpoint",
    "step_context",
    "train_step",
]

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
    minibatch_size: int = Field(8, ge=1, description="sequences per forward/backward")
    grad_accum: int = Field(1, ge=1, description="minibatches per optimizer update")
    max_grad_norm: float = Field(0.2, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    gradient_checkpointing: bool = False
    lora_autocast: bool = Field(
        True,
        description="LoRA matmuls in the base dtype (bf16), fp32 master weights/grads/AdamW; false: all fp32",
    )
    seed: int = 0
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    temperature: float = Field(1.0, gt=0.0, description="must equal the rollout temperature")
    grpo: GRPOConfig = GRPOConfig()

    @field_validator("target_modules")
    @classmethod
    def _frozen_head_and_embeddings(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        # The fused logprob head (``_TokenLogprobs``) applies the lm_head as a plain Linear, so a
        # peft-wrapped head would be skipped; the embedding is tied to it: neither may carry a LoRA.
        bad = [m for m in value if m in ("lm_head", "embed_tokens")]
        if bad:
            raise ValueError(f"target_modules may not include {bad}: only projections inside the layers")
        return value


# -- data ------------------------------------------------------------------------------------------


@dataclass
class RolloutBatch:
    """The scored rollouts of one RL step, as Python lists (one entry per sample)."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    sampler_logprobs: list[list[float]]
    truncated: list[bool]
    rewards: list[float]
    group_ids: list[Any]
    source: str = "<memory>"

    def __len__(self) -> int:
        return len(self.rewards)


def load_rollout_batch(path: str | Path, temperature: float | None = None) -> RolloutBatch:
    """Read ``scored.parquet``; checks lengths per row and (if given) the sampling temperature."""
    import pyarrow.parquet as pq

    path = Path(path)
    table = pq.read_table(path)
    need = ["group_id", "prompt_ids", "completion_ids", "logprobs", "finish_reason", "reward"]
    missing = [c for c in need if c not in table.column_names]
    if missing:
        raise ValueError(f"{path}: missing columns {missing} (has {table.column_names})")
    cols = {c: table.column(c).to_pylist() for c in need}
    if temperature is not None and "temperature" in table.column_names:
        temps = set(table.column("temperature").to_pylist())
        if any(not math.isclose(t, temperature, rel_tol=1e-6) for t in temps):
            raise ValueError(
                f"{path}: rollouts sampled at temperature {sorted(temps)}, training uses {temperature}"
            )
    for i, (p, c, lp) in enumerate(
        zip(cols["prompt_ids"], cols["completion_ids"], cols["logprobs"], strict=True)
    ):
        if not p:
            raise ValueError(f"{path}: row {i} has an empty prompt")
        if len(lp) != len(c):
            raise ValueError(f"{path}: row {i} has {len(c)} completion ids but {len(lp)} logprobs")
    return RolloutBatch(
        prompt_ids=cols["prompt_ids"],
        completion_ids=cols["completion_ids"],
        sampler_logprobs=cols["logprobs"],
        truncated=[r == "length" for r in cols["finish_reason"]],
        rewards=[float(r) for r in cols["reward"]],
        group_ids=cols["group_id"],
        source=str(path),
    )


def _collate(
    batch: RolloutBatch, rows: list[int], row_mask: torch.Tensor, pad_id: int
) -> dict[str, torch.Tensor]:
    """Left-pad prompts and right-pad completions so every completion starts at the same column."""
    P = max(len(batch.prompt_ids[i]) for i in rows)
    C = max(1, max(len(batch.completion_ids[i]) for i in rows))
    n = len(rows)
    input_ids = torch.full((n, P + C), pad_id, dtype=torch.long)
    attention = torch.zeros(n, P + C, dtype=torch.long)
    comp_mask = torch.zeros(n, C)
    sampler = torch.zeros(n, C)
    for b, i in enumerate(rows):
        p, c = batch.prompt_ids[i], batch.completion_ids[i]
        input_ids[b, P - len(p) : P] = torch.tensor(p)
        input_ids[b, P : P + len(c)] = torch.tensor(c, dtype=torch.long)
        attention[b, P - len(p) : P + len(c)] = 1
        comp_mask[b, : len(c)] = row_mask[i]
        sampler[b, : len(c)] = torch.tensor(batch.sampler_logprobs[i], dtype=torch.float32)
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    return {
        "input_ids": input_ids,
        "attention_mask": attention,
        "position_ids": position_ids,
        "completion_ids": input_ids[:, P:],
        "mask": comp_mask,
        "sampler_logp": sampler,
    }


# -- model, optimizer, schedule ----------------------------------------------------------------------


@dataclass
class TrainState:
    model: Any  # peft PeftModel
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    step: int = 0  # RL steps completed
    updates: int = 0  # optimizer updates applied
    base_dir: str = ""
    base_format: str = ""


def is_nvfp4_checkpoint(model_dir: str | Path) -> bool:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    qc = config.get("quantization_config") or {}
    return qc.get("format") == "nvfp4-pack-quantized" or any(
        g.get("format") == "nvfp4-pack-quantized" for g in (qc.get("config_groups") or {}).values()
    )


def _lr_lambda(cfg: TrainConfig):  # noqa: ANN202
    def lr_at(update: int) -> float:
        if update < cfg.warmup_steps:
            return (update + 1) / cfg.warmup_steps
        if cfg.total_steps is None:  # no horizon known (a run always derives one): constant after warmup
            return 1.0
        span = max(1, cfg.total_steps - cfg.warmup_steps)
        progress = min(1.0, (update - cfg.warmup_steps) / span)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return lr_at


def _build_model(base_dir: Path, cfg: TrainConfig, device: str) -> tuple[Any, str]:
    from peft import LoraConfig, get_peft_model
    from qerl.pipeline.nvfp4.linear import load_quantized_for_training, register_with_peft
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, cfg.dtype)
    if is_nvfp4_checkpoint(base_dir):
        model = load_quantized_for_training(base_dir, dtype=dtype, device=device)
        base_format = "nvfp4"
    else:
        model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype).to(device)
        model.requires_grad_(False)
        base_format = "hf"
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = LoraConfig(
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=list(cfg.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    register_with_peft(lora)
    with warnings.catch_warnings():
        # peft warns for every layer type it does not know; NVFP4Linear is registered above on purpose
        warnings.filterwarnings("ignore", message="Unsupported layer type", category=UserWarning)
        model = get_peft_model(model, lora)
    return model, base_format


def _trainable(model: Any) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def optimizer_impl(device: torch.device | str) -> dict[str, bool]:
    """AdamW's implementation switches for ``device`` (by ``device.type``).

    CUDA: ``fused=True``, one kernel for every parameter's update instead of several elementwise
    launches per LoRA tensor (hundreds of small tensors: 7 projections x 2 x layers), deterministic
    like the others. CPU: ``foreach=False``, the per-parameter loop, which allocates no multi-tensor
    temporaries; there is no launch overhead to save.
    """
    return {"fused": True} if torch.device(device).type == "cuda" else {"foreach": False}


def _with_impl(groups: list[dict[str, Any]], device: torch.device | str) -> list[dict[str, Any]]:
    """Param groups with this device's implementation switches (a checkpoint may come from another)."""
    impl = optimizer_impl(device)
    return [{**g, "fused": impl.get("fused"), "foreach": impl.get("foreach")} for g in groups]


def init_state(
    base_dir: str | Path, cfg: TrainConfig, device: str = "cpu", init_adapter: str | Path | None = None
) -> TrainState:
    """A fresh policy (LoRA initialised from ``cfg.seed``), optimizer and schedule at step 0.

    ``init_adapter``: a peft adapter folder whose weights replace the fresh LoRA (a warm start: the
    optimizer and schedule still start fresh)."""
    if init_adapter is not None:
        check_adapter_shape(init_adapter, cfg)
    torch.manual_seed(cfg.seed)
    model, base_format = _build_model(Path(base_dir), cfg, device)
    if init_adapter is not None:
        load_adapter_weights(model, init_adapter, device)
    params = [p for _, p in _trainable(model)]
    optimizer = torch.optim.AdamW(
        params,
        lr=cfg.lr,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_eps,
        weight_decay=cfg.weight_decay,
        **optimizer_impl(device),
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(cfg))
    return TrainState(model, optimizer, scheduler, base_dir=str(base_dir), base_format=base_format)


# -- one RL step -----------------------------------------------------------------------------------


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


def _old_logprobs(
    model: Any, batch: RolloutBatch, rows: list[int], cfg: TrainConfig, pad_id: int, row_mask: torch.Tensor
) -> dict[int, torch.Tensor]:
    """No-grad logprobs of ``rows`` (in this order, ``minibatch_size`` at a time), each unpadded."""
    out: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for i in range(0, len(rows), cfg.minibatch_size):
            chunk = rows[i : i + cfg.minibatch_size]
            mb = _collate(batch, chunk, row_mask, pad_id)
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
) -> _StepContext:
    """Everything fixed for the whole RL step: advantages, masks, normalisers, old logprobs.

    ``first_update``: the minibatches of the step's first optimizer update; their samples' old
    logprobs come from that update's own forward (same parameters, no extra pass). Every other
    sample's are computed here, before any update. ``None``: all samples' are computed here.
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
    old_logp = _old_logprobs(state.model, batch, rows, cfg, pad_id, row_mask)
    return _StepContext(batch, rewards, adv, row_mask, lengths, max_len, pad_id, old_logp)


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
        mb = _collate(ctx.batch, rows, ctx.row_mask, ctx.pad_id)
        logp, entropy = completion_logprobs(
            model, mb, cfg.temperature, with_entropy=True, lora_autocast=cfg.lora_autocast
        )
        device = logp.device
        ref = None
        if g.beta > 0.0:
            with torch.no_grad(), model.disable_adapter():
                ref, _ = completion_logprobs(model, mb, cfg.temperature, lora_autocast=cfg.lora_autocast)
        loss, stats = grpo_token_objective(
            logp,
            mb["sampler_logp"].to(device),
            ctx.adv[rows].to(device),
            mb["mask"].to(device),
            g,
            old_logp=_scatter_old(ctx, rows, logp),
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
    """Sampler vs trainer (old logprobs) over every trained token of the step, once per sample
    (``None`` each when no token was trained: see the module docstring)."""
    rows = [r for r in range(len(ctx.batch)) if ctx.row_mask[r] * ctx.lengths[r] > 0]
    if not rows:
        return dict.fromkeys(MISMATCH_METRICS)
    old = torch.cat([ctx.old_logp[r].float().cpu() for r in rows])
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


def train_step(state: TrainState, batch: RolloutBatch, cfg: TrainConfig, pad_id: int = 0) -> dict[str, Any]:
    """Apply one RL step's update(s) in place; returns the step's metrics.

    Besides loss, gradient norm, clip shares (``clip_frac_low``/``high``/``dual``), entropy and KL, the
    sampler-vs-trainer mismatch over the step's trained tokens (trainer = old logprobs): ``mismatch_kl``
    (k3 estimate of KL(sampler || trainer)), ``mismatch_abs`` (mean ``|logp_trainer - logp_sampler|``),
    ``mismatch_out`` (share with ``pi_trainer / pi_sampler`` outside ``[1 - eps_low, 1 + eps_high]``:
    what the sampler anchor would clip before any update) and ``tis_capped`` (share where the TIS cap
    binds; 0 without TIS). The per-token means are ``None`` when no token was trained.
    """
    t0 = time.perf_counter()
    model = state.model
    model.train()
    generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + state.step)
    updates = _update_groups(len(batch), cfg, generator)
    ctx = step_context(state, batch, cfg, pad_id, first_update=updates[0] if updates else None)
    params = [p for _, p in _trainable(model)]
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


# -- checkpoint ------------------------------------------------------------------------------------


def save_checkpoint(state: TrainState, out_dir: str | Path) -> Path:
    """Write ``adapter/``, ``optimizer.safetensors`` and ``trainer_state.json`` atomically into ``out_dir``."""
    from peft import get_peft_model_state_dict

    out_dir = Path(out_dir)
    tmp = out_dir.with_name(f".{out_dir.name}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.mkdir(parents=True)
    try:
        state.model.save_pretrained(tmp / "adapter")
        names = [n for n, _ in _trainable(state.model)]
        opt = state.optimizer.state_dict()
        tensors = {}
        for idx, per_param in opt["state"].items():
            for key, value in per_param.items():
                tensors[f"state.{idx}.{key}"] = value.detach().cpu().contiguous()
        save_file(tensors, str(tmp / "optimizer.safetensors"))
        rng = {"torch_cpu": torch.get_rng_state().tolist()}
        if torch.cuda.is_available():
            rng["torch_cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
        sched = {k: v for k, v in state.scheduler.state_dict().items() if k != "lr_lambdas"}
        lora_sd = get_peft_model_state_dict(state.model)
        atomic_write_json(
            tmp / "trainer_state.json",
            {
                "step": state.step,
                "updates": state.updates,
                "base_format": state.base_format,
                "param_names": names,
                "param_groups": opt["param_groups"],
                "scheduler": sched,
                "rng": rng,
                "adapter_tensors": len(lora_sd),
            },
        )
        if out_dir.exists():
            for child in tmp.iterdir():
                dest = out_dir / child.name
                if dest.is_dir():
                    shutil.rmtree(dest)
                os.replace(child, dest)
            tmp.rmdir()
        else:
            os.replace(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def check_adapter_shape(adapter_dir: str | Path, cfg: TrainConfig) -> None:
    """Raise unless the adapter folder was trained with this config's LoRA rank, alpha and targets."""
    adapter_cfg = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())
    want = {"r": cfg.lora_r, "lora_alpha": cfg.lora_alpha, "target_modules": sorted(cfg.target_modules)}
    have = {
        "r": adapter_cfg.get("r"),
        "lora_alpha": adapter_cfg.get("lora_alpha"),
        "target_modules": sorted(adapter_cfg.get("target_modules") or []),
    }
    if want != have:
        raise ValueError(f"{adapter_dir} was trained with {have}, the config asks for {want}")


def load_adapter_weights(model: Any, adapter_dir: str | Path, device: str = "cpu") -> None:
    """Load a saved peft adapter's weights into ``model``'s LoRA parameters (every one, nothing else)."""
    from peft import set_peft_model_state_dict

    adapter = load_file(str(Path(adapter_dir) / "adapter_model.safetensors"), device=device)
    result = set_peft_model_state_dict(model, adapter)
    names = [n for n, _ in _trainable(model)]
    if result.unexpected_keys or len(adapter) != len(names):
        raise ValueError(
            f"{adapter_dir} holds {len(adapter)} tensors for {len(names)} LoRA parameters "
            f"(unexpected: {result.unexpected_keys[:5]})"
        )


def load_checkpoint(
    base_dir: str | Path, cfg: TrainConfig, ckpt_dir: str | Path, device: str = "cpu"
) -> TrainState:
    """Rebuild the training state saved by ``save_checkpoint`` on top of ``base_dir``."""
    ckpt_dir = Path(ckpt_dir)
    meta_path = ckpt_dir / "trainer_state.json"
    if not meta_path.is_file():
        raise FileNotFoundError(f"no trainer_state.json in {ckpt_dir}")
    meta = json.loads(meta_path.read_text())
    state = init_state(base_dir, cfg, device, init_adapter=ckpt_dir / "adapter")
    names = [n for n, _ in _trainable(state.model)]
    if names != meta["param_names"]:
        raise ValueError(f"{ckpt_dir}: optimizer was saved for different parameters than the model now has")
    tensors = load_file(str(ckpt_dir / "optimizer.safetensors"), device=device)
    opt_state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        _, idx, name = key.split(".", 2)
        opt_state.setdefault(int(idx), {})[name] = value
    groups = _with_impl(meta["param_groups"], device)
    state.optimizer.load_state_dict({"state": opt_state, "param_groups": groups})
    state.scheduler.load_state_dict({**meta["scheduler"], "lr_lambdas": [None]})
    torch.set_rng_state(torch.tensor(meta["rng"]["torch_cpu"], dtype=torch.uint8))
    if "torch_cuda" in meta["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in meta["rng"]["torch_cuda"]])
    state.step, state.updates = int(meta["step"]), int(meta["updates"])
    return state
