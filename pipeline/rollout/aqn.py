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
- ``noise_norm_modules`` keeps a clean fp32 copy of every such weight (and the original
  parameter) the first time it sees the model and always derives the noisy weight from that copy:
  noise never accumulates, and sigma = 0 puts the original parameter back untouched, so a noise-free
  step computes bit for bit what a never-noised engine computes.
- Noisy weights are kept in fp32, also on a bf16/fp16 model. ``(clean + z).to(bf16)`` rounds z to
  the weight's ulp (2**-7 near 1.0): with the 7B schedule (1e-2 -> 5e-4) only stage 1 survives
  (realised 1.05x sigma), late stages keep 0.35x of it as one-ulp jumps on a few percent of the
  channels. So while sigma > 0 the norm's weight is an fp32 parameter holding clean + z and the norm
  computes ``(w_fp32 * normalized_fp32).to(input_dtype)``: the output stays in the input dtype (the
  next Linear is unchanged) and the noise is exactly the one drawn. transformers' Llama/Qwen RMSNorm
  multiply the weight by the already-cast hidden state (an fp32 weight would turn the output fp32),
  so their instance ``forward`` is replaced while noisy (``patch_forward``); vLLM's native RMSNorm
  already computes ``x.to(weight.dtype) * weight`` and falls back from its fused kernels, which need
  weight dtype == input dtype, to that path by itself. An fp32 model keeps its parameter and is
  written in place. The weight is then exact; the norm's output is still rounded to bf16 as for a
  clean model, so a small z moves some outputs by one bf16 ulp and leaves others (unbiased, like
  dithering) rather than vanishing in the weight. The same handling serves the trainer
  (``apply_to_hf_model`` on a peft-wrapped model: the norms are not LoRA targets and stay frozen).
- ``realised_sigma`` measures what the engine will use: the std over all noised channels of
  ``w_as_used - w_clean`` (fp32, from the weight tensors themselves), from per-worker sums so that
  pipeline-parallel workers combine. ``check_realised`` logs a WARNING when it is more than 10% off
  the requested sigma (an engine that cannot hold fp32 weights, see ``qerl.pipeline.rollout.aqn_vllm``).

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

import logging
import math
import re
from collections.abc import Iterable
from types import MethodType
from typing import Any, TypeVar

import torch
from pydantic import Field, model_validator
from qerl.pipeline.config import StrictModel
from qerl.pipeline.runtime.seeds import derive_seed

__all__ = [
    "NORM_KINDS",
    "AQNConfig",
    "apply_norm_noise",
    "apply_to_hf_model",
    "check_realised",
    "layer_generator",
    "layer_noise",
    "noise_hf_model",
    "noise_norm_modules",
    "noise_targets",
    "norm_noise",
    "realised_sigma",
    "sigma_schedule",
    "stage_of",
]

NORM_KINDS = ("input_layernorm", "post_attention_layernorm")
# Matches both transformers' parameter names and vLLM's module names (model.layers.N.<kind>).
_NORM_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.(input_layernorm|post_attention_layernorm)(?:\.weight)?$")
_STATE_ATTR = "_qerl_aqn_state"
_T = TypeVar("_T")
# |realised / requested - 1| above this is logged at WARNING
REALISED_TOLERANCE = 0.10
log = logging.getLogger("qerl.aqn")


class AQNConfig(StrictModel):
    """Adaptive Quantization Noise schedule (defaults: the QeRL paper's recipe)."""

    enabled: bool = True
    num_stages: int = Field(10, ge=1, description="K: equal-length stages across the run")
    sigma_start: float = Field(1e-2, ge=0.0)
    sigma_end: float = Field(5e-4, ge=0.0)

    @property
    def active(self) -> bool:
        """Whether any step of a run gets noise (``sigma_schedule`` is nonzero somewhere)."""
        return self.enabled and self.num_stages >= 2 and self.sigma_start > 0.0

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


def noise_targets(named: Iterable[tuple[str, _T]]) -> dict[str, tuple[int, str, _T]]:
    """Filter (name, weight or module) pairs to the AQN targets: name -> (layer index, norm kind, item)."""
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
    """Write ``(clean + z).to(weight.dtype)`` into every target weight in place; returns the count.

    The dtype-preserving write, for weights whose storage must not change (captured graphs); on a
    16-bit weight most of z rounds away (module docstring), which ``realised_sigma`` then shows.
    ``clean`` (fp32 copies, keyed "layer.kind") is filled on first use and kept by the caller.
    """
    if not targets:
        raise ValueError("aqn: the model has no layers.N.input_layernorm / post_attention_layernorm weights")
    noise_cache: dict[int, dict[str, torch.Tensor]] = {}
    with torch.no_grad():
        for name, (layer, kind, weight) in targets.items():
            base = _clean_copy(clean, f"{layer}.{kind}", weight, name)
            new = base if sigma == 0.0 else base + _noise(noise_cache, seed, layer, kind, base, sigma)
            weight.copy_(new.to(device=weight.device, dtype=weight.dtype))
    return len(targets)


def _clean_copy(clean: dict[str, torch.Tensor], key: str, weight: torch.Tensor, name: str) -> torch.Tensor:
    if key not in clean:
        if weight.dim() != 1:
            raise ValueError(f"aqn: norm weight {name} has shape {tuple(weight.shape)}, expected 1-D")
        clean[key] = weight.detach().to(device="cpu", dtype=torch.float32).clone()
    return clean[key]


def _noise(
    cache: dict[int, dict[str, torch.Tensor]],
    seed: int,
    layer: int,
    kind: str,
    base: torch.Tensor,
    sigma: float,
) -> torch.Tensor:
    if layer not in cache:
        cache[layer] = layer_noise(seed, layer, base.numel(), sigma)
    return cache[layer][kind]


def _rmsnorm_fp32_weight(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """transformers' Llama/Qwen RMSNorm with the weight multiply in fp32, output in the input dtype."""
    input_dtype = hidden_states.dtype
    hidden = hidden_states.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + self.variance_epsilon)
    return (self.weight * hidden).to(input_dtype)


def _check_patchable(name: str, module: torch.nn.Module) -> None:
    cls = type(module).__name__
    # Gemma-style norms scale by (1 + w) and others differ too: only the w * x_hat form is known here
    if not cls.endswith("RMSNorm") or "Gemma" in cls or not hasattr(module, "variance_epsilon"):
        raise ValueError(
            f"aqn: {name} is a {cls}; an fp32 noisy weight needs a Llama/Qwen-style RMSNorm "
            "(w * x / rms(x) with variance_epsilon)"
        )


def _restore(module: torch.nn.Module, original: torch.Tensor) -> None:
    """Put the original parameter (and the class forward) back on ``module``."""
    if module.weight is not original:
        module.weight = original
    patched = module.__dict__.get("forward")
    if getattr(patched, "__func__", None) is _rmsnorm_fp32_weight:
        del module.__dict__["forward"]


def _hold_fp32(
    module: torch.nn.Module, original: torch.Tensor, new: torch.Tensor, patch_forward: bool
) -> None:
    """Make ``module`` use ``new`` as an fp32 weight (a new parameter the first time, then in place)."""
    current = module.weight
    if current is original or current.dtype != torch.float32:
        module.weight = torch.nn.Parameter(new.to(original.device), requires_grad=False)
    else:
        current.data.copy_(new.to(current.device))
    if patch_forward:
        module.forward = MethodType(_rmsnorm_fp32_weight, module)


def noise_norm_modules(
    modules: dict[str, tuple[int, str, torch.nn.Module]],
    state: dict[str, Any],
    sigma: float,
    seed: int,
    *,
    fp32_weights: bool,
    patch_forward: bool,
) -> dict[str, float]:
    """Give every norm module ``clean + z`` as its weight; returns the realised-noise sums.

    ``modules`` comes from ``noise_targets`` over ``named_modules()``; ``state`` is a dict the
    caller keeps across calls (on the model for HF, on the worker for vLLM): the clean fp32 copies
    and the original parameters, keyed "layer.kind" (a peft wrapper renaming modules cannot make a
    noisy weight look clean). ``fp32_weights``: hold noisy 16-bit weights as fp32 parameters
    (module docstring); False writes them in place in their dtype. ``patch_forward``: the module is
    a transformers RMSNorm whose forward must do the multiply in fp32. Returns ``weights`` (count),
    ``channels``, ``sum`` and ``sum_sq`` of ``w_as_used - w_clean`` (for ``realised_sigma``) and
    ``fp32`` (1.0 when the noisy weights are fp32 tensors).
    """
    if not modules:
        raise ValueError("aqn: the model has no layers.N.input_layernorm / post_attention_layernorm modules")
    if sigma < 0:
        raise ValueError(f"aqn: sigma must be >= 0, got {sigma}")
    clean, original = state.setdefault("clean", {}), state.setdefault("original", {})
    if patch_forward and sigma > 0:
        for name, (_, _, module) in modules.items():
            _check_patchable(name, module)  # before anything is changed
    noise_cache: dict[int, dict[str, torch.Tensor]] = {}
    stats = {"weights": float(len(modules)), "channels": 0.0, "sum": 0.0, "sum_sq": 0.0, "fp32": 1.0}
    with torch.no_grad():
        for name, (layer, kind, module) in modules.items():
            key = f"{layer}.{kind}"
            original.setdefault(key, module.weight)
            param = original[key]
            base = _clean_copy(clean, key, param, name)
            if sigma == 0.0:
                _restore(module, param)
                param.data.copy_(base.to(device=param.device, dtype=param.dtype))
            else:
                new = base + _noise(noise_cache, seed, layer, kind, base, sigma)
                if fp32_weights and param.dtype != torch.float32:
                    _hold_fp32(module, param, new, patch_forward)
                else:
                    _restore(module, param)
                    param.data.copy_(new.to(device=param.device, dtype=param.dtype))
            used = module.weight.detach().to(device="cpu", dtype=torch.float32)
            delta = (used - base).double()  # the difference in fp32, summed in fp64
            stats["channels"] += delta.numel()
            stats["sum"] += float(delta.sum())
            stats["sum_sq"] += float(delta.square().sum())
            stats["fp32"] = min(stats["fp32"], float(module.weight.dtype == torch.float32))
    return stats


def realised_sigma(stats: Iterable[dict[str, float]]) -> float:
    """The std of ``w_as_used - w_clean`` over all channels of ``noise_norm_modules`` results."""
    stats = list(stats)
    n = sum(s["channels"] for s in stats)
    if n <= 0:
        raise ValueError("aqn: no noised channels to measure")
    mean = sum(s["sum"] for s in stats) / n
    return math.sqrt(max(sum(s["sum_sq"] for s in stats) / n - mean * mean, 0.0))


def check_realised(sigma: float, realised: float, where: str, channels: float = math.inf) -> None:
    """Log a WARNING when the realised noise is more than ``REALISED_TOLERANCE`` off ``sigma``, or,
    for few ``channels``, more than 4 standard errors of a sample std (``1/sqrt(2n)`` relative): a
    small model's draw alone is that far off (256 channels: 4.4% a standard error)."""
    tolerance = max(REALISED_TOLERANCE, 4.0 / math.sqrt(2.0 * max(channels, 1.0)))
    if sigma > 0 and abs(realised / sigma - 1.0) > tolerance:
        log.warning(
            "AQN on %s: realised sigma %.3g is %.2fx the requested %.3g (more than %.0f%% off)",
            where,
            realised,
            realised / sigma,
            sigma,
            tolerance * 100,
        )


def noise_hf_model(model: torch.nn.Module, sigma: float, seed: int) -> dict[str, float]:
    """AQN on a transformers (or peft-wrapped) model; returns ``noise_norm_modules``' sums.

    A peft wrapper is unwrapped first so that wrapping a noisy model later cannot make its noisy
    weights look clean (the wrapper and the base share the modules, not the attribute).
    """
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    state = model.__dict__.setdefault(_STATE_ATTR, {})
    modules = noise_targets(model.named_modules())
    return noise_norm_modules(modules, state, float(sigma), int(seed), fp32_weights=True, patch_forward=True)


def apply_to_hf_model(model: torch.nn.Module, sigma: float, seed: int) -> int:
    """``noise_hf_model`` returning the number of norm weights written (fp32 while noisy)."""
    return int(noise_hf_model(model, sigma, seed)["weights"])
