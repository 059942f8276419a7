"""Where tensors run: the one CUDA check every module asks.

The engine mode (``vllm-nvfp4-marlin`` on CUDA, the dequantized twin elsewhere), the quantize and
train stages' device and the flow's choice to build a twin all follow this single answer, so they
cannot disagree.
"""

from __future__ import annotations

__all__ = ["cuda_available", "default_device", "free_device_cache"]


def cuda_available() -> bool:
    """Whether a CUDA device is usable here (torch imported lazily: ``qerl --help`` stays fast)."""
    import torch

    return torch.cuda.is_available()


def default_device() -> str:
    """``"cuda"`` where a CUDA device is usable, else ``"cpu"``."""
    return "cuda" if cuda_available() else "cpu"


def free_device_cache() -> None:
    """Give the memory torch's CUDA allocator keeps cached back to the device (a no-op without CUDA):
    after a stage that ran whole models on the GPU, so the next (vLLM's engine, the trainer) finds it."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
