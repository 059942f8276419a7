"""Benchmark: rollout tokens/s, vLLM engine vs transformers generate, on a Qwen2.5-0.5B-shaped model.

The model: random bf16 weights in the shape of Qwen2.5-0.5B (hidden 896, 24 layers, 14 query / 2
KV heads, head_dim 64, intermediate 4864, tied embeddings) but with a locally trained BPE
tokenizer of a few thousand tokens instead of Qwen's 151,936 (nothing can be downloaded here, and
a 151k vocabulary would only add the same lm_head cost to both engines). It stands in for the
dequantized twin, i.e. the CPU modes ``vllm-nvfp4-emulated`` vs ``hf-nvfp4-emulated``.

Both engines get the same prompts (rendered with the same template), the same sampling (temperature
1, no top-k/top-p, ``max_new_tokens``) and ``n`` samples per prompt; each engine is started, given
one short warm-up request, then timed on one generate call (the "one run"). Tokens/s counts the
completion tokens each engine actually produced (different RNGs, so lengths can differ slightly).
Start-up times are reported separately (vLLM's includes torch.compile unless ``--eager``). Goal: vLLM >= 4x transformers.

The default batch is one GRPO step of the recipe: 16 arithmetic prompts x 8 samples (128 seeded
requests), 128 new tokens each.

Run: ``.venv/bin/python benchmarks/bench_rollout.py [--prompts 16 --n 8 --max-new-tokens 128]``
(writes benchmarks/results/rollout.md).
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from pipeline.data import arithmetic_problems  # noqa: E402
from pipeline.engines import RolloutConfig  # noqa: E402
from pipeline.prompts import render_prompt  # noqa: E402
from pipeline.tiny import build_tiny_model  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "rollout.md"
SHAPE = dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864)


def _timed(engine, prompts: list[str], n: int, cfg: RolloutConfig) -> tuple[float, int]:
    engine.generate(prompts[:1], 1, cfg.sampling().__class__(max_new_tokens=4), seed=123)  # warm-up
    start = time.perf_counter()
    result = engine.generate(prompts, n, cfg.sampling(), seed=0)
    seconds = time.perf_counter() - start
    return seconds, sum(len(c.completion_ids) for row in result for c in row)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=4096, help="requested; the small corpus may give fewer")
    parser.add_argument("--eager", action="store_true", help="vLLM without torch.compile (test setting)")
    args = parser.parse_args(argv)

    from pipeline.engines.hf_engine import HFEngine
    from pipeline.engines.vllm_engine import VLLMEngine

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(
            Path(tmp) / "qwen05b-shaped", dtype=torch.bfloat16, vocab_size=args.vocab,
            max_position_embeddings=2048, tie_word_embeddings=True, **SHAPE,
        )  # fmt: skip
        cfg = RolloutConfig(
            dtype="bfloat16", temperature=1.0, max_new_tokens=args.max_new_tokens, max_model_len=1024,
            template="boxed", enforce_eager=args.eager, in_process=True, enable_lora=False,
            hf_batch_size=args.prompts * args.n, max_num_seqs=args.prompts * args.n,
        )  # fmt: skip
        rows = {}
        t0 = time.perf_counter()
        vllm_engine = VLLMEngine(cfg, model_dir, "vllm-nvfp4-emulated")
        vllm_start = time.perf_counter() - t0
        questions = [p["question"] for p in arithmetic_problems(args.prompts, seed=0, levels=[1, 2, 3])]
        prompts = [render_prompt(vllm_engine.tokenizer, q, cfg.template) for q in questions]
        vocab = len(vllm_engine.tokenizer)
        rows["vLLM (in-process LLM)"] = (*_timed(vllm_engine, prompts, args.n, cfg), vllm_start)
        vllm_engine.close()
        del vllm_engine
        gc.collect()
        t0 = time.perf_counter()
        hf_engine = HFEngine(cfg, model_dir, "hf-nvfp4-emulated")
        hf_start = time.perf_counter() - t0
        rows["transformers generate"] = (*_timed(hf_engine, prompts, args.n, cfg), hf_start)
        hf_engine.close()

    (v_s, v_tok, _), (h_s, h_tok, _) = rows["vLLM (in-process LLM)"], rows["transformers generate"]
    ratio = (v_tok / v_s) / (h_tok / h_s)
    lines = [
        "## Rollout engine throughput (vLLM vs transformers generate)",
        "",
        f"Random bf16 model shaped like Qwen2.5-0.5B ({SHAPE['num_layers']} layers, hidden {SHAPE['hidden_size']}, "
        f"14/2 heads, intermediate {SHAPE['intermediate_size']}) with a locally trained {vocab}-token vocabulary "
        "(not Qwen's 151,936). CPU modes: vLLM serves the bf16 twin (`vllm-nvfp4-emulated`), transformers "
        f"runs the same directory (`hf-nvfp4-emulated`). {args.prompts} prompts x {args.n} samples, temperature 1, "
        f"max_new_tokens {args.max_new_tokens}, one timed run after one short warm-up request each. "
        f"vLLM {'eager (compilation mode 0)' if args.eager else 'compiled (the production default)'}, "
        "in-process engine core.",
        "",
        "| engine | completion tokens | generate s | tokens/s | start-up s |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, (seconds, tokens, startup) in rows.items():
        lines.append(f"| {name} | {tokens} | {seconds:.1f} | {tokens / seconds:.1f} | {startup:.1f} |")
    verdict = "meets" if ratio >= 4 else "misses"
    lines += [
        "",
        f"**vLLM / transformers: {ratio:.2f}x** tokens/s ({verdict} the >= 4x goal).",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"threads {torch.get_num_threads()}; one run, so absolute numbers vary between runs (the ratio is what is compared).",
        "",
    ]
    text = "\n".join(lines)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(text)
    print(text)
    return text


if __name__ == "__main__":
    main()
