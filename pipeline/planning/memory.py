"""What the trainer and the model's weights take in GPU memory: the bytes of each, by component.

The trainer holds the packed NVFP4 base (or QLoRA's NF4 one: ``nf4_bytes``) with its bf16 embeddings, the LoRA weights with their
gradients and AdamW moments (fp32, 16 bytes per parameter) plus their bf16 autocast copies, and the
activations of one minibatch: with gradient checkpointing the layer inputs of every layer plus one
layer recomputed for backward, without it every layer's saved tensors (``trainer_peak``). The
weights' and the KV cache's sizes per token serve the vLLM side of the plan too
(``qerl.pipeline.planning.memory_plan``).

How the activation bytes are counted (per token of one layer, bf16 compute, transformers' Qwen2
layer with SDPA under a padding mask): each RMSNorm keeps its float32 upcast (4H bytes, twice), the
two norm outputs feed the projections (2H each), attention keeps q after RoPE (2H), k and v
repeated to every head for SDPA (2H each), its output and the contiguous o_proj input (2H each);
the MLP keeps gate, up, SiLU(gate) and their product (2I each): ``SAVED_BYTES_H = 22`` and
``SAVED_BYTES_I = 8`` bytes per hidden and per intermediate element. The k/v projections' own outputs
before the repeat (4 x kv_dim) and the LoRA down-projections (r per target) are added exactly.
Back-propagating the layer holds about three [tokens, I] gradients (6I) and two [tokens, H] ones
(4H) at once: ``GRAD_BYTES_H = 4``, ``GRAD_BYTES_I = 6``. With checkpointing one layer is saved
and back-propagated at a time; without it every layer's saved tensors live until backward reaches it.

The trainer's figures are checked against measured peaks: the CPU train benchmark
(tests/pipeline/test_plan.py) and the GPU benchmark's ``torch.cuda.max_memory_allocated`` where
benchmarks/results/gpu.json exists.
"""

from __future__ import annotations

from qerl.pipeline.planning.model_shape import PROJECTIONS, ModelShape

__all__ = [
    "BASES",
    "base_bytes",
    "kv_bytes_per_token",
    "lora_params",
    "trainer_peak",
]

GiB = 1 << 30
BF16 = 2
# Activation bytes per token of one decoder layer, per hidden and per intermediate element, saved for
# backward and held while back-propagating it (see the module docstring for the tensors they count).
SAVED_BYTES_H, SAVED_BYTES_I = 22, 8
GRAD_BYTES_H, GRAD_BYTES_I = 4, 6
# fp32 LoRA weight + fp32 gradient + two fp32 AdamW moments, and the bf16 copy autocast caches
LORA_STATE_BYTES = 16
LORA_AUTOCAST_BYTES = 2


def nvfp4_bytes(out_f: int, in_f: int) -> int:
    """Packed codes (4 bits), FP8 block scales (one per 16) and the fp32 global scale."""
    return out_f * in_f // 2 + out_f * in_f // 16 + 4


def nf4_bytes(out_f: int, in_f: int) -> int:
    """NF4 with double quantization: 4-bit codes, an 8-bit code per block of 64 for its scale, an fp32
    scale per 256 of those, the two code books (16 and 256 fp32) and the state's JSON (~200 bytes)."""
    n = out_f * in_f
    blocks = -(-n // 64)
    return n // 2 + blocks + 4 * -(-blocks // 256) + 4 * (16 + 256) + 200


BASES = ("nvfp4", "nf4", "bf16")


def base_bytes(shape: ModelShape, base: str = "nvfp4") -> dict[str, int]:
    """The model's tensors: quantized linears (NVFP4, NF4 or bf16) and what stays bf16."""
    projections = shape.projections().values()
    if base == "nvfp4":
        linears = shape.layers * sum(nvfp4_bytes(o, i) for o, i in projections)
    elif base == "nf4":
        linears = shape.layers * sum(nf4_bytes(o, i) for o, i in projections)
    elif base == "bf16":
        linears = shape.layers * sum(o * i for o, i in projections) * BF16
    else:
        raise ValueError(f"base must be one of {BASES}, got {base!r}")
    embed = shape.vocab * shape.hidden * BF16
    head = 0 if shape.tie_embeddings else embed
    per_layer_small = 2 * shape.hidden + (shape.hidden + 2 * shape.kv_dim if shape.qkv_bias else 0)
    small = (shape.layers * per_layer_small + shape.hidden) * BF16
    return {"linears": linears, "embeddings": embed + head, "norms_biases": small}


def lora_params(shape: ModelShape, rank: int, targets: tuple[str, ...] | list[str]) -> int:
    """LoRA parameters: ``r * (in + out)`` per targeted projection per layer."""
    unknown = [t for t in targets if t not in PROJECTIONS]
    if unknown:
        raise ValueError(f"LoRA targets {unknown} are not decoder projections {PROJECTIONS}")
    proj = shape.projections()
    return shape.layers * sum(rank * (proj[t][0] + proj[t][1]) for t in targets)


def layer_saved_bytes_per_token(shape: ModelShape, rank: int, n_targets: int) -> int:
    """What one decoder layer saves for backward, per token (bf16 compute)."""
    h, i = shape.hidden, shape.intermediate
    return SAVED_BYTES_H * h + SAVED_BYTES_I * i + 4 * shape.kv_dim + 2 * rank * n_targets


def layer_grad_bytes_per_token(shape: ModelShape) -> int:
    """The gradients alive at once while one decoder layer is back-propagated, per token."""
    return GRAD_BYTES_H * shape.hidden + GRAD_BYTES_I * shape.intermediate


def _largest_projection(shape: ModelShape) -> int:
    return max(o * i for o, i in shape.projections().values())


def trainer_peak(
    shape: ModelShape,
    *,
    base: str,
    batch: int,
    seq_len: int,
    completion_len: int,
    rank: int,
    targets: tuple[str, ...] | list[str] = PROJECTIONS,
    checkpointing: bool = True,
    autocast: bool = True,
    device: str = "cuda",
) -> dict[str, int]:
    """Bytes the trainer holds at its peak, by component (what ``torch.cuda.max_memory_allocated``
    sees; the CUDA context is separate). ``batch`` sequences of ``seq_len`` tokens per minibatch.
    ``device`` picks the trainer's per-device slab sizes (the decoded weight, the logprob head)."""
    from qerl.pipeline.nvfp4.linear import slice_elements
    from qerl.pipeline.rl.logprobs import logprob_chunk_elements

    weights = sum(base_bytes(shape, base).values())
    n_lora = lora_params(shape, rank, targets)
    lora = n_lora * (LORA_STATE_BYTES + (LORA_AUTOCAST_BYTES if autocast else 0))
    tokens = batch * seq_len
    layer_saved = tokens * layer_saved_bytes_per_token(shape, rank, len(targets))
    layer_grads = tokens * layer_grad_bytes_per_token(shape)
    if checkpointing:
        saved = shape.layers * tokens * shape.hidden * BF16  # each layer's input
        working = layer_saved + layer_grads  # the layer being recomputed and back-propagated
    else:
        saved, working = shape.layers * layer_saved, layer_grads
    # the decoded weight (a whole layer on CUDA, a slice on the CPU) and the next one being decoded;
    # bitsandbytes decodes an NF4 weight whole, on every device
    dequant = {
        "nvfp4": 2 * min(_largest_projection(shape), slice_elements(device)) * BF16,
        "nf4": 2 * _largest_projection(shape) * BF16,
    }.get(base, 0)
    # logprob head: the saved completion states and their gradient, and one slab's logits in bf16
    # plus four float32 [slab, vocab] temporaries (upcast, log-softmax, one-hot gradient, its backward)
    slab = min(logprob_chunk_elements(device), batch * completion_len * shape.vocab)
    head = 2 * batch * completion_len * shape.hidden * BF16 + slab * (BF16 + 4 * 4)
    return {
        "weights": weights,
        "lora_adamw": lora,
        "checkpointed_inputs" if checkpointing else "layer_activations": saved,
        "peak_working_set": max(working + dequant, head),
    }


def kv_bytes_per_token(shape: ModelShape, tp: int) -> float:
    """K and V of every layer in bf16, on one GPU (KV heads split over tp, replicated past it)."""
    heads_here = max(1, shape.kv_heads // tp)
    return 2 * shape.layers * heads_here * shape.dim * BF16
