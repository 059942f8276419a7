"""The NVFP4 base for LoRA training: a linear layer that keeps its weight packed (4.5 bits/weight).

What: ``NVFP4Linear`` holds a compressed-tensors NVFP4 weight as buffers (``weight_packed`` uint8
[out, in/2], ``weight_scale`` FP8 E4M3 [out, in/16], ``weight_global_scale`` fp32 [1]) plus an
optional bias, and computes ``x @ dequant(W).T + b``. ``load_quantized_for_training`` builds a Hugging
Face causal LM from our quantize stage's checkpoint with every quantized Linear replaced by one, without
ever materialising the full-precision Linear weights (the model skeleton is built on the meta device).

How: a custom autograd Function dequantizes in forward, uses the dense tile for one matmul and drops
it; backward dequantizes again for ``grad_input = grad_out @ W``. Only the packed buffers are saved
for backward, so no dequantized copy of the base lives between forward and backward (the QLoRA
trade: one extra dequantization per layer per step for ~3.5x less base-weight memory). The base takes
no gradient: its tensors are buffers, never parameters. peft's LoRA wraps the module through peft's
custom-module registry (``register_with_peft``) using peft's own ``lora.Linear``, so saved adapters are
ordinary peft adapters (same keys and config as for an ``nn.Linear`` base).

Departures: the paper's trainer uses a fused Marlin-style FP4 GEMM; here the dequantizer is the
PyTorch reference on CPU and kernels.nvfp4_triton's Triton dequantizer on GPU (dense matmul after), so
the GPU fast path saves memory but not FLOPs. The weight is dequantized to the activation dtype, which
is exactly what a bf16 model loaded with the dequantized weights holds (see ``load_dequantized_reference``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from kernels import nvfp4

log = logging.getLogger("qerl.qlinear")

__all__ = [
    "NVFP4Linear",
    "dequantize_weight",
    "load_dequantized_reference",
    "load_quantized_for_training",
    "quantized_linear_names",
    "register_with_peft",
]

_PACKED, _SCALE, _GSCALE = "weight_packed", "weight_scale", "weight_global_scale"


def dequantize_weight(
    packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Dense [out, in] weight: the Triton dequantizer on CUDA, the PyTorch reference elsewhere."""
    return nvfp4.dequantize(packed, scale, global_scale, dtype=dtype)


class _NVFP4LinearFn(torch.autograd.Function):
    """y = x W^T + b with W dequantized on the fly in forward and again in backward."""

    @staticmethod
    def forward(ctx, x, packed, scale, global_scale, bias):  # noqa: ANN001, ANN205
        weight = dequantize_weight(packed, scale, global_scale, x.dtype)
        ctx.save_for_backward(packed, scale, global_scale)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):  # noqa: ANN001, ANN205
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        packed, scale, global_scale = ctx.saved_tensors
        weight = dequantize_weight(packed, scale, global_scale, grad_out.dtype)
        return grad_out.matmul(weight), None, None, None, None


class NVFP4Linear(nn.Module):
    """A frozen Linear whose weight stays NVFP4-packed; LoRA (peft) trains on top of it."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        if in_features % 16:
            raise ValueError(f"NVFP4Linear needs in_features divisible by 16, got {in_features}")
        self.in_features, self.out_features = in_features, out_features
        self.compute_dtype = dtype
        self.register_buffer(
            _PACKED, torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device)
        )
        self.register_buffer(
            _SCALE, torch.zeros(out_features, in_features // 16, dtype=torch.float8_e4m3fn, device=device)
        )
        self.register_buffer(_GSCALE, torch.ones(1, dtype=torch.float32, device=device))
        self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device) if bias else None)

    @classmethod
    def from_tensors(
        cls,
        packed: torch.Tensor,
        scale: torch.Tensor,
        global_scale: torch.Tensor,
        bias: torch.Tensor | None = None,
        dtype: torch.dtype = torch.bfloat16,
        name: str = "<linear>",
    ) -> NVFP4Linear:
        """Wrap existing packed tensors (shapes and dtypes checked; ``name`` is used in errors)."""
        out_features, half_in = packed.shape
        expected = {
            _PACKED: (packed, torch.uint8, (out_features, half_in)),
            _SCALE: (scale, torch.float8_e4m3fn, (out_features, half_in * 2 // 16)),
            _GSCALE: (global_scale, torch.float32, (1,)),
        }
        for suffix, (tensor, dtype_, shape) in expected.items():
            if tensor.dtype != dtype_ or tuple(tensor.shape) != shape:
                raise ValueError(
                    f"{name}.{suffix}: expected {dtype_} {shape}, got {tensor.dtype} {tuple(tensor.shape)}"
                )
        if bias is not None and tuple(bias.shape) != (out_features,):
            raise ValueError(f"{name}.bias: expected shape ({out_features},), got {tuple(bias.shape)}")
        module = cls(half_in * 2, out_features, bias=bias is not None, dtype=dtype, device="meta")
        module.weight_packed = packed
        module.weight_scale = scale
        module.weight_global_scale = global_scale
        module.bias = None if bias is None else bias.to(dtype)
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return _NVFP4LinearFn.apply(x, self.weight_packed, self.weight_scale, self.weight_global_scale, bias)

    @property
    def qweight(self) -> torch.Tensor:
        """The packed codes under the name peft probes to find a quantized layer's device."""
        return self.weight_packed

    def dequantized(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize_weight(
            self.weight_packed, self.weight_scale, self.weight_global_scale, dtype or self.compute_dtype
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )


def register_with_peft(lora_config) -> None:  # noqa: ANN001
    """Let peft wrap NVFP4Linear with its ordinary ``lora.Linear`` (the base is only called, never merged)."""
    from peft.tuners.lora import Linear as LoraLinear

    lora_config._register_custom_module({NVFP4Linear: LoraLinear})


# -- checkpoint loading ----------------------------------------------------------------------------


def _weight_files(ckpt_dir: Path) -> list[Path]:
    index = ckpt_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [ckpt_dir / s for s in shards]
    single = ckpt_dir / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {ckpt_dir}")
    return [single]


def _read_tensors(ckpt_dir: Path, device: torch.device | str) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in _weight_files(ckpt_dir):
        with safe_open(str(path), framework="pt", device=str(device)) as fh:
            for key in fh.keys():  # noqa: SIM118 - safe_open has no __iter__
                tensors[key] = fh.get_tensor(key)
    return tensors


def quantized_linear_names(tensors: dict[str, torch.Tensor] | list[str]) -> list[str]:
    """Module names ``X`` that have an ``X.weight_packed`` tensor."""
    suffix = "." + _PACKED
    return sorted(k[: -len(suffix)] for k in tensors if k.endswith(suffix))


def _empty_model(ckpt_dir: Path, dtype: torch.dtype):  # noqa: ANN202
    """The HF model skeleton: parameters on meta (no allocation), buffers such as RoPE real."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(ckpt_dir)
    if hasattr(config, "quantization_config"):
        # We load the packed tensors ourselves; transformers must not apply compressed-tensors.
        del config.quantization_config
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.config._name_or_path = str(ckpt_dir)
    return model


def _finish_loading(
    model: nn.Module, tensors: dict[str, torch.Tensor], ckpt_dir: Path, dtype: torch.dtype
) -> None:
    float_tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    result = model.load_state_dict(float_tensors, strict=False, assign=True)
    if result.unexpected_keys:
        raise ValueError(f"{ckpt_dir}: tensors the model has no place for: {result.unexpected_keys[:10]}")
    if getattr(model.config, "tie_word_embeddings", False):
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    missing = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta]
    if missing:
        raise ValueError(f"{ckpt_dir}: no tensor for {missing[:10]}")
    for param in model.parameters():
        param.requires_grad_(False)


def load_quantized_for_training(
    ckpt_dir: str | Path, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu"
) -> nn.Module:
    """The HF causal LM of an NVFP4A16 checkpoint with packed NVFP4Linear layers, all frozen."""
    ckpt_dir = Path(ckpt_dir)
    model = _empty_model(ckpt_dir, dtype)
    tensors = _read_tensors(ckpt_dir, device)
    names = quantized_linear_names(tensors)
    if not names:
        raise ValueError(f"{ckpt_dir}: no '*.{_PACKED}' tensors - not an NVFP4 checkpoint")
    for name in names:
        try:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            old = getattr(parent, child)
        except AttributeError:
            raise ValueError(
                f"{ckpt_dir}: quantized tensor '{name}.{_PACKED}' matches no module in the model"
            ) from None
        if not isinstance(old, nn.Linear):
            raise ValueError(f"{ckpt_dir}: '{name}' is a {type(old).__name__}, not a Linear")
        module = NVFP4Linear.from_tensors(
            tensors.pop(f"{name}.{_PACKED}"),
            tensors.pop(f"{name}.{_SCALE}"),
            tensors.pop(f"{name}.{_GSCALE}"),
            tensors.pop(f"{name}.bias", None),
            dtype=dtype,
            name=name,
        )
        if (module.in_features, module.out_features) != (old.in_features, old.out_features):
            raise ValueError(
                f"{ckpt_dir}: '{name}' is {module.out_features}x{module.in_features} in the checkpoint, "
                f"{old.out_features}x{old.in_features} in config.json"
            )
        setattr(parent, child, module)
    _finish_loading(model, tensors, ckpt_dir, dtype)
    log.info("loaded %s: %d NVFP4 linears (packed), dtype %s", ckpt_dir, len(names), dtype)
    return model


def load_dequantized_reference(
    ckpt_dir: str | Path, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu"
) -> nn.Module:
    """The same checkpoint as an ordinary HF model whose Linear weights hold dequant(W) in ``dtype``.

    The independent reference for tests: plain ``nn.Linear`` layers, no custom autograd.
    """
    ckpt_dir = Path(ckpt_dir)
    model = _empty_model(ckpt_dir, dtype)
    tensors = _read_tensors(ckpt_dir, device)
    for name in quantized_linear_names(tensors):
        tensors[f"{name}.weight"] = dequantize_weight(
            tensors.pop(f"{name}.{_PACKED}"),
            tensors.pop(f"{name}.{_SCALE}"),
            tensors.pop(f"{name}.{_GSCALE}"),
            dtype,
        )
    _finish_loading(model, tensors, ckpt_dir, dtype)
    return model
