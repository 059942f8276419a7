"""The policy being trained: the (NVFP4) base with peft LoRA on top, AdamW and its schedule.

``init_state`` builds the policy at step 0: the base through its scheme's training loader
(``qerl.pipeline.schemes``: NVFP4's packed ``NVFP4Linear`` layers, or an NF4 base as QLoRA loads it,
bitsandbytes' ``Linear4bit`` under peft's own LoRA layer for it), or a plain HF base, LoRA initialised from ``cfg.seed`` (or, for a warm start, loaded from an adapter folder
whose rank, alpha and targets must match the config), AdamW and a warmup + cosine schedule.

Device settings (``optimizer_impl``, ``qerl.pipeline.rl.logprobs.logprob_chunk_elements`` and
``qerl.pipeline.nvfp4.linear.slice_elements`` choose by ``device.type``): the CPU keeps small logprob
slabs, 16 MiB weight slices and the for-loop AdamW, which bound resident memory (the slabs and slices
at a speed cost); CUDA takes large slabs, whole-layer decode and the fused AdamW kernel.

Departure: the warmup is ``(u+1)/warmup`` so the first update does not run at lr 0 (transformers'
convention wastes it).
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from qerl.pipeline.rl.train_config import TrainConfig
from qerl.pipeline.schemes import checkpoint_scheme, scheme_module
from safetensors.torch import load_file

__all__ = [
    "TrainState",
    "check_adapter_shape",
    "init_state",
    "is_nvfp4_checkpoint",
    "load_adapter_weights",
    "optimizer_impl",
    "trainable_parameters",
]


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
    return checkpoint_scheme(model_dir) == "nvfp4"


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
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, cfg.dtype)
    scheme = checkpoint_scheme(base_dir)
    if scheme == "none":
        model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype).to(device)
        model.requires_grad_(False)
        base_format = "hf"
    else:  # NVFP4Linear layers, or (QLoRA) bitsandbytes' Linear4bit, under peft's own LoRA layer for it
        loader = scheme_module(scheme, training=True)  # the train stage keys its code (training_module)
        model = loader.load_for_training(base_dir, dtype=dtype, device=device)
        base_format = scheme
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
    if base_format == "nvfp4":
        loader.register_with_peft(lora)
    with warnings.catch_warnings():
        # peft warns for every layer type it does not know; NVFP4Linear is registered above on purpose
        warnings.filterwarnings("ignore", message="Unsupported layer type", category=UserWarning)
        model = get_peft_model(model, lora)
    return model, base_format


def trainable_parameters(model: Any) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, parameter) of every parameter the optimizer updates (the LoRA weights), in model order."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def optimizer_impl(device: torch.device | str) -> dict[str, bool]:
    """AdamW's implementation switches for ``device`` (by ``device.type``).

    CUDA: ``fused=True``, one kernel for every parameter's update instead of several elementwise
    launches per LoRA tensor (hundreds of small tensors: 7 projections x 2 x layers), deterministic
    like the others. CPU: ``foreach=False``, the per-parameter loop, which allocates no multi-tensor
    temporaries; there is no launch overhead to save.
    """
    return {"fused": True} if torch.device(device).type == "cuda" else {"foreach": False}


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
    params = [p for _, p in trainable_parameters(model)]
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
    names = [n for n, _ in trainable_parameters(model)]
    if result.unexpected_keys or len(adapter) != len(names):
        raise ValueError(
            f"{adapter_dir} holds {len(adapter)} tensors for {len(names)} LoRA parameters "
            f"(unexpected: {result.unexpected_keys[:5]})"
        )
