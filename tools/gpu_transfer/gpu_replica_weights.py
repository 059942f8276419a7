"""The replica's weights check: its vLLM (0.26 from the bundle, 0.32 in a user install) loads the
quantize stage's checkpoint on the CPU, as its loader does on the GPU just before Marlin repacks it.

vLLM checks that every parameter was written only for unquantized models
(``DefaultModelLoader.track_weights_loading``): a quantized parameter that no checkpoint tensor fills
keeps whatever ``torch.empty`` left there, and the engine serves it without an error. So this check
does not trust the loader's own account:

1. the model is built on the CPU under vLLM's CUDA platform (the replica's H200), with the scheme
   objects the GPU gets, and every parameter is filled with 0xFF bytes (NaN in every float dtype);
2. ``DefaultModelLoader.load_weights``, vLLM's own iterator and the model's ``load_weights`` with its
   shard loaders, fills them from the checkpoint;
3. each parameter is compared byte for byte with the checkpoint, fused layers (``qkv_proj``,
   ``gate_up_proj``) stacked from their parts by the model's ``packed_modules_mapping``, not by vLLM's
   shard loaders, and the vocabulary's padding rows (vLLM rounds it up to 64) zero. The attention's
   KV-cache scales are the exception: vLLM sets them after loading, and a qerl checkpoint has none;
4. the parts of a fused layer share one global scale: vLLM takes the largest for all of them, which
   mis-scales any part whose own differs;
5. Marlin's conversion of the FP8 block scales to its S0E5M3 bytes (``nvfp4_marlin_process_scales``,
   plain PyTorch) is decoded back and compared with the checkpoint's: exact, except that Marlin reads a
   block scale below the smallest normal E4M3 value (2^-6, over its power-of-two rescale) as zero. Those
   blocks are counted (the trainer reads them as they are stored) and reported, and the count must be
   the one the quantize manifest gives (``qerl.pipeline.nvfp4.marlin``), here against the replica's vLLM.

Not checked: ``gptq_marlin_repack`` (a CUDA op) and the layout permutations, which vLLM's own kernel
tests cover.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

SENTINEL = 0xFF


def build_vllm_model(model_dir: Path, work: Path, device: str) -> tuple[Any, Any]:
    """vLLM's model for the checkpoint on ``device`` (``meta`` or ``cpu``), as its loader builds it
    (the model's dtype as the default dtype); the single-rank process group is set up once."""
    import torch
    from qerl.pipeline.rollout.vllm_engine import FP4_MARLIN_ARGS
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import (
        init_distributed_environment,
        initialize_model_parallel,
        model_parallel_is_initialized,
    )
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    args = EngineArgs(model=str(model_dir), dtype="bfloat16", max_model_len=256, **FP4_MARLIN_ARGS)
    cfg = args.create_engine_config()
    with set_current_vllm_config(cfg):
        if not model_parallel_is_initialized():
            init_distributed_environment(1, 0, f"file://{work / 'dist-init'}", 0, "gloo")
            initialize_model_parallel(1, 1)
        with set_default_torch_dtype(cfg.model_config.dtype), torch.device(device):
            model = initialize_model(vllm_config=cfg, prefix="")
    return cfg, model


def expected_tensors(model: Any, checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Each parameter's value from the checkpoint: its own tensor, or a fused layer's parts stacked
    in ``packed_modules_mapping`` order (a part's 1-element global scale becomes one entry)."""
    import torch
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    packed = dict(getattr(type(model), "packed_modules_mapping", {}))
    modules = dict(model.named_modules())
    want = {}
    for name, param in model.named_parameters():
        module, leaf = name.rsplit(".", 1)
        parent, _, layer = module.rpartition(".")
        if layer in packed:
            parts = [checkpoint.get(f"{parent}.{part}.{leaf}") for part in packed[layer]]
            if all(p is not None for p in parts):
                want[name] = torch.cat([p.reshape(1) if p.dim() == 0 else p for p in parts])
        elif name in checkpoint:
            want[name] = checkpoint[name]
            if isinstance(modules[module], VocabParallelEmbedding) and len(param) > len(want[name]):
                pad = want[name].new_zeros(len(param) - len(want[name]), *want[name].shape[1:])
                want[name] = torch.cat([want[name], pad])  # vLLM zeroes the padding rows
    return want


def set_after_loading(model: Any) -> set[str]:
    """The parameters vLLM sets after loading rather than from the checkpoint: the attention's
    KV-cache scales (``BaseKVCacheMethod``; 1.0 unless the checkpoint quantizes the KV cache)."""
    from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod

    return {
        f"{module}.{leaf}"
        for module, m in model.named_modules()
        if isinstance(getattr(m, "quant_method", None), BaseKVCacheMethod)
        for leaf, _ in m.named_parameters(recurse=False)
    }


def marlin_scale_roundtrip(scale: Any) -> tuple[Any, float]:
    """The FP8 block scales ``scale`` ([N, K/16]) as Marlin's kernel reads them, in float32, and
    Marlin's power-of-two rescale: ``nvfp4_marlin_process_scales`` on the transposed scales in the
    model's bf16, decoded from its S0E5M3 bytes (a byte is the top 8 bits of its half below the sign)."""
    import torch
    from vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 import nvfp4_marlin_process_scales

    swap = [0, 2, 1, 3]  # Marlin's within-4 reorder for its FP8 dequantization (its own inverse)
    rows = scale.T.contiguous().to(torch.bfloat16)
    marlin, factor = nvfp4_marlin_process_scales(rows, a_dtype=torch.bfloat16)
    halves = (marlin.view(torch.uint8).to(torch.int16) << 7).view(torch.float16)
    decoded = halves.float() / 2**7 / factor
    decoded = decoded.view(-1, 4)[:, swap].reshape(rows.shape)
    return decoded.T.contiguous(), factor


def check_weights(model_dir: Path, work: Path, say: Any) -> list[str]:
    """Load ``model_dir`` with vLLM's own loader on the CPU and compare every parameter with the
    checkpoint; then the fused global scales and Marlin's scale conversion (module docstring)."""
    import torch
    from qerl.pipeline.nvfp4.marlin import zeroed_in_layer
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    cfg, model = build_vllm_model(model_dir, work, "cpu")
    for p in model.parameters():
        p.data.view(torch.uint8).fill_(SENTINEL)
    with set_current_vllm_config(cfg):
        DefaultModelLoader(cfg.load_config).load_weights(model, cfg.model_config)
    checkpoint = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        checkpoint.update(load_file(f))
    want, findings = expected_tensors(model, checkpoint), []
    params, later = dict(model.named_parameters()), set_after_loading(model)
    for name, p in params.items():
        if name in later:
            continue
        if name not in want:
            findings.append(f"weights: no checkpoint tensor for vLLM's parameter {name}")
        elif p.dtype != want[name].dtype or p.shape != want[name].shape:
            findings.append(
                f"weights: {name} is {p.dtype} {tuple(p.shape)} in vLLM, "
                f"{want[name].dtype} {tuple(want[name].shape)} in the checkpoint"
            )
        elif not torch.equal(p.data.view(torch.uint8), want[name].contiguous().view(torch.uint8)):
            findings.append(f"weights: {name} differs from the checkpoint after vLLM's loader")
    scales = {
        n.removesuffix(".weight_scale"): p.data for n, p in params.items() if n.endswith(".weight_scale")
    }
    zeroed = blocks = 0
    for layer, scale in scales.items():
        shared = params[f"{layer}.weight_global_scale"].data
        if torch.unique(shared).numel() != 1:
            findings.append(
                f"weights: {layer}'s parts have global scales {shared.tolist()} (vLLM uses the max)"
            )
        marlin, _ = marlin_scale_roundtrip(scale)
        stored = scale.float()
        lost = (stored > 0) & (marlin == 0)
        wrong = (marlin != stored) & ~lost
        zeroed, blocks = zeroed + int(lost.sum()), blocks + stored.numel()
        if wrong.any():
            findings.append(f"weights: Marlin reads {int(wrong.sum())} block scales of {layer} differently")
        if int(lost.sum()) != zeroed_in_layer([scale]):
            findings.append(
                f"weights: Marlin zeroes {int(lost.sum())} blocks of {layer}, the quantize manifest's "
                f"count says {zeroed_in_layer([scale])}"
            )
    say(
        f"  weights ({type(model).__name__}): {len(params) - len(later)} parameters loaded by vLLM's "
        f"loader on the CPU "
        f"({len(later)} KV-cache scales set after loading), {len(scales)} NVFP4 "
        f"layers; {len(findings)} finding(s); Marlin reads {zeroed} of {blocks} block scales as zero"
    )
    return findings
