"""The validation's item 5: GPTQ's time on one 7B decoder layer on CUDA, and the quality report's peak
GPU memory at 7B's shapes.

What, on one CUDA GPU (``scripts/gpu/gpu_validate.sh`` runs it through ``gpu_check.sh --exec-py``):

1. GPTQ: a model of Qwen2.5-7B's matrix shapes with ``--layers`` decoder layers (default 1: hidden 3584,
   intermediate 18944, 28 x 128 heads, 4 KV heads; random weights, the locally trained tokenizer's
   vocabulary), calibrated on ``--sequences`` x ``--tokens`` random token ids with the quantize stage's
   own GPTQ path (``calibration.gptq_layers``) on ``cuda``. Reported: the seconds per decoder layer,
   split into the Hessians and forwards (linear in tokens) and GPTQ itself, and the GPU's peak memory.
   A 7B model's GPTQ is about 28 times the per-layer time (the benchmark on the CPU,
   ``benchmarks/bench_gptq_shapes.py``, states the same split for the CPU).
2. The quality report: the quality stage (``qerl.stages.quality``, on an RTN checkpoint of the same
   model, ``--texts`` held-out arithmetic texts), on the GPU, with the peak of ``torch.cuda.max_memory_allocated``
   over the stage. The quality section holds one fp32 model at a time, so the peak is one model's fp32
   weights and a batch's activations: the whole 7B's is the measured peak plus the fp32 bytes of the
   layers and the vocabulary rows this model leaves out (``projected_peak_gib``, Qwen2.5-7B's 28
   layers and 152,064-token vocabulary, untied).

``--dry-run``: the same code on the CPU at a tiny shape in seconds (the test suite runs it); the peaks
are then the process's peak RSS, and no number says anything about a GPU.

Results: ``quantize-7b.json`` and ``quantize-7b.md`` in ``--out-dir`` (default ``$OUT``), the GPTQ part written as soon
as it is measured, so a run cut during the quality part keeps it.

Run: ``python scripts/gpu/gpu_quantize_7b.py [--layers 1] [--sequences 8 --tokens 512] [--texts 16]
[--out-dir DIR] [--dry-run]``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # after what PYTHONPATH puts first (the environment's own qerl)

SHAPE_7B = dict(hidden_size=3584, num_heads=28, num_kv_heads=4, intermediate_size=18944)
LAYERS_7B, VOCAB_7B = 28, 152064
TINY = dict(hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=256)
GIB = 1 << 30


def layer_params(shape: dict[str, int]) -> int:
    """Weights of one Qwen2-style decoder layer (projections, q/k/v biases, two norms)."""
    h, i = shape["hidden_size"], shape["intermediate_size"]
    kv = h // shape["num_heads"] * shape["num_kv_heads"]
    return h * h * 2 + h * kv * 2 + (h + 2 * kv) + 3 * h * i + 2 * h


def projected_peak(measured: int, shape: dict[str, int], layers: int, vocab: int) -> int:
    """The quality pass's peak for the whole 7B: the measured one plus the fp32 bytes of the layers
    and the (untied: embedding and head) vocabulary rows the measured model did not hold."""
    extra_layers = (LAYERS_7B - layers) * layer_params(shape) * 4
    extra_vocab = (VOCAB_7B - vocab) * shape["hidden_size"] * 4 * 2
    return measured + extra_layers + extra_vocab


def _peak(cuda: bool) -> int:
    import torch

    if cuda:
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated())
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def gptq_layer(model_dir: Path, sequences: int, tokens: int, device: str) -> dict[str, Any]:
    """GPTQ over every decoder layer of ``model_dir`` on ``device``: seconds (and per layer), split."""
    import torch
    from qerl.pipeline.nvfp4 import calibration
    from qerl.pipeline.nvfp4.grouping import plan_quantization
    from qerl.pipeline.nvfp4.recipe import QuantizeConfig
    from qerl.pipeline.nvfp4.safetensors_io import safetensors_index

    from benchmarks.bench_gptq_shapes import timed_gptq_phases

    cuda = device == "cuda"
    torch.manual_seed(0)
    cfg = QuantizeConfig(method="gptq")
    specs = safetensors_index(model_dir)
    plan = plan_quantization(specs, cfg)
    config = json.loads((model_dir / "config.json").read_text())
    ids = [torch.randint(0, config["vocab_size"], (tokens,)).tolist() for _ in range(sequences)]
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    with timed_gptq_phases(cuda) as timed:
        t0 = time.perf_counter()
        n = sum(
            len(out) for _, out in calibration.gptq_layers(model_dir, specs, plan, cfg, ids, device=device)
        )
        seconds = time.perf_counter() - t0
    layers = config["num_hidden_layers"]
    return {
        "device": device, "layers": layers, "sequences": sequences, "tokens": tokens, "tensors": n,
        "seconds": round(seconds, 3), "seconds_per_layer": round(seconds / layers, 3),
        **{k: round(v, 3) for k, v in timed.items()},
        "peak_gib": round(_peak(cuda) / GIB, 3),
        "whole_7b_seconds_estimate": round(seconds / layers * LAYERS_7B, 1),
    }  # fmt: skip


def quality_peak(model_dir: Path, store: Path, texts: int, device: str, shape: dict, layers: int) -> dict:
    """The quantize stage (RTN) then the quality stage on ``model_dir``: the quality's seconds and
    the peak memory over both."""
    import torch
    from qerl.pipeline.data.heldout import held_out_texts
    from qerl.pipeline.nvfp4.recipe import QuantizeConfig
    from qerl.pipeline.store.artifact_store import ArtifactStore
    from qerl.stages import quality as quality_stage
    from qerl.stages import quantize

    cuda = device == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    cfg = QuantizeConfig(method="rtn", quality={"enabled": True, "source": "arithmetic", "texts": texts})
    t0 = time.perf_counter()
    checkpoint = quantize.run(cfg, model_dir, ArtifactStore(store))
    held_out = held_out_texts("arithmetic", texts)
    manifest = quality_stage.run(cfg.quality, checkpoint, model_dir, ArtifactStore(store), held_out)
    seconds = time.perf_counter() - t0
    peak = _peak(cuda)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    quality = manifest.extra.get("quality", {})
    return {
        "device": device, "texts": texts, "tokens": quality.get("tokens"), "kl": quality.get("kl"),
        "stage_seconds": round(seconds, 3),
        "quality_seconds": round(manifest.metrics.get("seconds", 0.0), 3),
        "peak_gib": round(peak / GIB, 3), "layers": layers, "vocab": vocab,
        "projected_peak_gib": round(projected_peak(peak, shape, layers, vocab) / GIB, 2) if cuda else None,
    }  # fmt: skip


def report(results: dict[str, Any]) -> str:
    g, q = results.get("gptq"), results.get("quality")
    lines = [
        f"## Quantize at 7B's shapes on {results['device']} ({results['shape']}, {results['layers']} layer(s))",
        "",
    ]
    if g:
        lines.append(
            f"GPTQ: {g['seconds_per_layer']} s a decoder layer ({g['hessians_and_forwards']} s Hessians and "
            f"forwards, {g['gptq']} s GPTQ; {g['sequences']} x {g['tokens']} calibration tokens), peak "
            f"{g['peak_gib']} GiB; 28 layers: about {g['whole_7b_seconds_estimate']} s."
        )
    if q:
        lines.append(
            f"Quality report: {q['quality_seconds']} s over {q['tokens']} tokens, peak {q['peak_gib']} GiB with "
            f"{q['layers']} layer(s) and a {q['vocab']}-token vocabulary; projected for the whole 7B: "
            + (
                f"{q['projected_peak_gib']} GiB."
                if q["projected_peak_gib"] is not None
                else "none (not a GPU)."
            )
        )
    if results.get("error"):
        lines.append(f"Error: {results['error']}")
    return "\n".join(lines) + "\n"


def _write(results: dict[str, Any], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "quantize-7b.json").write_text(json.dumps(results, indent=1) + "\n")
    (out_dir / "quantize-7b.md").write_text(report(results))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=1, help="decoder layers of 7B's shape (default 1)")
    ap.add_argument("--sequences", type=int, default=8, help="GPTQ calibration sequences")
    ap.add_argument("--tokens", type=int, default=512, help="tokens per calibration sequence")
    ap.add_argument("--texts", type=int, default=16, help="held-out texts of the quality report")
    ap.add_argument("--out-dir", type=Path, default=os.environ.get("OUT"), help="default: $OUT (the kit's)")
    ap.add_argument(
        "--work-dir", type=Path, default=None, help="where the model is built (default: a temporary folder)"
    )
    ap.add_argument("--dry-run", action="store_true", help="the CPU, a tiny shape, seconds")
    args = ap.parse_args(argv)
    if args.out_dir is None:
        ap.error("--out-dir (or $OUT) is needed")
    if args.layers < 1:
        ap.error("--layers must be at least 1")
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_quantize_7b: no CUDA device (use --dry-run on a CPU)", file=sys.stderr)
        return 2
    from qerl.pipeline.demo.tiny_model import build_tiny_model

    device = "cpu" if args.dry_run else "cuda"
    shape = TINY if args.dry_run else SHAPE_7B
    sequences, tokens = (2, 32) if args.dry_run else (args.sequences, args.tokens)
    texts = 4 if args.dry_run else args.texts
    results: dict[str, Any] = {
        "device": device,
        "shape": "tiny" if args.dry_run else "qwen2.5-7b",
        "layers": args.layers,
    }
    with tempfile.TemporaryDirectory(prefix="qerl-quantize-7b-") as tmp:
        work = args.work_dir or Path(tmp)
        model_dir = work / "model"
        t0 = time.perf_counter()
        build_tiny_model(
            model_dir, vocab_size=512 if args.dry_run else 4096, num_layers=args.layers, seed=0, **shape
        )
        results["build_seconds"] = round(time.perf_counter() - t0, 1)
        try:
            results["gptq"] = gptq_layer(model_dir, sequences, tokens, device)
            _write(results, args.out_dir)
            results["quality"] = quality_peak(model_dir, work / "store", texts, device, shape, args.layers)
        except Exception as err:  # keep what was measured, name what failed
            results["error"] = f"{type(err).__name__}: {err}"
            _write(results, args.out_dir)
            print(report(results), file=sys.stderr)
            return 1
    _write(results, args.out_dir)
    print(report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
