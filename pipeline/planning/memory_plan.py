"""The GPU memory budget of a colocated QeRL run (``qerl plan``): arithmetic, nothing is allocated.

What: given a model's shape (its config.json, a hub id or a known shape's name), one GPU's memory and
the run config, ``plan_memory`` adds up what one GPU holds while the trainer runs beside the live
vLLM engine (the flow keeps the engine across RL steps, so both live in one process):

- vLLM's share, ``rollout.gpu_memory_utilization`` x the GPU: the NVFP4 weights (sharded by
  ``rollout.tensor_parallel_size``), one LoRA slot at ``rollout.max_lora_rank``, the activation peak of
  its profiling run, CUDA graphs, and the KV cache, which gets the rest;
- the trainer's peak (``qerl.pipeline.planning.memory.trainer_peak``: weights, LoRA with AdamW, the
  activations of one minibatch);
- the CUDA context.

It then says whether that fits and, if not, what to change (``Plan.advice``): the
``gpu_memory_utilization`` window that fits both sides, else the trainer's knobs.

Departures and why: vLLM's activation peak and CUDA-graph pool are estimates from its profiling
rule (``max_num_batched_tokens`` tokens through the model, ``max_num_seqs`` rows of sampler logits),
labelled as estimates in the table. ``benchmarks/bench_vllm.py`` sets ``vllm_share`` beside what vLLM
logs at start-up for the same model and config (BENCHMARKS.md), which is how they are checked. The
KV need assumes every sequence of a step is resident at once at ``max_model_len``, an upper bound
(vLLM preempts and recomputes when it runs short).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from qerl.pipeline.planning.memory import BF16, GiB, base_bytes, kv_bytes_per_token, lora_params, trainer_peak
from qerl.pipeline.planning.model_shape import PROJECTIONS, ModelShape, resolve_model

__all__ = ["Plan", "parse_memory", "plan_for_run", "plan_memory", "vllm_share"]

CUDA_CONTEXT_GIB = 0.75  # CUDA context, cuBLAS and Triton workspaces of one process (estimate)
VLLM_GRAPHS_GIB = 1.0  # vLLM's CUDA-graph pool with the default capture sizes (estimate)
VLLM_DEFAULT_BATCHED_TOKENS = 16384  # vLLM 0.32's LLM-class default on a >= 70 GiB GPU (H100, H200)
SAMPLER_FLOAT32_COPIES = 3  # logits, their softmax and logprobs in vLLM's dummy sampler run


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


def this_gpu_memory() -> tuple[str, float]:
    """(name, bytes) of this machine's first CUDA device: ``qerl plan``'s GPU when ``--gpu-mem`` is not
    given. The plan is then for the machine the run will start on."""
    from qerl.pipeline.runtime.device import cuda_available

    if not cuda_available():
        raise ValueError(
            "no CUDA device here to plan for: give one GPU's memory with --gpu-mem (e.g. 80 for an H100)"
        )
    import torch

    props = torch.cuda.get_device_properties(0)
    return props.name, float(props.total_memory)


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
    gpu_name: str = ""  # the GPU planned for, when it is this machine's

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
        if self.gpu_name:
            head += f"; this machine's {self.gpu_name}"
        out = [head, self.table()]
        out += [f"- {a}" for a in self.advice]
        return "\n".join(out) + "\n"


_WEIGHT_NOTE = {
    "nvfp4": "linears 4.5 bits, embeddings bf16",
    "nf4": "linears 4.13 bits (QLoRA's NF4), embeddings bf16",
    "bf16": "all bf16 (the comparison)",
}


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
        (sec, "CUDA graphs", graphs, "estimate" if graphs else "none (rollout.enforce_eager)"),
        (sec, "KV cache (the rest)", max(kv, 0.0), ""),
    ]
    return rows, reserved, kv


VLLM_ROWS = ("weights", "lora_slot", "activations", "cuda_graphs", "kv_cache")


def vllm_share(shape: ModelShape, rollout: Any, gpu_bytes: float, base: str = "nvfp4") -> dict[str, float]:
    """The plan's rows for the vLLM engine, by name (bytes): what the GPU kit sets beside what vLLM
    reports for the same model and config (benchmarks/bench_vllm.py)."""
    rows, _, _ = _vllm_rows(shape, rollout, gpu_bytes, base)
    return dict(zip(VLLM_ROWS, (row[2] for row in rows), strict=True))


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
    kv_per_token = kv_bytes_per_token(shape, rollout.tensor_parallel_size)
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
    gpu_memory: str | None,
    config: str | None = None,
    overrides: list[str] | None = None,
    prompt_tokens: int | None = None,
    base: str = "nvfp4",
) -> Plan:
    """``qerl plan``: load the run config (YAML or preset, then ``--set``), resolve the model (default:
    the config's ``model.source``; the demo's shape comes from ``model.demo``), take the GPU's memory
    (``gpu_memory``, else this machine's first GPU), check tensor parallelism against its heads and
    the rollout dtype against FP4 Marlin, and plan one GPU."""
    from qerl.pipeline.planning.disk_plan import demo_shape
    from qerl.pipeline.planning.run_checks import check_parallelism, check_serving
    from qerl.pipeline.planning.run_config import load_run_config
    from qerl.pipeline.rollout.factory import MARLIN_MODE

    run = load_run_config(config, overrides or [])
    spec = model or run.model.source
    shape = demo_shape(run) if spec == "demo" else resolve_model(spec)[0]
    heads = {"num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads}
    # the plan is for a CUDA machine
    check_parallelism(run.rollout, heads, cuda=True)
    if base == "nvfp4" and run.quantize.scheme != "none" and run.rollout.engine == "vllm":
        check_serving(run, MARLIN_MODE)
    name, gpu_bytes = this_gpu_memory() if gpu_memory is None else ("", parse_memory(gpu_memory))
    plan = plan_memory(shape, gpu_bytes, run, prompt_tokens=prompt_tokens, base=base)
    plan.gpu_name = name
    return plan
