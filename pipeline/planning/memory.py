"""The GPU memory budget of a colocated QeRL run (``qerl plan``): arithmetic, nothing is allocated.

What: given a model's shape (its config.json, a hub id or a known shape's name), one GPU's memory and
the run config, ``plan_memory`` adds up what one GPU holds while the trainer runs beside the live
vLLM engine (the flow keeps the engine across RL steps, so both live in one process):

- vLLM's share, ``rollout.gpu_memory_utilization`` x the GPU: the NVFP4 weights (sharded by
  ``rollout.tensor_parallel_size``), one LoRA slot at ``rollout.max_lora_rank``, the activation peak of
  its profiling run, CUDA graphs, and the KV cache, which gets the rest;
- the trainer: the packed NVFP4 base with its bf16 embeddings, the LoRA weights with their gradients
  and AdamW moments (fp32, 16 bytes per parameter) plus their bf16 autocast copies, and the
  activations of one minibatch: with gradient checkpointing the layer inputs of every layer plus
  one layer recomputed for backward, without it every layer's saved tensors;
- the CUDA context.

It then says whether that fits and, if not, what to change (``Plan.advice``).

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

Departures and why: vLLM's side cannot be measured on the project's GPU machines (no vLLM wheel
fits there), so its activation peak and CUDA-graph pool are estimates from its profiling rule
(``max_num_batched_tokens`` tokens through the model, ``max_num_seqs`` rows of sampler logits), and
are labelled as estimates in the table. The trainer's figures are checked against measured peaks:
the CPU train benchmark (tests/test_plan.py) and the GPU benchmark's ``torch.cuda.max_memory_allocated``
where benchmarks/results/gpu.json exists. The KV need assumes every sequence of a step is resident
at once at ``max_model_len``, an upper bound (vLLM preempts and recomputes when it runs short).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "KNOWN_SHAPES",
    "ModelShape",
    "Plan",
    "parse_memory",
    "plan_memory",
    "resolve_model",
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
CUDA_CONTEXT_GIB = 0.75  # CUDA context, cuBLAS and Triton workspaces of one process (estimate)
VLLM_GRAPHS_GIB = 1.0  # vLLM's CUDA-graph pool with the default capture sizes (estimate)
VLLM_DEFAULT_BATCHED_TOKENS = 16384  # vLLM 0.32's LLM-class default on a >= 70 GiB GPU (H100, H200)
SAMPLER_FLOAT32_COPIES = 3  # logits, their softmax and logprobs in vLLM's dummy sampler run

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelShape:
    """What the memory plan needs from a decoder-only model's config.json."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tie_embeddings: bool = False
    head_dim: int = 0  # 0: hidden // heads
    qkv_bias: bool = True  # Qwen2 has q/k/v biases, Llama and Qwen3 do not

    @property
    def dim(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.dim

    def projections(self) -> dict[str, tuple[int, int]]:
        """(out, in) of each of a layer's seven projections."""
        q, kv, h, i = self.heads * self.dim, self.kv_dim, self.hidden, self.intermediate
        return {
            "q_proj": (q, h),
            "k_proj": (kv, h),
            "v_proj": (kv, h),
            "o_proj": (h, q),
            "gate_proj": (i, h),
            "up_proj": (i, h),
            "down_proj": (h, i),
        }

    @classmethod
    def from_config(cls, config: dict[str, Any], name: str = "model") -> ModelShape:
        cfg = config.get("text_config", config)  # multimodal wrappers keep the LM under text_config
        need = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
        missing = [k for k in need if not isinstance(cfg.get(k), int)]
        if missing:
            raise ValueError(f"{name}: config.json lacks {', '.join(missing)}: not a decoder-only LM config")
        arch = " ".join(cfg.get("architectures") or [cfg.get("model_type", "")])
        return cls(
            name=name,
            hidden=cfg["hidden_size"],
            layers=cfg["num_hidden_layers"],
            heads=cfg["num_attention_heads"],
            kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
            intermediate=cfg["intermediate_size"],
            vocab=cfg["vocab_size"],
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            head_dim=cfg.get("head_dim") or 0,
            qkv_bias=bool(cfg.get("attention_bias", "Qwen2" in arch)),
        )


def _qwen25(name: str, hidden: int, layers: int, heads: int, kv: int, inter: int, vocab: int, tie: bool):  # noqa: ANN202
    return ModelShape(name, hidden, layers, heads, kv, inter, vocab, tie)


# The Qwen2.5 family as its config.json files give it (the paper's models are 7B, 14B and 32B).
KNOWN_SHAPES: dict[str, ModelShape] = {
    s.name: s
    for s in (
        _qwen25("qwen2.5-0.5b", 896, 24, 14, 2, 4864, 151936, True),
        _qwen25("qwen2.5-1.5b", 1536, 28, 12, 2, 8960, 151936, True),
        _qwen25("qwen2.5-3b", 2048, 36, 16, 2, 11008, 151936, True),
        _qwen25("qwen2.5-7b", 3584, 28, 28, 4, 18944, 152064, False),
        _qwen25("qwen2.5-14b", 5120, 48, 40, 8, 13824, 152064, False),
        _qwen25("qwen2.5-32b", 5120, 64, 40, 8, 27648, 152064, False),
        _qwen25("qwen2.5-72b", 8192, 80, 64, 8, 29568, 152064, False),
    )
}


def _shape_key(spec: str) -> str:
    """``Qwen/Qwen2.5-7B-Instruct`` -> ``qwen2.5-7b`` (the instruct and base models share a shape)."""
    key = spec.lower().rsplit("/", 1)[-1]
    return re.sub(r"-(instruct|base|chat)$", "", key)


def resolve_model(spec: str) -> tuple[ModelShape, str]:
    """(shape, where it came from) for a config.json path, a model directory, a known shape's name or
    a hub id (whose config.json is fetched from the hub; the known shapes are tried first, offline)."""
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return ModelShape.from_config(json.loads(path.read_text()), path.parent.name), str(path)
    key = _shape_key(spec)
    if key in KNOWN_SHAPES:
        return KNOWN_SHAPES[key], f"known shape ({key})"
    if spec.count("/") != 1 or spec.startswith((".", "/")):
        raise ValueError(
            f"model '{spec}' is not a config.json, a model directory, a hub id or one of the known shapes "
            f"{', '.join(KNOWN_SHAPES)}"
        )
    try:
        from huggingface_hub import hf_hub_download

        local = hf_hub_download(spec, "config.json")
    except Exception as err:  # noqa: BLE001 - offline, unknown repo, gated: all mean "cannot read it"
        raise ValueError(f"cannot fetch config.json of hub model '{spec}': {err}") from err
    return ModelShape.from_config(json.loads(Path(local).read_text()), spec), f"hub ({spec})"


def parse_memory(text: str | float) -> float:
    """GPU memory in bytes from ``80`` (GiB), ``80GiB``, ``80GB`` (10^9) or ``81559MiB``."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(gib|gb|mib|mb|g)?\s*", str(text).lower())
    if not match:
        raise ValueError(f"GPU memory '{text}': expected a number of GiB, e.g. 80, 80GiB, 80GB or 81559MiB")
    value, unit = float(match.group(1)), match.group(2) or "gib"
    scale = {"gib": GiB, "g": GiB, "gb": 1e9, "mib": 1 << 20, "mb": 1e6}[unit]
    if value <= 0:
        raise ValueError(f"GPU memory '{text}' must be positive")
    return value * scale


# -- sizes -------------------------------------------------------------------------------------------


def nvfp4_bytes(out_f: int, in_f: int) -> int:
    """Packed codes (4 bits), FP8 block scales (one per 16) and the fp32 global scale."""
    return out_f * in_f // 2 + out_f * in_f // 16 + 4


def base_bytes(shape: ModelShape, base: str = "nvfp4") -> dict[str, int]:
    """The model's tensors: quantized linears (NVFP4 or bf16) and what stays bf16."""
    projections = shape.projections().values()
    if base == "nvfp4":
        linears = shape.layers * sum(nvfp4_bytes(o, i) for o, i in projections)
    elif base == "bf16":
        linears = shape.layers * sum(o * i for o, i in projections) * BF16
    else:
        raise ValueError(f"base must be 'nvfp4' or 'bf16', got {base!r}")
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
    # the decoded weight (a whole layer on CUDA, a slice on the CPU) and the next one being decoded
    dequant = 2 * min(_largest_projection(shape), slice_elements(device)) * BF16 if base == "nvfp4" else 0
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


# -- the plan ----------------------------------------------------------------------------------------


@dataclass
class Plan:
    """Rows of (section, component, bytes, note), the verdict and the advice."""

    shape: ModelShape
    gpu_bytes: float
    rows: list[tuple[str, str, float, str]] = field(default_factory=list)
    total: float = 0.0
    fits: bool = False
    kv_tokens: int = 0
    kv_needed_tokens: int = 0
    advice: list[str] = field(default_factory=list)

    def table(self) -> str:
        width = max(len(c) for _, c, _, _ in self.rows) + 2
        lines, section = [], None
        for sec, comp, size, note in self.rows:
            if sec != section:
                lines.append(sec)
                section = sec
            lines.append(f"  {comp:<{width}}{size / GiB:>8.2f}  {note}")
        verdict = "fits"
        if self.total > self.gpu_bytes:
            verdict = "DOES NOT FIT"
        elif not self.fits:
            verdict = "DOES NOT FIT (vLLM's share has no room for one sequence's KV cache)"
        lines.append(
            f"{'total':<{width + 2}}{self.total / GiB:>8.2f}  of {self.gpu_bytes / GiB:.2f} GiB: {verdict} "
            f"(headroom {(self.gpu_bytes - self.total) / GiB:+.2f} GiB)"
        )
        return "\n".join(lines)

    def render(self) -> str:
        s = self.shape
        head = (
            f"QeRL memory plan (GiB): {s.name}, hidden {s.hidden}, {s.layers} layers, {s.heads}/{s.kv_heads} "
            f"heads, intermediate {s.intermediate}, vocab {s.vocab}"
        )
        out = [head, self.table()]
        out += [f"- {a}" for a in self.advice]
        return "\n".join(out) + "\n"


def _kv_bytes_per_token(shape: ModelShape, tp: int) -> float:
    """K and V of every layer in bf16, on one GPU (KV heads split over tp, replicated past it)."""
    heads_here = max(1, shape.kv_heads // tp)
    return 2 * shape.layers * heads_here * shape.dim * BF16


_WEIGHT_NOTE = {"nvfp4": "linears 4.5 bits, embeddings bf16", "bf16": "all bf16 (the comparison)"}


def _vllm_rows(shape: ModelShape, rollout: Any, gpu: float, base: str) -> tuple[list, float, float]:
    """(rows, vLLM's reservation, KV bytes) for the engine's share of one GPU."""
    tp = rollout.tensor_parallel_size
    weights = sum(base_bytes(shape, base).values()) / tp
    lora_slot = lora_params(shape, rollout.max_lora_rank, PROJECTIONS) * BF16 / tp
    tokens = rollout.max_num_batched_tokens or VLLM_DEFAULT_BATCHED_TOKENS
    act = tokens * (4 * shape.intermediate + 6 * shape.hidden) * BF16 / tp
    act += rollout.max_num_seqs * shape.vocab * 4 * SAMPLER_FLOAT32_COPIES
    graphs = 0.0 if rollout.enforce_eager else VLLM_GRAPHS_GIB * GiB
    reserved = rollout.gpu_memory_utilization * gpu
    kv = reserved - weights - lora_slot - act - graphs
    sec = f"vLLM engine (rollout.gpu_memory_utilization {rollout.gpu_memory_utilization} x GPU)"
    rows = [
        (sec, f"{base} weights{f' / tp {tp}' if tp > 1 else ''}", weights, _WEIGHT_NOTE[base]),
        (sec, f"LoRA slot (rank {rollout.max_lora_rank}, bf16)", lora_slot, ""),
        (sec, f"activations ({tokens} tokens) + sampler", act, "estimate (vLLM's profiling run)"),
        (sec, "CUDA graphs", graphs, "estimate" if graphs else "enforce_eager: none"),
        (sec, "KV cache (the rest)", max(kv, 0.0), ""),
    ]
    return rows, reserved, kv


def plan_memory(
    shape: ModelShape,
    gpu_bytes: float,
    run: Any,
    prompt_tokens: int | None = None,
    base: str = "nvfp4",
) -> Plan:
    """The budget of ``run`` (a ``RunConfig``) for ``shape`` on one GPU of ``gpu_bytes``.

    ``prompt_tokens`` is the longest prompt; None assumes the worst, ``max_model_len - max_new_tokens``.
    """
    rollout, train = run.rollout, run.train
    completion = rollout.max_new_tokens
    prompt = rollout.max_model_len - completion if prompt_tokens is None else prompt_tokens
    if prompt < 1 or prompt + completion > rollout.max_model_len:
        raise ValueError(
            f"prompt_tokens {prompt} + max_new_tokens {completion} must be within max_model_len "
            f"{rollout.max_model_len}"
        )
    plan = Plan(shape, gpu_bytes)
    concurrent = min(rollout.max_num_seqs, run.loop.prompts_per_step * rollout.n_samples)
    vllm_rows, reserved, kv = _vllm_rows(shape, rollout, gpu_bytes, base)
    plan.rows += vllm_rows
    kv_per_token = _kv_bytes_per_token(shape, rollout.tensor_parallel_size)
    plan.kv_tokens = int(max(kv, 0.0) // kv_per_token)
    plan.kv_needed_tokens = concurrent * rollout.max_model_len
    peak = trainer_peak(
        shape,
        base=base,
        batch=train.minibatch_size,
        seq_len=prompt + completion,
        completion_len=completion,
        rank=train.lora_r,
        targets=train.target_modules,
        checkpointing=train.gradient_checkpointing,
        autocast=train.lora_autocast and train.dtype != "float32",
    )
    sec = f"trainer (minibatch {train.minibatch_size} x {prompt + completion} tokens, LoRA r{train.lora_r})"
    notes = {
        "weights": f"{base} base + bf16 embeddings",
        "lora_adamw": f"{lora_params(shape, train.lora_r, train.target_modules) / 1e6:.1f}M params, fp32 + AdamW",
        "checkpointed_inputs": f"{shape.layers} layers' inputs (gradient checkpointing)",
        "layer_activations": f"every layer's activations ({shape.layers} layers, no checkpointing)",
        "peak_working_set": "one layer's recompute + backward, or the logprob head",
    }
    plan.rows += [(sec, name.replace("_", " "), size, notes[name]) for name, size in peak.items()]
    plan.rows.append(("process", "CUDA context", CUDA_CONTEXT_GIB * GiB, "estimate"))
    trainer = sum(peak.values())
    plan.total = reserved + trainer + CUDA_CONTEXT_GIB * GiB
    plan.fits = plan.total <= gpu_bytes and plan.kv_tokens >= rollout.max_model_len
    plan.advice = _advice(plan, run, reserved, kv, kv_per_token, trainer)
    if "float32" in (train.dtype, rollout.dtype):
        plan.advice.append(
            "float32 compute (train.dtype / rollout.dtype): this plan counts activations and the KV cache in "
            "bf16, so expect up to twice those rows"
        )
    return plan


def _floor2(x: float) -> float:
    return math.floor(x * 100) / 100


def _ceil2(x: float) -> float:
    return math.ceil(x * 100) / 100


def _advice(
    plan: Plan, run: Any, reserved: float, kv: float, kv_per_token: float, trainer: float
) -> list[str]:
    """What to change: the gpu_memory_utilization window that fits both sides, else the trainer's knobs."""
    rollout, train, gpu = run.rollout, run.train, plan.gpu_bytes
    engine_fixed = reserved - kv  # weights, LoRA slot, activations, graphs
    one_seq = rollout.max_model_len * kv_per_token
    u_min = _ceil2((engine_fixed + one_seq) / gpu)
    u_full = _ceil2((engine_fixed + plan.kv_needed_tokens * kv_per_token) / gpu)
    u_max = _floor2((gpu - trainer - CUDA_CONTEXT_GIB * GiB) / gpu)
    u = rollout.gpu_memory_utilization
    out = []
    if plan.fits:
        out.append(f"fits with {(gpu - plan.total) / GiB:.2f} GiB to spare")
        if plan.kv_tokens < plan.kv_needed_tokens:
            seqs = plan.kv_tokens // rollout.max_model_len
            out.append(
                f"the KV cache holds {seqs} sequences of {rollout.max_model_len} tokens at once, fewer than "
                f"the step's {plan.kv_needed_tokens // rollout.max_model_len}: vLLM queues the rest (slower)"
                + (
                    f"; rollout.gpu_memory_utilization {u_full} would hold them all"
                    if u_full <= u_max
                    else ""
                )
            )
        return out
    if u_min <= u_max:
        best = min(max(u_full, u_min), u_max)
        out.append(
            f"set rollout.gpu_memory_utilization between {u_min} and {u_max} (now {u}): {u_min} leaves vLLM "
            f"one sequence of KV cache, {u_full} the whole step's; {best} is the most this GPU allows"
            if best < u_full
            else f"set rollout.gpu_memory_utilization to {best} (now {u}): it holds the whole step's KV "
            "cache and leaves the trainer its peak"
        )
        return out
    out.append(
        f"no rollout.gpu_memory_utilization works: vLLM needs at least {u_min} of the GPU and the trainer "
        f"({trainer / GiB:.2f} GiB at its peak) leaves at most {max(u_max, 0.0)}"
    )
    if not train.gradient_checkpointing:
        out.append(
            "turn on train.gradient_checkpointing: it keeps one layer's activations, not every layer's"
        )
    if train.minibatch_size > 1:
        out.append("lower train.minibatch_size (raise train.grad_accum to keep the update the same)")
    out.append("or lower rollout.max_model_len, or use a GPU with more memory")
    return out


def plan_for_run(
    model: str | None,
    gpu_memory: str,
    config: str | None = None,
    overrides: list[str] | None = None,
    prompt_tokens: int | None = None,
    base: str = "nvfp4",
) -> Plan:
    """``qerl plan``: load the run config (YAML or preset, then ``--set``), resolve the model (default:
    the config's ``model.source``), check tensor parallelism against its heads, and plan one GPU."""
    from qerl.pipeline.planning.run_config import check_parallelism, load_run_config

    run = load_run_config(config, overrides or [])
    spec = model or run.model.source
    if spec == "demo":
        raise ValueError(
            "the demo's model is built at run time: name a model (config.json, hub id or known shape)"
        )
    shape, _ = resolve_model(spec)
    heads = {"num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads}
    check_parallelism(run.rollout, heads, cuda=True)  # the plan is for a CUDA machine
    return plan_memory(shape, parse_memory(gpu_memory), run, prompt_tokens=prompt_tokens, base=base)
