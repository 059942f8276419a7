"""What each ``quantize.method`` costs in model quality: KL(base||quantized), top-1 agreement, perplexity.

Usage::

    .venv/bin/python benchmarks/quantize_quality.py --model DIR --data-root /work/shared/data \\
        [--methods rtn,mse,gptq,gptq-ao] [--calib 128] [--texts 64] [--work /tmp/qq]

Each method quantizes ``--model`` through the quantize stage (``qerl.stages.quantize``) in a child
process, so its wall time and peak RSS are the stage's alone, then ``qerl.pipeline.nvfp4.quality``
scores the checkpoint on ``--texts`` GSM8K test problems with their reference solutions (prompt +
solution, the solution tokens scored) against the base. ``gptq`` calibrates on ``--calib`` GSM8K
train problems with their solutions (``quantize.calibration.source: gsm8k``); ``gptq-ao`` adds
act-order. Prints one JSON line per method and a markdown table.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

METHODS = {
    "rtn": {"method": "rtn"},
    "mse": {"method": "mse"},
    "gptq": {"method": "gptq"},
    "gptq-ao": {"method": "gptq", "calibration": {"act_order": True}},
}


def _config(name: str, calib: int, max_tokens: int) -> dict:
    cfg = json.loads(json.dumps(METHODS[name]))
    cfg["quality"] = {"enabled": False}  # measured below, apart from the quantize time and memory
    if cfg["method"] == "gptq":
        cfg.setdefault("calibration", {}).update(source="gsm8k", count=calib, max_tokens=max_tokens)
    return cfg


def _peak_rss_mib() -> int:
    """This process's peak RSS: VmHWM of its own memory map. ``ru_maxrss`` would not do: Linux carries
    it across fork + exec, so a child forked from a big parent reports the parent's size."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 1024)
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def quantize_child(model: str, work: str, data_root: str, cfg: dict) -> None:
    """Run the stage once and print {dir, seconds, peak_rss_mib} (this process's own peak)."""
    from qerl.pipeline.data.datasets import DataConfig
    from qerl.pipeline.nvfp4.recipe import QuantizeConfig
    from qerl.pipeline.store.artifact_store import ArtifactStore
    from qerl.stages import quantize

    store = ArtifactStore(Path(work) / "store")
    t0 = time.perf_counter()
    man, cached = quantize.run_with_status(
        QuantizeConfig.model_validate(cfg), model, store, DataConfig(root=data_root)
    )
    out = {
        "dir": str(man.dir),
        "seconds": round(time.perf_counter() - t0, 1),
        "cached": cached,
        "peak_rss_mib": _peak_rss_mib(),
        "calibration": man.extra.get("calibration"),
    }
    print("RESULT " + json.dumps(out))


def measure(args: argparse.Namespace, name: str) -> dict:
    cfg = _config(name, args.calib, args.calib_tokens)
    cmd = [sys.executable, __file__, "--child", json.dumps(cfg), "--model", args.model,
           "--work", args.work, "--data-root", args.data_root]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"quantize {name} failed:\n{proc.stderr[-3000:]}")
    q = json.loads(lines[-1][len("RESULT ") :])
    from qerl.pipeline.data.heldout import held_out_texts
    from qerl.pipeline.nvfp4.loading import load_dequantized
    from qerl.pipeline.nvfp4.quality import model_metrics

    _, items, _ = held_out_texts("gsm8k", args.texts, args.data_root)
    t0 = time.perf_counter()
    m = model_metrics(args.model, q["dir"], items, args.max_tokens, load=load_dequantized)
    return {"method": name, **{k: m[k] for k in ("tokens", "kl", "top1", "ppl_base", "ppl_quant")},
            "quantize_s": q["seconds"], "quantize_peak_rss_mib": q["peak_rss_mib"], "cached": q["cached"],
            "eval_s": round(time.perf_counter() - t0, 1), "calibration": q["calibration"]}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="HF model directory (the base)")
    ap.add_argument(
        "--data-root", required=True, help="directory with gsm8k/train.jsonl and gsm8k/test.jsonl"
    )
    ap.add_argument("--methods", default="rtn,mse,gptq,gptq-ao")
    ap.add_argument("--calib", type=int, default=128, help="GSM8K train problems GPTQ calibrates on")
    ap.add_argument("--calib-tokens", type=int, default=512, help="tokens kept per calibration sequence")
    ap.add_argument("--texts", type=int, default=64, help="GSM8K test problems scored")
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--work", default="/tmp/qerl-quantize-quality")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        quantize_child(args.model, args.work, args.data_root, json.loads(args.child))
        return
    rows = []
    for name in args.methods.split(","):
        row = measure(args, name)
        print(json.dumps(row), flush=True)
        rows.append(row)
    print("\n| method | KL nats/token | top-1 | ppl base | ppl quant | quantize s | peak RSS MiB |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['kl']:.4f} | {r['top1']:.4f} | {r['ppl_base']:.3f} | {r['ppl_quant']:.3f} "
              f"| {r['quantize_s']} | {r['quantize_peak_rss_mib']} |")  # fmt: skip


if __name__ == "__main__":
    main()
