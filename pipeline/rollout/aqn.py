"""Adaptive Quantization Noise (AQN): the sigma schedule and the noise put into RMSNorm weights.

What. QeRL adds noise to the rollout model so that exploration does not depend only on the (static)
quantization error. Per rollout step, for every decoder layer, the engine's ``input_layernorm`` and
``post_attention_layernorm`` weights become ``w_clean + z`` with ``z ~ N(0, sigma^2)`` per hidden
channel. Because RMSNorm's output feeds q/k/v (input norm) and gate/up (post-attention norm), this is
row-wise multiplicative noise on those projections at zero extra cost.

How.
- ``sigma_schedule``: K stages of equal length across the run; stage 0 is noise-free, stages
  1..K-1 decay exponentially ``sigma_start * (sigma_end/sigma_start) ** ((j-1)/(K-2))``.
- ``layer_generator`` seeds a CPU ``torch.Generator`` from (seed, layer); the caller folds the RL
  step into ``seed`` (stages/rollout does), so the draw is a function of (run seed, step, layer).
  Each layer's generator draws the input-norm noise first, then the post-attention-norm noise
  (independent vectors, one per norm). The same function serves the HF engine and the vLLM worker
  extension (``qerl.pipeline.rollout.aqn_vllm``), so both engines see bit-identical noise.
- ``apply_norm_noise`` keeps a clean fp32 copy of every such weight the first time it sees the
  model and always writes ``(clean + z).to(param.dtype)``: noise never accumulates, sigma = 0
  restores the weights exactly, and the add happens in fp32 (in bf16, sigma < 4e-3 added to
  weights near 1.0 would round away).

Departures from the paper / reference code, and why.
- The released scripts compute a sigma but never reach the engine; here the sigma of the step is
  applied to the rollout engine (tests prove its logprobs change).
- Independent noise per norm (two vectors per layer) rather than one shared vector: the paper's
  formula is per norm weight, and sharing would correlate attention and MLP noise for no reason.
- Edge cases of the schedule (the paper assumes K >= 3 and many steps): K = 1 means no noise at
  all; K = 2 means stage 1 uses sigma_start; with fewer steps than stages the stage index is
  ``floor(step * K / total_steps)``, so short runs sample the same curve at coarser points
  (e.g. 3 steps, K = 10 -> stages 0, 3, 6) rather than stopping inside the first stages.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from pydantic import Field, model_validator
from qerl.pipeline.config import StrictModel
from qerl.pipeline.runtime.seeds import derive_seed

__all__ = [
    "NORM_KINDS",
    "AQNConfig",
    "apply_norm_noise",
    "apply_to_hf_model",
    "layer_generator",
    "layer_noise",
    "noise_targets",
    "norm_noise",
    "sigma_schedule",
    "stage_of",
]

NORM_KINDS = ("input_layernorm", "post_attention_layernorm")
# Matches both transformers' parameter names and vLLM's module names (model.layers.N.<kind>).
_NORM_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.(input_layernorm|post_attention_layernorm)(?:\.weight)?$")
_CLEAN_ATTR = "_qerl_clean_norms"


class AQNConfig(StrictModel):
    """Adaptive Quantization Noise schedule (defaults: the QeRL paper's recipe)."""

    enabled: bool = True
    num_stages: int = Field(10, ge=1, description="K: equal-length stages across the run")
    sigma_start: float = Field(1e-2, ge=0.0)
    sigma_end: float = Field(5e-4, ge=0.0)

    @model_validator(mode="after")
    def _check(self) -> AQNConfig:
        if self.num_stages >= 3 and (self.sigma_start == 0.0) != (self.sigma_end == 0.0):
            raise ValueError(
                "aqn: sigma_start and sigma_end must both be > 0 (or both 0) for the exponential decay"
            )
        return self


def stage_of(step: int, total_steps: int, num_stages: int) -> int:
    """The schedule stage (0..K-1) of a 0-based ``step`` in a run of ``total_steps`` steps."""
    if total_steps <= 0:
        raise ValueError(f"aqn: total_steps must be positive, got {total_steps}")
    if not 0 <= step < total_steps:
        raise ValueError(f"aqn: step {step} outside the run's steps 0..{total_steps - 1}")
    return min(step * num_stages // total_steps, num_stages - 1)


def sigma_schedule(step: int, total_steps: int, cfg: AQNConfig) -> float:
    """The AQN sigma of ``step`` (0-based). See the module docstring for the K <= 2 and short-run cases."""
    stage = stage_of(step, total_steps, cfg.num_stages)
    if not cfg.enabled or stage == 0:
        return 0.0
    if cfg.num_stages == 2:
        return float(cfg.sigma_start)
    if cfg.sigma_start == 0.0:
        return 0.0
    exponent = (stage - 1) / (cfg.num_stages - 2)
    return float(cfg.sigma_start * (cfg.sigma_end / cfg.sigma_start) ** exponent)


def layer_generator(seed: int, layer: int) -> torch.Generator:
    """A CPU generator seeded from (seed, layer) through sha256, so nearby seeds are unrelated."""
    return torch.Generator(device="cpu").manual_seed(derive_seed("qerl-aqn", seed, layer))


def norm_noise(hidden_size: int, sigma: float, generator: torch.Generator) -> torch.Tensor:
    """z ~ N(0, sigma^2), shape [hidden_size], fp32 on the CPU, drawn from ``generator``."""
    if sigma < 0:
        raise ValueError(f"aqn: sigma must be >= 0, got {sigma}")
    z = torch.randn(hidden_size, generator=generator, dtype=torch.float32)
    return z * float(sigma)


def layer_noise(seed: int, layer: int, hidden_size: int, sigma: float) -> dict[str, torch.Tensor]:
    """The noise of one decoder layer: {"input_layernorm": z1, "post_attention_layernorm": z2}."""
    gen = layer_generator(seed, layer)
    return {kind: norm_noise(hidden_size, sigma, gen) for kind in NORM_KINDS}


def noise_targets(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, tuple[int, str, torch.Tensor]]:
    """Filter (name, weight) pairs to the AQN targets: name -> (layer index, norm kind, weight)."""
    out = {}
    for name, weight in named:
        match = _NORM_RE.search(name)
        if match:
            out[name] = (int(match.group(1)), match.group(2), weight)
    return out


def apply_norm_noise(
    targets: dict[str, tuple[int, str, torch.Tensor]],
    clean: dict[str, torch.Tensor],
    sigma: float,
    seed: int,
) -> int:
    """Set every target weight to ``clean + z`` in place; fill ``clean`` (fp32 copies) on first use.

    ``targets`` comes from ``noise_targets``; ``clean`` is a dict the caller keeps across calls
    (on the model for HF, on the worker for vLLM), keyed by "layer.kind" so that a peft wrapper
    renaming the parameters cannot make a noisy weight look clean. Returns the number written.
    """
    if not targets:
        raise ValueError("aqn: the model has no layers.N.input_layernorm / post_attention_layernorm weights")
    noise_cache: dict[int, dict[str, torch.Tensor]] = {}
    with torch.no_grad():
        for name, (layer, kind, weight) in targets.items():
            key = f"{layer}.{kind}"
            if key not in clean:
                clean[key] = weight.detach().to(device="cpu", dtype=torch.float32).clone()
            base = clean[key]
            if base.dim() != 1:
                raise ValueError(f"aqn: norm weight {name} has shape {tuple(base.shape)}, expected 1-D")
            if sigma == 0.0:
                new = base
            else:
                if layer not in noise_cache:
                    noise_cache[layer] = layer_noise(seed, layer, base.numel(), sigma)
                new = base + noise_cache[layer][kind]
            weight.copy_(new.to(device=weight.device, dtype=weight.dtype))
    return len(targets)


def apply_to_hf_model(model: torch.nn.Module, sigma: float, seed: int) -> int:
    """AQN on a transformers (or peft-wrapped) model: keeps the clean copy on the base model.

    A peft wrapper is unwrapped first so that wrapping a noisy model later cannot make its noisy
    weights look clean (the wrapper and the base share the parameters, not the attribute).
    """
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    clean = model.__dict__.setdefault(_CLEAN_ATTR, {})
    targets = noise_targets((name, param.data) for name, param in model.named_parameters())
    return apply_norm_noise(targets, clean, sigma, seed)
