"""Benchmark: what ``quantize.method: gptq`` costs in host memory and time at 7B shapes.

GPTQ calibrates one decoder layer at a time (``qerl.pipeline.nvfp4.calibration``), so its host
memory is one layer's float32 weights, one ``in x in`` float32 Hessian per fused group (the largest
is down_proj's, intermediate x intermediate) with GPTQ's inverse factor beside it, and the
calibration hidden states (tokens x hidden, float32, this layer's input and output). This runs the
real path (``gptq_layers`` over a ``plan_quantization`` plan) on one decoder layer of Qwen2.5-7B's
shape (hidden 3584, intermediate 18944, 28 heads, 4 KV heads; random weights, a 512-token
vocabulary, since the embedding only feeds the layer) with a few calibration sequences, in a child
process whose peak RSS (VmHWM) is read at the end, and splits the time into the Hessians and
forwards (linear in tokens) and GPTQ itself (independent of them). From these it states the
whole model's cost at the default calibration (128 sequences x up to 512 tokens): peak RSS = the
measured peak + the hidden states of the extra tokens, time = 28 x (GPTQ + per-token time x tokens).

The machine is the 2-core CPU box; timings taken while other jobs run are marked as such by the
caller (``--note``).

Run: ``.venv/bin/python benchmarks/bench_gptq_shapes.py [--sequences 8 --tokens 512] [--note TEXT]``
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPE = dict(hidden_size=3584, num_layers=1, num_heads=28, num_kv_heads=4, intermediate_size=18944)
LAYERS_7B = 28
DEFAULT_TOKENS = 128 * 512  # quantize.calibration: count 128 x max_tokens 512 (an upper bound)


def _vm(field: str) -> int:
    """A /proc/self/status memory field in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


@contextlib.contextmanager
def timed_gptq_phases(cuda: bool = False) -> Iterator[dict[str, float]]:
    """Seconds spent inside, by calibration's two phases: the Hessians and forwards (linear in the
    calibration tokens) and GPTQ itself; ``cuda`` waits for the GPU before each reading. The
    calibration module's functions are wrapped while inside and restored after."""
    import torch
    from qerl.pipeline.nvfp4 import calibration

    timed = {"hessians_and_forwards": 0.0, "gptq": 0.0}

    def timed_as(key: str, fn):  # noqa: ANN001, ANN202
        def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if cuda:
                    torch.cuda.synchronize()
                timed[key] += time.perf_counter() - t0

        return wrapper

    saved = calibration._collect_hessians, calibration._quantize_group
    calibration._collect_hessians = timed_as("hessians_and_forwards", calibration._collect_hessians)
    calibration._quantize_group = timed_as("gptq", calibration._quantize_group)
    try:
        yield timed
    finally:
        calibration._collect_hessians, calibration._quantize_group = saved


def worker(model_dir: Path, sequences: int, tokens: int) -> dict:
    """One layer's GPTQ in this process: seconds of the two phases, peak and baseline RSS."""
    import torch
    from qerl.pipeline.nvfp4 import calibration
    from qerl.pipeline.nvfp4.grouping import plan_quantization
    from qerl.pipeline.nvfp4.recipe import QuantizeConfig
    from qerl.pipeline.nvfp4.safetensors_io import safetensors_index

    torch.manual_seed(0)
    cfg = QuantizeConfig(method="gptq")
    specs = safetensors_index(model_dir)
    plan = plan_quantization(specs, cfg)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    ids = [torch.randint(0, vocab, (tokens,)).tolist() for _ in range(sequences)]
    baseline = _vm("VmRSS")
    with timed_gptq_phases() as timed:
        t0 = time.perf_counter()
        outputs = sum(len(out) for _, out in calibration.gptq_layers(model_dir, specs, plan, cfg, ids))
        total = time.perf_counter() - t0
    return {
        "seconds": total,
        **timed,
        "tensors": outputs,
        "peak_rss": _vm("VmHWM"),
        "baseline_rss": baseline,
        "threads": torch.get_num_threads(),
    }


def factor_worker(rule: str, size: int) -> dict:
    """Peak RSS of GPTQ's inverse Hessian factor at ``size`` inputs: ``qerl`` (the shipped
    ``inverse_hessian_factor``) or ``textbook`` (the same float64 steps with every intermediate kept,
    as the code was before it freed them)."""
    import torch
    from qerl.pipeline.nvfp4.gptq import inverse_hessian_factor

    torch.manual_seed(0)
    x = torch.randn(2048, size)
    h = 2 * (x.T @ x) / x.shape[0]
    del x
    before = _vm("VmRSS")
    t0 = time.perf_counter()
    if rule == "qerl":
        u = inverse_hessian_factor(h, 0.01)
    else:
        d = h.double().clone()
        d.diagonal().add_(0.01 * d.diagonal().mean())
        chol = torch.linalg.cholesky(d)
        hinv = torch.cholesky_inverse(chol)
        u = torch.linalg.cholesky(hinv, upper=True).float()
    return {"rule": rule, "seconds": time.perf_counter() - t0, "peak_rss": _vm("VmHWM"), "before": before,
            "u_sum": float(u.double().sum())}  # fmt: skip


def main() -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sequences", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=512, help="tokens per calibration sequence")
    ap.add_argument("--note", default="", help="a line on the machine's load, printed with the result")
    ap.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--factor-worker", choices=["qerl", "textbook"], default=None, help=argparse.SUPPRESS)
    ap.add_argument(
        "--factor-only", action="store_true", help="only the inverse Hessian factor at down_proj's size"
    )
    args = ap.parse_args()
    if args.worker is not None:
        print(json.dumps(worker(args.worker, args.sequences, args.tokens)))
        return ""
    if args.factor_worker is not None:
        print(json.dumps(factor_worker(args.factor_worker, SHAPE["intermediate_size"])))
        return ""
    factors = [_child(["--factor-worker", rule]) for rule in ("textbook", "qerl")]
    if args.factor_only:
        text = factor_report(factors, args.note)
        print(text)
        return text
    from qerl.pipeline.demo.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "layer", vocab_size=512, **SHAPE)
        r = _child(["--worker", str(model), "--sequences", str(args.sequences), "--tokens", str(args.tokens)])
    text = report(r, args.sequences * args.tokens, args.note) + "\n" + factor_report(factors, "")
    print(text)
    from benchmarks import write_section

    write_section(Path(__file__).resolve().parent / "results" / "gptq-shapes.md", text)
    return text


def _child(args: list[str]) -> dict:
    """Run this script with ``args`` in a fresh process (its own peak RSS); its JSON result."""
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"worker {args} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def factor_report(factors: list[dict], note: str) -> str:
    gib = 1 << 30
    size = SHAPE["intermediate_size"]
    lines = [
        f"GPTQ's inverse Hessian factor alone at down_proj's {size} inputs (a {size}x{size} float32 Hessian, "
        f"{size * size * 4 / gib:.2f} GiB, is held before it starts), each in a fresh process. {note}".rstrip(),
        "",
        "| factorisation | peak RSS | above the Hessian | seconds |",
        "|---|---:|---:|---:|",
    ]
    for f in factors:
        what = {"textbook": "every float64 intermediate kept (before 956ddbd)", "qerl": "intermediates freed"}
        lines.append(
            f"| {what[f['rule']]} | {f['peak_rss'] / gib:.2f} GiB | {(f['peak_rss'] - f['before']) / gib:.2f} GiB "
            f"| {f['seconds']:.0f} |"
        )
    same = len({round(f["u_sum"], 6) for f in factors}) == 1
    lines += ["", f"Both give the same factor: {'yes' if same else 'NO'} (sum of U's entries).", ""]
    return "\n".join(lines)


def report(r: dict, tokens: int, note: str) -> str:
    gib = 1 << 30
    hidden = SHAPE["hidden_size"]
    extra_hidden = 2 * (DEFAULT_TOKENS - tokens) * hidden * 4  # a layer's input and output, float32
    per_token = r["hessians_and_forwards"] / tokens
    whole = LAYERS_7B * (r["gptq"] + per_token * DEFAULT_TOKENS)
    return "\n".join(
        [
            "## gptq-shapes",
            "",
            "`benchmarks/bench_gptq_shapes.py`: `quantize.method: gptq` on one decoder layer of Qwen2.5-7B's "
            f"shape (random weights), {tokens:,} calibration tokens, float32 on the CPU "
            f"({r['threads']} torch threads). {note}".rstrip(),
            "",
            "| measured, one layer | value |",
            "|---|---:|",
            f"| peak RSS of the process | {r['peak_rss'] / gib:.2f} GiB |",
            f"| RSS before calibration (imports, plan) | {r['baseline_rss'] / gib:.2f} GiB |",
            f"| Hessians and forwards ({tokens:,} tokens) | {r['hessians_and_forwards']:.1f} s |",
            f"| GPTQ of the layer's 4 groups | {r['gptq']:.1f} s |",
            f"| whole layer | {r['seconds']:.1f} s |",
            "",
            f"Derived for the whole 7B model at the default calibration (128 x 512 = {DEFAULT_TOKENS:,} "
            "tokens at most): peak host RSS about "
            f"{(r['peak_rss'] + extra_hidden) / gib:.1f} GiB (the measured peak plus "
            f"{extra_hidden / gib:.2f} GiB of hidden states for the extra tokens), and about "
            f"{whole / 60:.0f} min on this CPU ({LAYERS_7B} layers x (GPTQ + "
            f"{per_token * 1e3:.2f} ms per token)). The cost is paid once: the checkpoint is cached by "
            "the recipe and the calibration digest.",
            "",
        ]
    )


if __name__ == "__main__":
    main()
