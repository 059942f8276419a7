"""Benchmark: what fp32 noisy norm weights cost the CPU rollout engines (bf16 model), and what they buy.

``qerl.pipeline.rollout.aqn`` keeps the RMSNorm weights of a noisy step in fp32, so the norm computes
``(x_hat_fp32 * w_fp32).to(bf16)`` instead of vLLM's/transformers' bf16 path. This times one
generate call per arm on the same engine, arms interleaved over ``--repeats`` rounds (the machine
is shared; the median of the rounds is reported, with min and max):
- ``clean``: sigma 0, the original bf16 norm weights (the path of a never-noised engine);
- ``aqn-fp32``: sigma 5e-4 (the 7B schedule's last stage), fp32 norm weights.
It also prints the realised sigma of each engine at the schedule's ends, and (first, as engine
timings on a shared machine vary by tens of percent) the norm alone: vLLM's native ``rms_norm`` and
``fused_add_rms_norm`` (what its CPU RMSNorm runs) and transformers' Qwen2RMSNorm forward against
the fp32-weight forward, bf16 inputs of a decode step ([64, hidden]) and a prefill ([2048, hidden]),
in CPU time of one torch thread (robust to other jobs), median over interleaved rounds. The model: random bf16
weights, Qwen2-shaped, smaller than the 0.5B of ``bench_rollout.py`` (hidden 512, 8 layers) so a
run takes a few minutes on two cores. vLLM runs in-process and eager (``enforce_eager``: the mode
whose norms become fp32; under compiled graphs the write stays bf16). GPU cost is not measured
here (no GPU): there an eager engine moves from vLLM's fused C RMSNorm to the native one (a few
elementwise kernels per norm), a compiled engine's norms are Inductor-generated either way.

``--compiled``: instead, vLLM's engine with torch.compile (``enforce_eager: false``, as every GPU
preset), built twice: not for AQN (the noise is written in bf16 into what the graphs captured) and
for AQN (``build_engine(..., aqn=True)``: the norms fp32 from the load on). For each: the realised
sigma at every stage of the 7B preset's schedule, and tokens/s clean and noisy, interleaved.

Run: ``.venv/bin/python benchmarks/bench_aqn_dtype.py [--prompts 8 --n 4 --max-new-tokens 64 --repeats 3]
[--micro-only | --compiled]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from qerl.pipeline.data.arithmetic import arithmetic_problems  # noqa: E402
from qerl.pipeline.data.prompts import render_prompt  # noqa: E402
from qerl.pipeline.demo.tiny_model import build_tiny_model  # noqa: E402
from qerl.pipeline.rollout.config import RolloutConfig  # noqa: E402

SHAPE = dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=2, intermediate_size=1536)
ARMS = {"clean": 0.0, "aqn-fp32": 5e-4}


def _rates(engine, prompts: list[str], cfg: RolloutConfig, n: int, repeats: int) -> dict[str, list[float]]:
    engine.generate(prompts, n, cfg.sampling().__class__(max_new_tokens=8), seed=123)  # warm-up
    rates: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for _ in range(repeats):
        for arm, sigma in ARMS.items():
            engine.set_noise(sigma, 7)
            start = time.perf_counter()
            out = engine.generate(prompts, n, cfg.sampling(), seed=0)
            seconds = time.perf_counter() - start
            rates[arm].append(sum(len(c.completion_ids) for row in out for c in row) / seconds)
    engine.set_noise(0.0, 0)
    return rates


def _median_us(fns: dict[str, object], rounds: int = 31, inner: int = 20) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.thread_time()  # this thread's CPU time: robust to a shared, loaded machine
            for _ in range(inner):
                fn()  # type: ignore[operator]
            times[name].append((time.thread_time() - start) / inner * 1e6)
    return {name: statistics.median(values) for name, values in times.items()}


def norm_micro(hidden: int) -> None:
    """CPU microseconds per norm call (one torch thread), 16-bit vs fp32 weight (the AQN path)."""
    from qerl.pipeline.rollout.aqn import _rmsnorm_fp32_weight
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
    from vllm import ir

    rms = ir.ops.rms_norm.impls["native"].impl_fn
    fused = ir.ops.fused_add_rms_norm.impls["native"].impl_fn
    gen = torch.Generator().manual_seed(0)
    w16 = (1 + 0.05 * torch.randn(hidden, generator=gen)).to(torch.bfloat16)
    w32 = w16.float() + 5e-4 * torch.randn(hidden, generator=gen)
    hf_norm = Qwen2RMSNorm(hidden).to(torch.bfloat16)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # thread CPU time counts this thread only
    for tokens in (64, 2048):
        x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
        r = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
        with torch.no_grad():
            us = _median_us(
                {
                    "vllm rms_norm bf16": lambda x=x: rms(x, w16, 1e-6),
                    "vllm rms_norm fp32": lambda x=x: rms(x, w32, 1e-6),
                    "vllm fused_add bf16": lambda x=x, r=r: fused(x, r, w16, 1e-6),
                    "vllm fused_add fp32": lambda x=x, r=r: fused(x, r, w32, 1e-6),
                    "hf norm bf16": lambda x=x: hf_norm(x),
                    "hf norm fp32": lambda x=x: _rmsnorm_fp32_weight(hf_norm, x),
                }
            )
        print(f"norm alone, [{tokens}, {hidden}] bf16 input (CPU us/call, 1 thread, median of 31 rounds):")
        for pair in ("vllm rms_norm", "vllm fused_add", "hf norm"):
            a, b = us[f"{pair} bf16"], us[f"{pair} fp32"]
            print(f"  {pair:15s} bf16 weight {a:8.1f}  fp32 weight {b:8.1f}  ratio {b / a:.3f}")
    torch.set_num_threads(threads)


def _realised(engine) -> str:
    parts = [f"{sigma:g} -> {engine.set_noise(sigma, 7):.4g}" for sigma in (1e-2, 5e-4)]
    engine.set_noise(0.0, 0)
    return ", ".join(parts)


def compiled(args: argparse.Namespace, model_dir: Path, questions: list[str]) -> None:
    """The compiled vLLM engine not built and built for AQN: realised sigma per stage, tokens/s."""
    from qerl.pipeline.rollout.aqn import AQNConfig, sigma_schedule
    from qerl.pipeline.rollout.vllm_engine import VLLMEngine

    schedule = AQNConfig()  # the 7B preset's: K = 10, 1e-2 -> 5e-4
    sigmas = [sigma_schedule(s, schedule.num_stages, schedule) for s in range(1, schedule.num_stages)]
    cfg = RolloutConfig(
        dtype="bfloat16", temperature=1.0, max_new_tokens=args.max_new_tokens, max_model_len=512,
        template="boxed", enforce_eager=False, in_process=True, enable_lora=False,
        max_num_seqs=args.prompts * args.n, kv_cache_gib=0.5,
    )  # fmt: skip
    print(f"compiled vLLM: {args.prompts} prompts x {args.n}, {args.max_new_tokens} new tokens")
    for aqn in (False, True):
        engine = VLLMEngine(cfg, model_dir, "vllm-nvfp4-emulated", aqn=aqn)
        realised = [engine.set_noise(sigma, 7) / sigma for sigma in sigmas]
        engine.set_noise(0.0, 0)
        print(f"built for AQN: {aqn} ({engine.info['aqn_norms']})")
        print("  realised / requested sigma, stages 1-9: " + ", ".join(f"{r:.3f}" for r in realised))
        prompts = [render_prompt(engine.tokenizer, q, cfg.template) for q in questions]
        rates = _rates(engine, prompts, cfg, args.n, args.repeats)
        for arm, values in rates.items():
            label = "clean" if arm == "clean" else f"sigma {ARMS[arm]:g}"
            print(
                f"  {label:10s} tokens/s median {statistics.median(values):8.1f} "
                f"(min {min(values):.1f}, max {max(values):.1f}, {len(values)} rounds)"
            )
        engine.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--micro-only", action="store_true", help="only the norm-alone timings")
    parser.add_argument("--compiled", action="store_true", help="the compiled vLLM engine, with/without AQN")
    args = parser.parse_args(argv)
    print(f"torch threads {torch.get_num_threads()}")
    if args.compiled:
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = build_tiny_model(Path(tmp) / "m", dtype=torch.bfloat16, norm_jitter=0.05, **SHAPE)
            questions = [p["question"] for p in arithmetic_problems(args.prompts, seed=0, levels=[1, 2, 3])]
            compiled(args, model_dir, questions)
        return
    norm_micro(SHAPE["hidden_size"])
    if args.micro_only:
        return

    from qerl.pipeline.rollout.hf_engine import HFEngine
    from qerl.pipeline.rollout.vllm_engine import VLLMEngine

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "m", dtype=torch.bfloat16, norm_jitter=0.05, **SHAPE)
        cfg = RolloutConfig(
            dtype="bfloat16", temperature=1.0, max_new_tokens=args.max_new_tokens, max_model_len=512,
            template="boxed", enforce_eager=True, in_process=True, enable_lora=False,
            hf_batch_size=args.prompts * args.n, max_num_seqs=args.prompts * args.n, kv_cache_gib=0.5,
        )  # fmt: skip
        questions = [p["question"] for p in arithmetic_problems(args.prompts, seed=0, levels=[1, 2, 3])]
        print(f"engines: {args.prompts} prompts x {args.n}, {args.max_new_tokens} new tokens")
        for name, build in (("vllm", VLLMEngine), ("hf", HFEngine)):
            engine = build(cfg, model_dir, f"{name}-nvfp4-emulated")
            prompts = [render_prompt(engine.tokenizer, q, cfg.template) for q in questions]
            rates = _rates(engine, prompts, cfg, args.n, args.repeats)
            print(f"{name}: realised sigma {_realised(engine)}")
            for arm, values in rates.items():
                print(
                    f"  {arm:9s} tokens/s median {statistics.median(values):8.1f} "
                    f"(min {min(values):.1f}, max {max(values):.1f}, {len(values)} rounds)"
                )
            ratio = statistics.median(rates["aqn-fp32"]) / statistics.median(rates["clean"])
            print(f"  aqn-fp32 / clean: {ratio:.3f}")
            engine.close()


if __name__ == "__main__":
    main()
