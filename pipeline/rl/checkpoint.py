"""The train checkpoint: everything needed to continue a run bit for bit, as safetensors + JSON.

``save_checkpoint`` writes ``adapter/`` (a plain peft adapter), ``optimizer.safetensors`` (AdamW
moments and step counts) and ``trainer_state.json`` (RL step, optimizer updates, param groups,
scheduler and torch RNG state) atomically; never pickle. ``load_checkpoint`` rebuilds the policy on
the base and restores all of it; the optimizer's implementation switches are those of the loading
device, not the saving one. Python's and NumPy's RNGs are not saved: nothing in training draws from
them.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
from qerl.pipeline.rl.policy import TrainState, init_state, optimizer_impl, trainable_parameters
from qerl.pipeline.rl.train_config import TrainConfig
from qerl.pipeline.runtime.device import cuda_available
from qerl.pipeline.store.files import atomic_write_json
from qerl.pipeline.store.layout import OPTIMIZER_FILE
from safetensors.torch import load_file, save_file

__all__ = ["load_checkpoint", "save_adapter", "save_checkpoint"]

ADAPTER_CONFIG = "adapter_config.json"


def save_adapter(model: Any, out_dir: str | Path) -> Path:
    """``model.save_pretrained(out_dir)``, then ``adapter_config.json`` rewritten in a canonical form:
    peft keeps ``target_modules`` as a set and writes it in the process's string-hash order, so the
    same adapter would get another digest in another process (a rebuild would look like new weights)."""
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    path = out_dir / ADAPTER_CONFIG
    config = json.loads(path.read_text())
    for key, value in config.items():
        if isinstance(value, list) and all(isinstance(v, str) for v in value) and key.endswith("modules"):
            config[key] = sorted(value)
    atomic_write_json(path, config)
    return out_dir


def save_checkpoint(state: TrainState, out_dir: str | Path) -> Path:
    """Write ``adapter/``, ``optimizer.safetensors`` and ``trainer_state.json`` atomically into ``out_dir``."""
    from peft import get_peft_model_state_dict

    out_dir = Path(out_dir)
    tmp = out_dir.with_name(f".{out_dir.name}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.mkdir(parents=True)
    try:
        save_adapter(state.model, tmp / "adapter")
        names = [n for n, _ in trainable_parameters(state.model)]
        opt = state.optimizer.state_dict()
        tensors = {}
        for idx, per_param in opt["state"].items():
            for key, value in per_param.items():
                tensors[f"state.{idx}.{key}"] = value.detach().cpu().contiguous()
        save_file(tensors, str(tmp / OPTIMIZER_FILE))
        rng = {"torch_cpu": torch.get_rng_state().tolist()}
        if cuda_available():
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


def _with_impl(groups: list[dict[str, Any]], device: torch.device | str) -> list[dict[str, Any]]:
    """Param groups with this device's implementation switches (a checkpoint may come from another)."""
    impl = optimizer_impl(device)
    return [{**g, "fused": impl.get("fused"), "foreach": impl.get("foreach")} for g in groups]


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
    names = [n for n, _ in trainable_parameters(state.model)]
    if names != meta["param_names"]:
        raise ValueError(f"{ckpt_dir}: optimizer was saved for different parameters than the model now has")
    tensors = load_file(str(ckpt_dir / OPTIMIZER_FILE), device=device)
    opt_state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        _, idx, name = key.split(".", 2)
        opt_state.setdefault(int(idx), {})[name] = value
    groups = _with_impl(meta["param_groups"], device)
    state.optimizer.load_state_dict({"state": opt_state, "param_groups": groups})
    state.scheduler.load_state_dict({**meta["scheduler"], "lr_lambdas": [None]})
    torch.set_rng_state(torch.tensor(meta["rng"]["torch_cpu"], dtype=torch.uint8))
    if "torch_cuda" in meta["rng"] and cuda_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in meta["rng"]["torch_cuda"]])
    state.step, state.updates = int(meta["step"]), int(meta["updates"])
    return state
