"""The kernel part of ``bench_gpu.py``, run in its own process: a device-to-device copy's bandwidth,
the dequantizer's GB/s, and ``NVFP4Linear``'s forward (dequantize, then the bf16 GEMM) against the
bf16 GEMM alone, at decode and prefill token counts of 7B's projections."""

from __future__ import annotations

import statistics
import time
from typing import Any


def _timed(fn: Any, device: str, iters: int) -> float:
    """Median seconds of ``fn()`` after two warm-up calls (CUDA events on a GPU)."""
    import torch

    for _ in range(2):
        fn()
    samples = []
    for _ in range(iters):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def kernel_bench(device: str, dry: bool) -> dict:
    """Copy bandwidth, dequantize GB/s, and dequantize+GEMM vs bf16 GEMM."""
    import torch
    import torch.nn.functional as F
    from qerl.kernels import nvfp4_dispatch
    from qerl.pipeline.nvfp4.linear import NVFP4Linear
    from qerl.pipeline.planning.model_shape import KNOWN_SHAPES

    iters = 3 if dry else 20
    n_copy = (1 << 16) if dry else (1 << 29)  # 1 GiB of bf16 on a GPU
    src = torch.empty(n_copy, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    copy_gbs = 2 * src.numel() * 2 / _timed(lambda s=src, d=dst: d.copy_(s), device, iters) / 1e9
    out: dict[str, Any] = {
        "copy_GBps": copy_gbs,
        "backend": nvfp4_dispatch.dequantize_backend(device),
        "dequant": [],
        "gemm": [],
    }
    shapes = (
        {"tiny": (256, 128)}
        if dry
        else {
            "7b gate_proj": KNOWN_SHAPES["qwen2.5-7b"].projections()["gate_proj"],
            "32b gate_proj": KNOWN_SHAPES["qwen2.5-32b"].projections()["gate_proj"],
        }
    )
    for name, (o, i) in shapes.items():
        w = torch.randn(o, i, device=device, dtype=torch.bfloat16) * 0.02
        packed, scale, gs = nvfp4_dispatch.quantize(w)
        sec = _timed(
            lambda p=packed, s=scale, g=gs: nvfp4_dispatch.dequantize(p, s, g, torch.bfloat16), device, iters
        )
        traffic = o * i // 2 + o * i // 16 + 2 * o * i  # codes + FP8 scales in, bf16 out
        out["dequant"].append({"shape": name, "out": o, "in": i, "s": sec, "GBps": traffic / sec / 1e9})
    proj = (
        {"q_proj": (64, 64), "gate_proj": (128, 64)}
        if dry
        else {
            k: v
            for k, v in KNOWN_SHAPES["qwen2.5-7b"].projections().items()
            if k in ("q_proj", "gate_proj", "down_proj")
        }
    )
    for name, (o, i) in proj.items():
        w = torch.randn(o, i, device=device, dtype=torch.bfloat16) * 0.02
        layer = NVFP4Linear.from_tensors(*nvfp4_dispatch.quantize(w), name=name)
        dense = nvfp4_dispatch.dequantize(
            layer.weight_packed, layer.weight_scale, layer.weight_global_scale, torch.bfloat16
        )
        for tokens in (8, 64) if dry else (8, 64, 4096):
            x = torch.randn(tokens, i, device=device, dtype=torch.bfloat16)
            with torch.no_grad():
                fused = _timed(lambda x=x, layer=layer: layer(x), device, iters)
                plain = _timed(lambda x=x, d=dense: F.linear(x, d), device, iters)
            out["gemm"].append(
                {"proj": name, "out": o, "in": i, "tokens": tokens, "nvfp4_s": fused, "bf16_s": plain}
            )
    return out
