"""One train arm of ``bench_gpu.py``, run in its own process: a GRPO update on random weights at a
model's real shape, NVFP4, NF4 or bf16 base, timed, with its peak memory.

The model is built on the device, never on the host: the skeleton on the meta device, then each
projection drawn there and either kept (bf16), quantized there and replaced by ``NVFP4Linear``
(nvfp4), one fused group at a time, or quantized there by bitsandbytes into the ``Linear4bit`` QLoRA
trains on (nf4: NF4, double quantization, blocks of 64, bf16 compute, as the NF4 base's trainer loads
it in ``qerl.pipeline.nf4.checkpoint.load_for_training``). The train state wraps it as
``qerl.pipeline.rl.policy.init_state`` wraps a checkpoint. ``deterministic`` runs the updates under the trainer's deterministic CUDA kernels
(``qerl.pipeline.runtime.determinism``, what ``train.deterministic`` switches on), so an arm with it
against one without is what that switch costs.
"""

from __future__ import annotations

import time
from typing import Any

FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _qwen2_config(shape: Any) -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        tie_word_embeddings=shape.tie_embeddings,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
    )


def build_model(shape: Any, base: str, device: str) -> Any:
    """A Qwen2 model of ``shape`` with random bf16 weights made on ``device``, never on the host.

    The skeleton is built on the meta device; each projection is drawn on the device and either kept
    (bf16) or quantized there and replaced by ``NVFP4Linear`` (nvfp4) or bitsandbytes' ``Linear4bit``
    (nf4), one layer at a time, so a 4-bit arm never holds a bf16 copy of more than one fused group.
    """
    import torch
    from accelerate import init_empty_weights
    from qerl.kernels import nvfp4_dispatch, nvfp4_reference
    from qerl.pipeline.nvfp4.linear import NVFP4Linear
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(_qwen2_config(shape), dtype=torch.bfloat16)
    gen = torch.Generator(device=device).manual_seed(0)

    def draw(*size: int) -> torch.Tensor:
        return (torch.randn(*size, generator=gen, device=device, dtype=torch.bfloat16)).mul_(0.02)

    for layer in model.model.layers:
        for group in FUSED + (("o_proj",), ("down_proj",)):
            parent = (
                layer.self_attn if group[0].endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else layer.mlp
            )
            linears = {name: getattr(parent, name) for name in group}
            weights = {n: draw(m.out_features, m.in_features) for n, m in linears.items()}
            gs = None
            if base == "nvfp4" and len(group) > 1:  # one global scale per fused group, as vLLM needs
                gs = nvfp4_reference.global_scale(
                    max(nvfp4_reference.tensor_amax(w, n) for n, w in weights.items())
                )
            for name, module in linears.items():
                bias = draw(module.out_features) if module.bias is not None else None
                if base == "nvfp4":
                    packed, scale, g = nvfp4_dispatch.quantize(weights.pop(name), gs, name=name)
                    setattr(parent, name, NVFP4Linear.from_tensors(packed, scale, g, bias, name=name))
                elif base == "nf4":
                    setattr(parent, name, nf4_linear(weights.pop(name), bias, device))
                else:
                    module.weight = torch.nn.Parameter(weights.pop(name), requires_grad=False)
                    if bias is not None:
                        module.bias = torch.nn.Parameter(bias, requires_grad=False)
    for module in model.modules():  # embeddings, norms, lm_head: still on meta
        is_norm = "Norm" in type(module).__name__
        for pname, param in list(module.named_parameters(recurse=False)):
            if param.is_meta:
                value = (
                    torch.ones(param.shape, device=device, dtype=torch.bfloat16)
                    if is_norm
                    else draw(*param.shape)
                )
                setattr(module, pname, torch.nn.Parameter(value, requires_grad=False))
    if shape.tie_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.to(device)  # buffers (RoPE frequencies) were built on the host
    model.requires_grad_(False)
    return model


def nf4_linear(weight: Any, bias: Any, device: str) -> Any:
    """``weight`` (bf16, on ``device``) quantized there into bitsandbytes' ``Linear4bit``, set up as the
    NF4 trainer sets up each layer it loads (bf16 compute; the CPU inference repacking off, so the dry
    run trains on the path a real CPU run takes)."""
    import bitsandbytes as bnb
    import torch
    from qerl.pipeline.nf4.checkpoint import NF4_BLOCKSIZE

    out_f, in_f = weight.shape
    layer = bnb.nn.Linear4bit(
        in_f, out_f, bias=bias is not None, compute_dtype=torch.bfloat16, quant_type="nf4", device="meta"
    )
    layer.weight = bnb.nn.Params4bit(
        weight, compress_statistics=True, quant_type="nf4", blocksize=NF4_BLOCKSIZE, module=layer
    ).to(device)
    if bias is not None:
        layer.bias = torch.nn.Parameter(bias, requires_grad=False)
    layer.support_avx512bf16_for_cpu = False
    return layer


def lora_state(model: Any, cfg: Any, device: str) -> Any:
    """The train state around an in-memory base, as ``qerl.pipeline.rl.policy.init_state`` builds it from a
    checkpoint (gradient checkpointing, peft LoRA with NVFP4Linear registered, AdamW, schedule)."""
    import warnings

    import torch
    from peft import LoraConfig, get_peft_model
    from qerl.pipeline.nvfp4.linear import register_with_peft
    from qerl.pipeline.rl.policy import TrainState, _lr_lambda, optimizer_impl

    torch.manual_seed(cfg.seed)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = LoraConfig(
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha,
        target_modules=list(cfg.target_modules),
        task_type="CAUSAL_LM",
    )
    register_with_peft(lora)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Unsupported layer type", category=UserWarning)
        model = get_peft_model(model, lora)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        params, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps, **optimizer_impl(device)
    )
    return TrainState(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(cfg)))


def make_batch(state: Any, vocab: int, b: dict) -> Any:
    """2 prompts x 4 samples of random ids, alternating rewards, sampler logprobs from the policy."""
    import torch
    from qerl.pipeline.rl.batch import RolloutBatch, collate
    from qerl.pipeline.rl.logprobs import completion_logprobs

    gen = torch.Generator().manual_seed(1)
    n = b["prompts"] * b["group"]
    prompts = [torch.randint(0, vocab, (b["prompt"],), generator=gen).tolist() for _ in range(b["prompts"])]
    batch = RolloutBatch(
        prompt_ids=[prompts[i // b["group"]] for i in range(n)],
        completion_ids=[
            torch.randint(0, vocab, (b["completion"],), generator=gen).tolist() for _ in range(n)
        ],
        sampler_logprobs=[[0.0] * b["completion"] for _ in range(n)],
        truncated=[False] * n,
        rewards=[float(i % 2) for i in range(n)],
        group_ids=[i // b["group"] for i in range(n)],
    )
    with torch.no_grad():  # the ratio starts near 1, as after a real rollout
        lp, _ = completion_logprobs(state.model, collate(batch, list(range(n)), torch.ones(n), 0), 1.0)
    batch.sampler_logprobs = lp.float().cpu().tolist()
    return batch


def _rss_bytes(field: str) -> int:
    with open("/proc/self/status") as fh:
        return int(next(r for r in fh if r.startswith(field)).split()[1]) * 1024


def _preload(device: str) -> None:
    """Import what an arm runs on and compile the dequantizer once, so neither counts as the arm's
    memory (the CPU baseline is taken after this; on CUDA only tensors are counted anyway)."""
    import importlib

    import peft  # noqa: F401
    import torch
    import transformers  # noqa: F401
    from qerl.kernels.nvfp4_dispatch import dequantize, quantize
    from qerl.pipeline.nf4 import checkpoint  # noqa: F401  (quiets bitsandbytes' CPU backend at import)

    importlib.import_module("bitsandbytes")  # after that module, which sets its logging
    dequantize(*quantize(torch.ones(16, 16, device=device)), dtype=torch.bfloat16)


def train_arm(shape: Any, base: str, device: str, b: dict, steps: int, deterministic: bool = False) -> dict:
    """Build, warm up, time ``steps`` updates; peak memory over the timed updates. OOM is a result.
    ``deterministic``: the updates run under the trainer's deterministic kernels."""
    import torch
    from qerl.pipeline.rl.step import train_step
    from qerl.pipeline.rl.train_config import TrainConfig
    from qerl.pipeline.runtime.determinism import deterministic_kernels, prepare_process

    prepare_process()  # as the CLI does at start-up, for either switch: cuBLAS reads it once
    cuda = device == "cuda"
    out: dict[str, Any] = {"phase": "build"}
    _preload(device)
    baseline = 0 if cuda else _rss_bytes("VmRSS:")
    try:
        model = build_model(shape, base, device)
        out["layers"] = sorted({type(m).__name__ for m in model.modules() if hasattr(m, "in_features")})
        out["weights_bytes"] = torch.cuda.memory_allocated() if cuda else _rss_bytes("VmRSS:") - baseline
        cfg = TrainConfig(
            lora_r=b["rank"], lora_alpha=2 * b["rank"], gradient_checkpointing=True, dtype="bfloat16"
        )
        state = lora_state(model, cfg, device)
        out["phase"] = "sampler logprobs"
        batch = make_batch(state, shape.vocab, b)
        out["phase"] = "warm-up update"
        with deterministic_kernels(device, deterministic) as in_force:
            out["kernels"] = in_force
            train_step(state, batch, cfg)
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            out["phase"], times = "timed updates", []
            for _ in range(steps):
                t0 = time.perf_counter()
                metrics = train_step(state, batch, cfg)
                if cuda:
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
        out.update(phase="done", times=times, loss=metrics["loss"])
        out["peak_bytes"] = torch.cuda.max_memory_allocated() if cuda else _rss_bytes("VmHWM:") - baseline
    except torch.OutOfMemoryError as err:
        out.update(oom=True, error=str(err).splitlines()[0][:300])
        if cuda:
            out["peak_bytes_at_oom"] = torch.cuda.max_memory_allocated()
    return out
