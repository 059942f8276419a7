"""What ``bench_vllm.py`` reads from its arms and writes: the memory figures in vLLM's start-up log,
the root cause of a failed arm, and the markdown table (``vllm.md``) with ``qerl plan``'s vLLM rows
beside what vLLM logged."""

from __future__ import annotations

import re
from typing import Any

# what vLLM logs about its memory at start-up (vLLM 0.26-0.32 wording), in GiB unless named
VLLM_REPORTS = {
    "weights": r"Model loading took ([\d.]+) ?GiB",
    "kv_cache": r"Available KV cache memory: ([\d.]+) ?GiB",
    "cuda_graphs": r"Graph capturing finished in \d+ secs, took ([\d.]+) ?GiB",
    "non_kv": r"Total non KV cache memory: ([\d.]+) ?GiB",
    "kv_cache_tokens": r"KV cache size: ([\d,]+) tokens",
}


def vllm_reported(log: str) -> dict[str, float]:
    """What vLLM's start-up log says about its memory (the last of each line; GiB, tokens)."""
    found = {}
    for name, pattern in VLLM_REPORTS.items():
        hits = re.findall(pattern, log)
        if hits:
            found[name] = float(hits[-1].replace(",", ""))
    return found


def root_cause(log: str) -> str:
    """The first exception line of a failed child, and the last: vLLM's engine core fails in its own
    process, and the parent's last lines only say "Engine core initialization failed"."""
    errors = [
        ln.strip() for ln in log.splitlines() if re.search(r"(?:^|[\s)])[\w.]*(?:Error|Exception): ", ln)
    ]
    if not errors:
        return " | ".join(log.strip().splitlines()[-5:])
    return errors[0] if len(errors) == 1 else f"{errors[0]} ... {errors[-1]}"


def report(results: dict[str, Any]) -> str:
    """The markdown table of ``results`` (what ``main`` writes as vllm.md)."""
    lines = [
        "## vLLM rollout throughput: FP4 Marlin vs bf16 (bench_vllm.py)",
        "",
        f"mode: {results['mode']}; {results['prompts']} prompts x {results['n']} samples, up to "
        f"{results['max_new_tokens']} new tokens, temperature 1; {results['machine']}"
        + (f"; code {results['code']}" if results.get("code") else "")
        + (
            f"; generate s: the median of {results['repeats']} calls (min-max)"
            if results.get("repeats", 1) > 1
            else ""
        ),
        "",
        "| model | arm | engine mode | start-up s | tokens | generate s | tokens/s | ratio |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for model, arms in results["models"].items():
        rates = {a: r.get("tokens_per_s") for a, r in arms.items()}
        for arm, r in arms.items():
            if "error" in r:
                lines.append(f"| {model} | {arm} | failed: {r['error'][:300]} | | | | | |")
                continue
            over = {"nvfp4": "bf16", "nvfp4-aqn": "nvfp4"}.get(arm)  # nvfp4 / bf16; aqn / nvfp4
            ratio = f"{rates[arm] / rates[over]:.2f}x of {over}" if over and rates.get(over) else ""
            if "aqn_sigma_realised" in r:
                ratio += f"; realised sigma {r['aqn_sigma_realised'] / r['aqn_sigma']:.3f}x"
            spread = r.get("seconds_all") or []
            took = f"{r['seconds']:.2f}" + (
                f" ({min(spread):.2f}-{max(spread):.2f})" if len(spread) > 1 else ""
            )
            lines.append(
                f"| {model} | {arm} | {r['mode']} | {r['startup_s']:.1f} | {r['tokens']} | "
                f"{took} | {r['tokens_per_s']:.0f} | {ratio} |"
            )
    lines += _plan_lines(results)
    return "\n".join(lines) + "\n"


def _plan_lines(results: dict[str, Any]) -> list[str]:
    """``qerl plan``'s vLLM rows beside what vLLM logged, GiB (CUDA runs only)."""
    rows = []
    for model, arms in results["models"].items():
        for arm, r in arms.items():
            planned, seen = r.get("planned_gib") or {}, r.get("reported") or {}
            for name in ("weights", "cuda_graphs", "kv_cache"):
                if name in planned or name in seen:
                    p, v = planned.get(name), seen.get(name)
                    rows.append(
                        f"| {model} | {arm} | {name} | {'' if p is None else f'{p:.2f}'} | "
                        f"{'' if v is None else f'{v:.2f}'} |"
                    )
    if not rows:
        return []
    head = [
        "",
        "qerl plan's vLLM rows against what vLLM logged (GiB):",
        "",
        "| model | arm | row | plan | vLLM |",
    ]
    return head + ["|---|---|---|---:|---:|"] + rows
