"""GPU benchmark: one GRPO update at the paper's model sizes, NVFP4 base vs bf16 (and NF4), and the kernels.

What, on one CUDA GPU, side by side in one run:

1. Train: one GRPO update (``qerl.pipeline.rl.step.train_step``: LoRA r=32 / alpha 64 on all seven
   projections, gradient checkpointing, bf16 compute, AdamW, one minibatch) on a batch like the
   paper's: 8 sequences (2 prompts x 4 samples) of 256 prompt + 1,024 completion tokens. Models:
   random weights at the shapes of Qwen2.5-7B, -14B and -32B (``qerl.pipeline.planning.model_shape.KNOWN_SHAPES``), built
   directly on the GPU, nothing downloaded. The NVFP4 arm quantizes each projection on the GPU with
   the dispatcher (the Triton kernel on CUDA; q/k/v and gate/up share one global scale, as the quantize
   stage does) and trains on ``NVFP4Linear``; the bf16 arm keeps plain ``nn.Linear`` weights; the nf4
   arm (only with ``--arms``) quantizes each projection on the GPU with bitsandbytes and trains on its
   ``Linear4bit`` under peft's LoRA, as QLoRA and the ``qlora`` ablation arm do. Each
   arm runs in its own process: one warm-up update (it allocates AdamW's state), then ``--steps``
   timed updates (median). Peak memory is ``torch.cuda.max_memory_allocated`` over the timed updates
   (tensors only; the CUDA context is not in it), next to what ``qerl plan`` predicts for the same
   shape and batch. An arm that runs out of memory is recorded as OOM with the phase it died in (the
   paper: bf16 LoRA on 32B does not fit one 80 GB GPU). The arms ``nvfp4-det`` and ``bf16-det``
   (only with ``--arms``) run the same updates under the trainer's deterministic CUDA kernels
   (``train.deterministic``): their time against the plain arm's is what that switch costs at the
   paper's batch. The arm is ``gpu_train_arm.py``, the kernel part ``gpu_kernels.py``.
2. Dequantize: the Triton dequantizer on the largest projections of 7B and 32B, as GB/s of the
   minimal traffic (codes + FP8 scales read, bf16 written) against a device-to-device copy's GB/s
   measured in the same run (the practical bandwidth limit).
3. Dequantize + GEMM (``NVFP4Linear``'s forward) against a bf16 GEMM with the same weight, at decode
   (8 and 64 tokens) and prefill (4,096 tokens) shapes of 7B's projections.

``--dry-run`` runs the same code on the CPU at tiny shapes in seconds (CI exercises it through
``scripts/gpu/gpu_check.sh --dry-run``); there the memory is the child's peak RSS above its baseline and
the kernels are the CPU dispatcher's (numba), so its numbers say nothing about a GPU. Results go to
``gpu.md`` + ``gpu.json`` in ``--out-dir`` (default: benchmarks/results for a CUDA run, never for a
dry run, so BENCHMARKS.md only ever shows GPU numbers), rewritten atomically after every arm so a run
cut off by a time limit keeps what it measured.

Run: ``python benchmarks/bench_gpu.py [--models 7b,14b,32b] [--arms nvfp4,bf16[,nf4,nvfp4-det]] [--steps 2]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PAPER = dict(prompts=2, group=4, prompt=256, completion=1024, rank=32)
DRY = dict(prompts=2, group=2, prompt=16, completion=32, rank=8)
# -det: the same base under train.deterministic's kernels; nf4: QLoRA's base (bitsandbytes Linear4bit)
ARMS = ("nvfp4", "bf16", "nf4", "nvfp4-det", "bf16-det")
DETERMINISTIC = "-det"
TINY_SHAPE = dict(name="tiny", hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=512)


# -- parent ------------------------------------------------------------------------------------------


def _child(args: argparse.Namespace) -> None:
    from qerl.pipeline.planning.model_shape import KNOWN_SHAPES, ModelShape

    from benchmarks.gpu_kernels import kernel_bench
    from benchmarks.gpu_train_arm import train_arm

    device = "cuda" if not args.dry_run else "cpu"
    b = DRY if args.dry_run else PAPER
    b = {**b, **{k: v for k, v in (("prompt", args.prompt), ("completion", args.completion)) if v}}
    if args.child == "kernels":
        result = kernel_bench(device, args.dry_run)
    else:
        shape = ModelShape(**TINY_SHAPE) if args.dry_run else KNOWN_SHAPES[f"qwen2.5-{args.model}"]
        base = args.child.removesuffix(DETERMINISTIC)
        result = train_arm(shape, base, device, b, args.steps, deterministic=args.child != base)
    Path(args.result).write_text(json.dumps(result))


def _run_child(kind: str, model: str | None, args: argparse.Namespace, work: Path) -> dict:
    result = work / f"{kind}-{model}.json"
    cmd = [sys.executable, __file__, "--child", kind, "--result", str(result), "--steps", str(args.steps)]
    cmd += ["--model", model] if model else []
    cmd += ["--dry-run"] if args.dry_run else []
    cmd += [f"--{k}={getattr(args, k)}" for k in ("prompt", "completion") if getattr(args, k)]
    env = {
        **os.environ,
        "TOKENIZERS_PARALLELISM": "false",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    }
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.arm_timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.arm_timeout} s"}
    if proc.returncode != 0 or not result.is_file():
        lines = proc.stderr.strip().splitlines() or ["?"]
        return {"error": lines[-1][:300], "stderr_tail": proc.stderr[-3000:]}
    return {**json.loads(result.read_text()), "wall_s": time.perf_counter() - t0}


def _gib(x: float | None) -> str:
    return "-" if x is None else f"{x / 2**30:.2f}"


def _plan_bytes(shape: Any, base: str, b: dict, device: str) -> int:
    from qerl.pipeline.planning.memory import trainer_peak

    peak = trainer_peak(
        shape,
        base=base,
        batch=b["prompts"] * b["group"],
        seq_len=b["prompt"] + b["completion"],
        completion_len=b["completion"],
        rank=b["rank"],
        device=device,
    )
    return sum(peak.values())


def _train_rows(report: dict) -> list[str]:
    rows = [
        "| model | arm | weights GiB | peak GiB | `qerl plan` GiB | s / update | result |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for arm in report["train"]:
        if arm.get("oom"):
            result = (
                f"**OOM** in {arm['phase']} ({_gib(arm.get('peak_bytes_at_oom'))} GiB allocated at the peak)"
            )
        elif "error" in arm:
            result = f"error in {arm.get('phase', '?')}: `{arm['error']}`"
        else:
            result = f"loss {arm['loss']:.4g}"
        sec = f"{statistics.median(arm['times']):.2f}" if arm.get("times") else "-"
        rows.append(
            f"| {arm['shape']['name']} | {arm.get('arm', arm['base'])} | {_gib(arm.get('weights_bytes'))} | "
            f"{_gib(arm.get('peak_bytes'))} | {_gib(arm['plan_bytes'])} | {sec} | {result} |"
        )
    by_model: dict[str, dict[str, dict]] = {}
    for arm in report["train"]:
        by_model.setdefault(arm["shape"]["name"], {})[arm.get("arm", arm["base"])] = arm
    rows.append("")
    for name, arms in by_model.items():
        a, b = arms.get("nvfp4", {}), arms.get("bf16", {})
        if a.get("peak_bytes") and b.get("peak_bytes"):
            rows.append(
                f"- {name}: NVFP4 / bf16 peak **{a['peak_bytes'] / b['peak_bytes']:.2f}x**, time "
                f"**{statistics.median(a['times']) / statistics.median(b['times']):.2f}x**"
            )
        elif a.get("peak_bytes") and b.get("oom"):
            rows.append(
                f"- {name}: the NVFP4 base trains in {_gib(a['peak_bytes'])} GiB; the bf16 base does not fit"
            )
        q = arms.get("nf4", {})
        if a.get("peak_bytes") and q.get("peak_bytes"):
            rows.append(
                f"- {name}: NVFP4 / NF4 (QLoRA's base) peak **{a['peak_bytes'] / q['peak_bytes']:.2f}x**, time "
                f"**{statistics.median(a['times']) / statistics.median(q['times']):.2f}x**"
            )
        for base in ("nvfp4", "bf16"):
            plain, det = arms.get(base, {}), arms.get(base + DETERMINISTIC, {})
            if plain.get("times") and det.get("times"):
                rows.append(
                    f"- {name}, {base} base: deterministic kernels / default, time "
                    f"**{statistics.median(det['times']) / statistics.median(plain['times']):.2f}x**, peak "
                    f"{det['peak_bytes'] / plain['peak_bytes']:.2f}x"
                )
    return rows


def render(report: dict) -> str:
    b, k = report["batch"], report.get("kernels") or {}
    lines = [
        "## GPU: train step and NVFP4 kernels"
        + (" (CPU DRY RUN: tiny shapes, not GPU numbers)" if report["dry_run"] else ""),
        "",
        f"Machine: {report['device_name']}, {report['cpus']} CPUs, torch {report['torch']}, triton {report['triton']}, "
        f"transformers {report['transformers']}, peft {report['peft']}. One GRPO update: {b['prompts'] * b['group']} "
        f"sequences ({b['prompts']} prompts x {b['group']} samples) of {b['prompt']} prompt + {b['completion']} "
        f"completion tokens in one minibatch, LoRA r{b['rank']} on all seven projections, gradient checkpointing, bf16 "
        "compute, AdamW; random weights at the model's real shape, built on the device. Time: median of "
        f"{report['steps']} updates after a warm-up; peak: `torch.cuda.max_memory_allocated` over them (tensors only, "
        "no CUDA context; on the CPU dry run the child's peak RSS above its baseline). `qerl plan` GiB is the "
        "trainer's peak as `qerl.pipeline.planning.memory.trainer_peak` predicts it. Each arm runs in its own process.",
        "",
        *_train_rows(report),
    ]
    if k and "error" not in k:
        lines += [
            "",
            f"Dequantize ({k['backend']} backend) vs a device-to-device copy at {k['copy_GBps']:.0f} GB/s (read + write):",
            "",
            "| weight | shape | ms | GB/s (codes + scales in, bf16 out) | of copy |",
            "|---|---|---:|---:|---:|",
        ]
        lines += [
            f"| {d['shape']} | {d['out']}x{d['in']} | {d['s'] * 1e3:.3f} | {d['GBps']:.0f} | {d['GBps'] / k['copy_GBps']:.0%} |"
            for d in k["dequant"]
        ]
        lines += [
            "",
            "`NVFP4Linear` forward (dequantize, then the bf16 GEMM) vs the bf16 GEMM alone:",
            "",
            "| projection | weight | tokens | NVFP4 ms | bf16 ms | ratio |",
            "|---|---|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {g['proj']} | {g['out']}x{g['in']} | {g['tokens']} | {g['nvfp4_s'] * 1e3:.3f} | "
            f"{g['bf16_s'] * 1e3:.3f} | {g['nvfp4_s'] / g['bf16_s']:.2f}x |"
            for g in k["gemm"]
        ]
    elif k:
        lines += ["", f"- kernel benchmark failed: `{k['error']}`"]
    return "\n".join(lines) + "\n"


def _versions() -> dict:
    import torch

    info = {"torch": torch.__version__, "cpus": os.cpu_count()}
    for mod in ("triton", "transformers", "peft"):
        try:
            info[mod] = __import__(mod).__version__
        except ImportError:
            info[mod] = "missing"
    cuda = torch.cuda.is_available()
    info["device_name"] = torch.cuda.get_device_name(0) if cuda else f"CPU ({platform.machine()})"
    if cuda:
        info["gpu_memory_bytes"] = torch.cuda.get_device_properties(0).total_memory
    return info


def _merge_previous(report: dict, path: Path, models: list[str], arms: list[str]) -> None:
    """Keep an earlier run's rows that this run does not measure again (other models, or other arms
    of the same model) and its kernels, so one results file can be filled over several time-limited
    calls. Only runs of the same batch, steps and device merge; anything else is an error, not a
    silent mix."""
    if not path.is_file():
        return
    old = json.loads(path.read_text())
    same = {k: old.get(k) for k in ("batch", "steps", "device_name", "mode")}
    if same != {k: report[k] for k in same}:
        raise SystemExit(f"bench_gpu --merge: {path} is from another setup ({same}); move it away first")
    names = {f"qwen2.5-{m}" for m in models} | set(models)
    report["train"] = [
        a
        for a in old.get("train", [])
        if a["shape"]["name"] not in names or a.get("arm", a["base"]) not in arms
    ]
    report["kernels"] = old.get("kernels")


def main(args: argparse.Namespace) -> dict:
    import tempfile

    import torch
    from qerl.pipeline.planning.model_shape import KNOWN_SHAPES, ModelShape
    from qerl.pipeline.store.files import atomic_write_json

    from benchmarks import write_section

    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit(
            "bench_gpu: no CUDA device here; --dry-run runs the same code at tiny shapes on the CPU"
        )
    out_dir = Path(args.out_dir) if args.out_dir else ROOT / "benchmarks" / "results"
    if args.dry_run and out_dir.resolve() == (ROOT / "benchmarks" / "results").resolve():
        raise SystemExit("bench_gpu: a dry run must not write benchmarks/results (pass --out-dir)")
    b = {**(DRY if args.dry_run else PAPER)}
    b.update({k: getattr(args, k) for k in ("prompt", "completion") if getattr(args, k)})
    report: dict[str, Any] = {
        **_versions(),
        "dry_run": args.dry_run,
        "mode": "dry-run-cpu" if args.dry_run else "cuda",
        "batch": b,
        "steps": args.steps,
        "train": [],
        "kernels": None,
    }
    models = ["tiny"] if args.dry_run else args.models.split(",")
    if args.merge:
        _merge_previous(report, out_dir / "gpu.json", models, args.arms.split(","))

    def save() -> None:
        atomic_write_json(out_dir / "gpu.json", report)
        write_section(out_dir / "gpu.md", render(report))

    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="qerl-bench-gpu-") as tmp:
        if not args.skip_kernels:
            report["kernels"] = _run_child("kernels", None, args, Path(tmp))
            save()
        for model in models:
            shape = ModelShape(**TINY_SHAPE) if args.dry_run else KNOWN_SHAPES[f"qwen2.5-{model}"]
            for name in args.arms.split(","):
                print(f"bench_gpu: {shape.name} {name} ...", flush=True)
                arm = _run_child(name, model, args, Path(tmp))
                base = name.removesuffix(DETERMINISTIC)
                arm.update(
                    shape=shape.__dict__,
                    arm=name,
                    base=base,
                    deterministic=name != base,
                    device="cpu" if args.dry_run else "cuda",
                    batch=b["prompts"] * b["group"],
                    prompt=b["prompt"],
                    completion=b["completion"],
                    rank=b["rank"],
                    plan_bytes=_plan_bytes(shape, base, b, "cpu" if args.dry_run else "cuda"),
                )
                report["train"].append(arm)
                save()
                print(
                    f"bench_gpu: {shape.name} {name}: peak {_gib(arm.get('peak_bytes'))} GiB, "
                    f"{'OOM' if arm.get('oom') else arm.get('error', 'ok')}",
                    flush=True,
                )
    print(render(report))
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (CI)")
    parser.add_argument(
        "--models",
        default="7b,14b,32b",
        help="Qwen2.5 sizes from qerl.pipeline.planning.model_shape.KNOWN_SHAPES",
    )
    parser.add_argument(
        "--arms",
        default="nvfp4,bf16",
        help=f"comma-separated, of {list(ARMS)} (-det: train.deterministic's kernels; its time against "
        "the arm without is what the switch costs)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="timed updates per arm after one warm-up (default 2; dry run 1)",
    )
    parser.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 256; dry run 16)")
    parser.add_argument(
        "--completion", type=int, default=None, help="completion tokens (default 1024; dry run 32)"
    )
    parser.add_argument("--arm-timeout", type=float, default=300.0, help="seconds before an arm is abandoned")
    parser.add_argument("--skip-kernels", action="store_true")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the rows of --out-dir/gpu.json this run does not measure again (other models or arms)",
    )
    parser.add_argument(
        "--out-dir", default=None, help="where gpu.md/gpu.json go (default benchmarks/results)"
    )
    parser.add_argument("--child", choices=[*ARMS, "kernels"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = sorted(set(args.arms.split(",")) - set(ARMS))
    if unknown:
        parser.error(f"unknown arm(s) {unknown}; choose from {list(ARMS)}")
    if args.steps is None:
        args.steps = 1 if args.dry_run else 2
    return args


if __name__ == "__main__":
    cli = parse_args()
    if cli.child:
        _child(cli)
    else:
        main(cli)
