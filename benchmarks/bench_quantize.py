"""Quantize-stage benchmarks: speed against the compressed-tensors compressor, and peak memory on 7B.

1. Speed (Qwen2.5-0.5B shapes, random bf16 weights written to disk): wall time of our quantize stage
   (read shards, quantize, write the checkpoint, hash it into the store) against the compressed-tensors
   NVFP4 compressor applied tensor by tensor to the same tensors (``generate_gparam`` with fused-layer
   global scales, ``calculate_qparams``, ``NVFP4PackedCompressor.compress``; reading included, writing
   not). One run each on the same machine; every library output is checked byte for byte against ours.
2. Memory (run first; Qwen2.5-7B shapes, ~15 GB of bf16 shards streamed to a temp dir, deleted afterwards): peak
   resident set of the quantize stage in a subprocess (``getrusage(RUSAGE_CHILDREN).ru_maxrss``),
   against the bytes a whole-model load would hold. ``--skip-7b`` leaves it out (it takes minutes).

Run: ``.venv/bin/python benchmarks/bench_quantize.py [--skip-7b]``; writes benchmarks/results/quantize.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from qerl.pipeline.nvfp4.safetensors_io import TensorSpec, write_sharded  # noqa: E402

# The stage as compared: the quality section (KL on held-out texts, two model passes) is measurement
# of its own, which the library's compressor does not do; a random checkpoint has no tokenizer for it
STAGE = {"quality": {"enabled": False}}
QWEN_05B = dict(hidden=896, inter=4864, layers=24, heads=14, kv_heads=2, vocab=151936, tied=True)
QWEN_7B = dict(hidden=3584, inter=18944, layers=28, heads=28, kv_heads=4, vocab=152064, tied=False)


def _specs(shape: dict) -> list[TensorSpec]:
    h, i, hd = shape["hidden"], shape["inter"], shape["hidden"] // shape["heads"]
    kv = shape["kv_heads"] * hd
    specs = [TensorSpec("model.embed_tokens.weight", "BF16", (shape["vocab"], h))]
    for n in range(shape["layers"]):
        p = f"model.layers.{n}"
        specs += [
            TensorSpec(f"{p}.input_layernorm.weight", "BF16", (h,)),
            TensorSpec(f"{p}.self_attn.q_proj.weight", "BF16", (h, h)),
            TensorSpec(f"{p}.self_attn.q_proj.bias", "BF16", (h,)),
            TensorSpec(f"{p}.self_attn.k_proj.weight", "BF16", (kv, h)),
            TensorSpec(f"{p}.self_attn.k_proj.bias", "BF16", (kv,)),
            TensorSpec(f"{p}.self_attn.v_proj.weight", "BF16", (kv, h)),
            TensorSpec(f"{p}.self_attn.v_proj.bias", "BF16", (kv,)),
            TensorSpec(f"{p}.self_attn.o_proj.weight", "BF16", (h, h)),
            TensorSpec(f"{p}.post_attention_layernorm.weight", "BF16", (h,)),
            TensorSpec(f"{p}.mlp.gate_proj.weight", "BF16", (i, h)),
            TensorSpec(f"{p}.mlp.up_proj.weight", "BF16", (i, h)),
            TensorSpec(f"{p}.mlp.down_proj.weight", "BF16", (h, i)),
        ]
    specs.append(TensorSpec("model.norm.weight", "BF16", (h,)))
    if not shape["tied"]:
        specs.append(TensorSpec("lm_head.weight", "BF16", (shape["vocab"], h)))
    return specs


def write_random_checkpoint(out: Path, shape: dict, seed: int = 0) -> int:
    """Stream a random bf16 Qwen2-shaped checkpoint to ``out`` (one tensor in memory at a time)."""
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)

    def producer(spec: TensorSpec):
        def make() -> dict[str, torch.Tensor]:
            if "norm" in spec.name:
                return {spec.name: torch.ones(spec.shape, dtype=torch.bfloat16)}
            out = torch.empty(spec.shape, dtype=torch.bfloat16)
            rows = max(1, (1 << 22) // spec.shape[-1])  # fill in slices: no float32 copy of a 1 GB tensor
            for r0 in range(0, spec.shape[0], rows):
                chunk = out[r0 : r0 + rows]
                chunk.copy_(torch.randn(chunk.shape, generator=gen) * 0.02)
            return {spec.name: out}

        return make

    specs = _specs(shape)
    write_sharded(out, [([s], producer(s)) for s in specs], 4 << 30)
    h = shape["hidden"]
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": h,
        "intermediate_size": shape["inter"],
        "num_hidden_layers": shape["layers"],
        "num_attention_heads": shape["heads"],
        "num_key_value_heads": shape["kv_heads"],
        "vocab_size": shape["vocab"],
        "tie_word_embeddings": shape["tied"],
        "torch_dtype": "bfloat16",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return sum(s.nbytes for s in specs)


def library_quantize_all(src: Path) -> tuple[float, dict[str, tuple[torch.Tensor, ...]]]:
    """compressed-tensors' NVFP4 compressor, tensor by tensor, with llm-compressor's fused global scales."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam
    from qerl.pipeline.nvfp4.grouping import plan_quantization
    from qerl.pipeline.nvfp4.recipe import QuantizeConfig
    from qerl.pipeline.nvfp4.safetensors_io import read_tensor, safetensors_index

    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    plan = [g for g in plan_quantization(safetensors_index(src), QuantizeConfig()) if g.quantize]
    results = {}
    # Warm-up: the library torch.compiles its FP4 rounding (cast_to_fp4) on first use, and again for
    # dynamic shapes at the second shape it sees. Two shapes here, so the timed loop runs compiled code
    # only: with one, the recompile fell inside the timed loop and its cost followed the inductor cache
    # (a one-off timing of this two-shape warm-up: 28.5 s on a cold cache, 12 s on a warm one).
    for rows, cols in ((32, 64), (48, 128)):
        w = torch.randn(rows, cols)
        s, _ = calculate_qparams(
            w.unflatten(-1, (cols // 16, 16)).amin(-1),
            w.unflatten(-1, (cols // 16, 16)).amax(-1),
            scheme.weights,
            global_scale=generate_gparam(w.amin(), w.amax()),
        )
        NVFP4PackedCompressor.compress(
            {"weight": w, "weight_scale": s, "weight_global_scale": generate_gparam(w.amin(), w.amax())},
            scheme,
        )
    t0 = time.perf_counter()
    for group in plan:
        weights = {s.name: read_tensor(s).float() for s in group.sources}
        gss = [generate_gparam(w.amin(), w.amax()) for w in weights.values()]
        fused_gs = torch.min(torch.cat(gss)).reshape(1)  # llm-compressor: fused layers take the min
        for name, w in weights.items():
            g = w.unflatten(-1, (w.shape[1] // 16, 16))
            scale, _ = calculate_qparams(g.amin(-1), g.amax(-1), scheme.weights, global_scale=fused_gs)
            state = {"weight": w, "weight_scale": scale, "weight_global_scale": fused_gs}
            out = NVFP4PackedCompressor.compress(state, scheme)
            results[name] = (out["weight_packed"], out["weight_scale"], out["weight_global_scale"])
    return time.perf_counter() - t0, results


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def bench_speed(tmp: Path) -> dict:
    from qerl.pipeline.nvfp4.recipe import QuantizeConfig
    from qerl.pipeline.nvfp4.safetensors_io import read_tensor, safetensors_index
    from qerl.pipeline.store.artifact_store import ArtifactStore
    from qerl.stages.quantize import run_with_status

    src = tmp / "qwen05b"
    total = write_random_checkpoint(src, QWEN_05B)
    # warm both JITs on a small tensor so neither side is charged a one-off compile
    from qerl.kernels.nvfp4_dispatch import quantize

    quantize(torch.randn(32, 64))
    store = ArtifactStore(tmp / "store")
    t0 = time.perf_counter()
    manifest, cached = run_with_status(QuantizeConfig(**STAGE), src, store)
    ours = time.perf_counter() - t0
    assert not cached
    t0 = time.perf_counter()
    _, _ = run_with_status(QuantizeConfig(**STAGE), src, store)
    hit = time.perf_counter() - t0
    lib_time, lib = library_quantize_all(src)
    out = safetensors_index(manifest.dir)
    identical = all(
        _same(read_tensor(out[f"{name[: -len('.weight')]}.{sfx}"]), t)
        for name, tensors in lib.items()
        for sfx, t in zip(("weight_packed", "weight_scale", "weight_global_scale"), tensors, strict=True)
    )
    return {
        "bytes": total,
        "tensors": len(lib),
        "ours_s": ours,
        "lib_s": lib_time,
        "cache_hit_s": hit,
        "identical": identical,
        "mode": manifest.mode,
    }


_CHILD = """
import sys, time, json
sys.path.insert(0, {root!r})
from qerl.pipeline.store.artifact_store import ArtifactStore
from qerl.pipeline.nvfp4.recipe import QuantizeConfig
from qerl.stages.quantize import run
t0 = time.perf_counter()
m = run(QuantizeConfig(**{stage!r}), {src!r}, ArtifactStore({store!r}))
hwm = [ln for ln in open("/proc/self/status") if ln.startswith("VmHWM")][0].split()[1]
print(json.dumps({{"seconds": time.perf_counter() - t0, "mode": m.mode, "bytes_out": m.metrics["bytes_out"],
                  "vmhwm": int(hwm) * 1024}}))
"""


_WRITER = """
import sys, time, json
sys.path.insert(0, {root!r})
from benchmarks.bench_quantize import QWEN_7B, write_random_checkpoint
t0 = time.perf_counter()
print(json.dumps({{"bytes": write_random_checkpoint(__import__("pathlib").Path({src!r}), QWEN_7B),
                  "write_s": time.perf_counter() - t0}}))
"""


def _run_child(code: str) -> tuple[dict, int]:
    """Run ``code`` in a fresh interpreter; return its last JSON line and RUSAGE_CHILDREN ru_maxrss (bytes)."""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    if proc.returncode:
        raise RuntimeError(f"benchmark subprocess failed:\n{proc.stderr[-4000:]}")
    maxrss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # max over the children so far
    return json.loads(proc.stdout.strip().splitlines()[-1]), maxrss * 1024


def bench_memory(tmp: Path) -> dict:
    # The random 7B source is written by its own child so this process stays small: Linux carries a
    # parent's RSS high-water mark into a child's ru_maxrss at fork/exec. RUSAGE_CHILDREN after both
    # children is the max of the two, so it is reported next to the quantize child's own VmHWM.
    src = tmp / "qwen7b"
    written, writer_rss = _run_child(_WRITER.format(root=str(ROOT), src=str(src)))
    child, _ = _run_child(
        _CHILD.format(stage=STAGE, root=str(ROOT), src=str(src), store=str(tmp / "store7b"))
    )
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    return {**written, **child, "peak_rss": peak, "writer_rss": writer_rss}


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-7b", action="store_true", help="skip the 7B-shaped memory benchmark")
    parser.add_argument("--tmp", default=None, help="scratch directory (default: system temp)")
    args = parser.parse_args(argv)
    gib = 1 << 30
    lines = [
        "## Quantize stage",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}, "
        f"threads {torch.get_num_threads()}; random bf16 weights; one run each.",
        "",
    ]
    with tempfile.TemporaryDirectory(dir=args.tmp, prefix="qerl-bench-") as tmp_name:
        tmp = Path(tmp_name)
        # memory first, while this process is small: Linux carries the parent's RSS high-water mark into a
        # child's ru_maxrss across fork/exec, so measuring after the speed run would report the parent
        m = None if args.skip_7b else bench_memory(tmp)
        shutil.rmtree(tmp / "qwen7b", ignore_errors=True)
        shutil.rmtree(tmp / "store7b", ignore_errors=True)
        s = bench_speed(tmp)
        ratio = s["lib_s"] / s["ours_s"]
        lines += [
            "### Speed vs compressed-tensors (Qwen2.5-0.5B shapes)",
            "",
            "| what | seconds |",
            "|---|---|",
            f"| our quantize stage ({s['mode']}, quality section off): read, quantize, write, hash into the store | "
            f"{s['ours_s']:.2f} |",
            f"| compressed-tensors NVFP4 compressor, tensor by tensor (read + compress, no write) | {s['lib_s']:.2f} |",
            f"| second run of our stage (cache hit) | {s['cache_hit_s']:.3f} |",
            "",
            f"Speed-up **{ratio:.1f}x** (goal >= 10x) over {s['tensors']} linears ({s['bytes'] / gib:.2f} GiB model); "
            f"outputs bit-identical: **{s['identical']}**.",
            "",
        ]
        shutil.rmtree(tmp / "qwen05b", ignore_errors=True)
        shutil.rmtree(tmp / "store", ignore_errors=True)
        if not args.skip_7b:
            lines += [
                "### Peak memory (Qwen2.5-7B shapes)",
                "",
                "| what | GiB |",
                "|---|---|",
                f"| checkpoint size, i.e. what loading it whole holds | {m['bytes'] / gib:.2f} |",
                f"| peak RSS of the children, getrusage(RUSAGE_CHILDREN).ru_maxrss | {m['peak_rss'] / gib:.2f} |",
                f"| the quantize child's own VmHWM (its peak resident set after exec) | {m['vmhwm'] / gib:.2f} |",
                f"| (the child that wrote the random source, ru_maxrss, for reference) | {m['writer_rss'] / gib:.2f} |",
                f"| NVFP4 checkpoint written | {m['bytes_out'] / gib:.2f} |",
                "",
                f"Goal <= 2 GiB (quantize child's VmHWM): **{'met' if m['vmhwm'] <= 2 * gib else 'missed'}**. Stage wall time "
                f"{m['seconds']:.0f} s ({m['mode']}, includes hashing the source and the output); writing the "
                f"random source took {m['write_s']:.0f} s.",
                "",
            ]
    text = "\n".join(lines)
    out = ROOT / "benchmarks" / "results" / "quantize.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    from benchmarks import write_section

    write_section(out, text)
    print(text)
    return text


if __name__ == "__main__":
    main()
