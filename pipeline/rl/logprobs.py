"""Per-token logprobs of completions under a causal LM, with the lm_head fused into the log-softmax.

What: ``completion_logprobs(model, minibatch, T)`` gives ``log_softmax(lm_head(h) / T)[token]`` (fp32)
for every completion position of a collated minibatch (``qerl.pipeline.rl.batch.collate``), optionally
with the entropy, for the trainer's loss and its old logprobs.

How: the decoder runs to its last hidden states; ``_TokenLogprobs`` applies the lm_head and the
log-softmax one slab of positions at a time in forward and again in backward, so no tensor over the
whole vocabulary for all positions ever exists. The slab size is chosen per device type
(``logprob_chunk_elements``: small on the CPU to bound resident memory, large on CUDA so each slab's
GEMM is compute-bound; the reasons and numbers are at the function).

Departures: none from the plain ``log_softmax(model(...).logits / T)`` expression it replaces; values
and gradients match it up to the matmul's blocking (tests/stages/test_train.py checks both).
"""

from __future__ import annotations

import torch

__all__ = [
    "LOGPROB_CHUNK_ELEMENTS",
    "LOGPROB_CHUNK_ELEMENTS_CUDA",
    "completion_logprobs",
    "logprob_chunk_elements",
]


# Logit elements (positions x vocabulary) computed at a time by the fused lm_head + log-softmax, per
# device type (``logprob_chunk_elements``). Each slab re-reads the whole lm_head weight.
LOGPROB_CHUNK_ELEMENTS = 1 << 21  # CPU: 8 MiB per float32 temporary
LOGPROB_CHUNK_ELEMENTS_CUDA = 1 << 26  # CUDA: ~441 positions of a 152k vocabulary, ~1.1 GiB of temporaries


def logprob_chunk_elements(device: torch.device | str) -> int:
    """Slab size of the fused logprob head on ``device`` (by ``device.type``: "cuda", else the CPU's).

    Why they differ: every slab is one GEMM ``[rows, H] x [H, V]`` that re-reads the whole lm_head
    (1.1 GB at Qwen2.5-7B's 152k x 3584 in bf16), doing ``2 * rows`` FLOPs per weight byte, and leaves
    about 18 bytes of transients per element (bf16 logits plus four float32 temporaries).

    CPU: 13 positions at a 152k vocabulary, 38 MB of transients. This is a memory-for-speed trade,
    kept because the CPU is the memory-bound machine here and the peaks the CPU train benchmark and
    ``qerl plan`` report assume it. Larger slabs (``1 << 24``, 110 rows, 300 MB of transients) are
    faster on the CPU too (the measurement is in the decision record), so a CPU with memory to spare
    may raise it.

    CUDA: on an H100 (about 990 bf16 TFLOP/s against 3.35 TB/s: a ridge near 300 FLOPs per byte)
    13-row slabs are bandwidth-bound: a 4 x 1024-token minibatch at 7B would re-read the head 316
    times per pass (0.34 TB, ~0.1 s, against ~5 ms of arithmetic). ``1 << 26`` elements are 441 rows
    at 152k (10 slabs for that minibatch), past the ridge, for about 1.1 GiB of transients, small
    beside an 80 GB device's budget.
    """
    return LOGPROB_CHUNK_ELEMENTS_CUDA if torch.device(device).type == "cuda" else LOGPROB_CHUNK_ELEMENTS


class _TokenLogprobs(torch.autograd.Function):
    """Per-token ``log_softmax(lm_head(hidden) / T)[target]`` (fp32) and entropy, a slab at a time.

    Why: the update's largest transients were over the vocabulary: the ``[B, C, V]`` logits that
    autograd keeps for the log-softmax, their gradient, and the float32 copies of both (several
    hundred MB at Qwen's 152k vocabulary, 130 MB even at 32k). Here the lm_head is applied inside the
    Function, one slab of positions at a time, and only the hidden states (``[B, C, H]``) are saved;
    backward recomputes each slab's logits and sends ``grad_logits @ W`` straight to the hidden
    states, so nothing over the vocabulary outlives one slab. Each slab runs the ops of the plain
    expression (linear in the model dtype, ``.float() / T``, log-softmax; backward
    ``torch._log_softmax_backward_data`` on the one-hot gradient, ``/ T``, one rounding to the model
    dtype, then the linear's backward), so values and gradients match it up to the matmul's blocking.
    In training the lm_head is frozen (LoRA may not target it, see ``TrainConfig``); a head that
    requires grad (a plain model) gets its gradient accumulated in float32 over the slabs.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, with_entropy, chunk_elements):  # noqa: ANN001, ANN205
        # Slabs are row ranges of the flattened [B*C, H] states, so every slab F.linear sees is
        # contiguous (a strided one makes the CPU fall back to a bmm against an expanded weight).
        shape, flat, flat_targets = targets.shape, hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
        step = max(1, chunk_elements // weight.shape[0])
        logp = torch.empty(shape, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(logp) if with_entropy else None
        flat_logp, flat_entropy = logp.view(-1), entropy.view(-1) if entropy is not None else None
        for r0 in range(0, flat.shape[0], step):
            r1 = min(flat.shape[0], r0 + step)
            lsm = torch.log_softmax(
                torch.nn.functional.linear(flat[r0:r1], weight, bias).float() / temperature, -1
            )
            flat_logp[r0:r1] = lsm.gather(-1, flat_targets[r0:r1].unsqueeze(-1)).squeeze(-1)
            if flat_entropy is not None:
                flat_entropy[r0:r1] = -(lsm.exp() * lsm).sum(-1)
        ctx.save_for_backward(flat, weight, bias, flat_targets)
        ctx.temperature, ctx.step, ctx.hidden_shape = temperature, step, hidden.shape
        if entropy is None:
            return logp, None
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):  # noqa: ANN001, ANN205
        flat, weight, bias, flat_targets = ctx.saved_tensors
        grad_logp = grad_logp.reshape(-1)
        grad_hidden = torch.empty_like(flat) if ctx.needs_input_grad[0] else None
        # A trainable head (a plain model outside training, never the LoRA policy) accumulates in fp32.
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if ctx.needs_input_grad[2] else None
        for r0 in range(0, flat.shape[0], ctx.step):
            r1 = min(flat.shape[0], r0 + ctx.step)
            logits = torch.nn.functional.linear(flat[r0:r1], weight, bias)
            lsm = torch.log_softmax(logits.float() / ctx.temperature, dim=-1)
            onehot = torch.zeros_like(lsm).scatter_(-1, flat_targets[r0:r1, None], grad_logp[r0:r1, None])
            g = (torch._log_softmax_backward_data(onehot, lsm, -1, lsm.dtype) / ctx.temperature).to(
                logits.dtype
            )
            if grad_hidden is not None:
                grad_hidden[r0:r1] = g @ weight
            if grad_weight is not None:
                grad_weight += (g.t() @ flat[r0:r1]).float()
            if grad_bias is not None:
                grad_bias += g.float().sum(0)
        return (
            grad_hidden.view(ctx.hidden_shape) if grad_hidden is not None else None,
            grad_weight.to(weight.dtype) if grad_weight is not None else None,
            grad_bias.to(bias.dtype) if grad_bias is not None else None,
            None,
            None,
            None,
            None,
        )


def _decoder_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Linear]:
    """The decoder stack and the lm_head of an HF causal LM, or of the one a peft model wraps."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings()
    if type(head) is not torch.nn.Linear:
        raise ValueError(
            f"the logprob head needs a plain nn.Linear lm_head, got {type(head).__name__}"
            " ('lm_head' cannot be a LoRA target)"
        )
    if getattr(base.config, "final_logit_softcapping", None) or getattr(base.config, "logit_scale", None):
        raise ValueError(f"{type(base).__name__} rescales its logits; the fused logprob head does not")
    return base.get_decoder(), head


def completion_logprobs(
    model: torch.nn.Module,
    mb: dict[str, torch.Tensor],
    temperature: float,
    with_entropy: bool = False,
    lora_autocast: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token ``log_softmax(logits / T)`` of the completion tokens (fp32), and optionally entropy.

    The decoder runs to its last hidden states; ``_TokenLogprobs`` applies the lm_head and the
    log-softmax slab by slab, so no tensor over the whole vocabulary for all positions exists in
    forward or backward. Entropy comes from the same log-softmax and carries no gradient.

    ``lora_autocast`` (on a bf16/fp16 base): the fp32 LoRA weights are cast to the base dtype for
    their matmuls (autocast) and peft's cast of each input to fp32 is off, so activations stay in
    the base dtype; master weights, gradients and AdamW state stay fp32. This is mixed precision as
    TRL/accelerate run it on GPU and the precision vLLM's LoRA kernels serve the adapter in. peft's
    default (False here) keeps an fp32 copy of every LoRA input alive for backward and adds fp32
    ``[tokens, out]`` temporaries per projection: about 23 MB more peak RSS per arm in the 0.5B
    train benchmark (75 MB more live heap in a one-off profile of the NVFP4 arm).
    """
    from peft.helpers import disable_input_dtype_casting

    decoder, head = _decoder_and_head(model)
    C = mb["completion_ids"].shape[1]
    device = head.weight.device
    L = mb["input_ids"].shape[1]
    autocast = lora_autocast and head.weight.dtype in (torch.bfloat16, torch.float16)
    with (
        torch.autocast(device.type, dtype=head.weight.dtype, enabled=autocast),
        disable_input_dtype_casting(model, active=autocast),
    ):
        hidden = decoder(
            input_ids=mb["input_ids"].to(device),
            attention_mask=mb["attention_mask"].to(device),
            position_ids=mb["position_ids"].to(device),
            use_cache=False,
        ).last_hidden_state
    # Positions L-C-1 .. L-2 predict the completion tokens. Slicing copies them into one contiguous
    # [B, C, H] tensor: a strided view makes F.linear on the CPU run a bmm against the lm_head weight
    # expanded B times (B x 56 MB at a 32k vocabulary and hidden 896).
    hidden = hidden[:, L - C - 1 : L - 1].contiguous()
    targets = mb["completion_ids"].to(device)
    return _TokenLogprobs.apply(
        hidden, head.weight, head.bias, targets, temperature, with_entropy, logprob_chunk_elements(device)
    )
