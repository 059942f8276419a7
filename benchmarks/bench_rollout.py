"""Benchmark: rollout tokens/s, vLLM engine vs transformers generate, on a Qwen2.5-0.5B-shaped model.

The model: random bf16 weights in the shape of Qwen2.5-0.5B (hidden 896, 24 layers, 14 query / 2
KV heads, head_dim 64, intermediate 4864, tied embeddings) but with a locally trained BPE
tokenizer of a few thousand tokens instead of Qwen's 151,936 (nothing can be downloaded here, and
a 151k vocabulary would only add the same lm_head cost to both engines). It stands in for the
dequantized twin, i.e. the CPU modes ``vllm-nvfp4-emulated`` vs ``hf-nvfp4-emulated``.

Both engines get the same prompts (rendered with the same template), the same sampling (temperature
1, no top-k/top-p, ``max_new_tokens``) and ``n`` samples per prompt; each engine is started, given
one warm-up call (the same batch, 8 new tokens), then timed on one generate call (the "one run").
Tokens/s counts the completion tokens each engine actually produced (different RNGs, so lengths can
differ slightly).
Start-up times are reported separately (vLLM's includes torch.compile unless ``--eager``).
Goal: vLLM >= 4x transformers.

On a CPU the run also measures the decode GEMM floor: the time of the model's linear layers alone
(fused qkv, o, gate_up, down in each of the 24 layers, distinct weights so they stream from memory as
in the model, plus the lm_head) for one decode step of the whole batch, with vLLM's own prepacked
oneDNN GEMM (``create_onednn_mm``/``onednn_mm``, what its CPU linear layers call) and with torch's
``F.linear``. It is the rate of an engine that spent nothing outside these GEMMs, so it says how much
of vLLM's step is not GEMM, and how far the goal is from what these kernels allow on this machine.
It is not a hard bound: other kernels or another OpenMP runtime move it (Intel OpenMP preloaded
doubled it in one run while vLLM itself did not speed up).

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
from qerl.pipeline.data.arithmetic import arithmetic_problems  # noqa: E402
from qerl.pipeline.data.prompts import render_prompt  # noqa: E402
from qerl.pipeline.demo.tiny_model import build_tiny_model  # noqa: E402
from qerl.pipeline.rollout.config import RolloutConfig  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "rollout.md"
SHAPE = dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864)


def _timed(engine, prompts: list[str], n: int, cfg: RolloutConfig) -> tuple[float, int]:
    # warm-up: the whole batch for a few tokens, so both engines meet the batch's shapes (oneDNN
    # primitives, compiled graphs, allocator) before the timed call, as they have in an RL loop's
    # later steps, where the same engine serves every step
    engine.generate(prompts, n, cfg.sampling().__class__(max_new_tokens=8), seed=123)
    start = time.perf_counter()
    result = engine.generate(prompts, n, cfg.sampling(), seed=0)
    seconds = time.perf_counter() - start
    return seconds, sum(len(c.completion_ids) for row in result for c in row)


def _linear_shapes() -> list[tuple[int, int]]:
    """(out, in) of one layer's linears as vLLM fuses them: qkv, o, gate_up, down."""
    h, inter = SHAPE["hidden_size"], SHAPE["intermediate_size"]
    kv = 2 * SHAPE["num_kv_heads"] * (h // SHAPE["num_heads"])
    return [(h + kv, h), (h, h), (2 * inter, h), (h, inter)]


def decode_gemm_floor(batch: int, vocab: int, passes: int = 5) -> dict[str, float]:
    """Tokens/s of the decode step's GEMMs alone at ``batch`` sequences: {"onednn": .., "torch": ..}.

    Random bf16 weights of every layer (distinct tensors, ~0.7 GB, so each pass streams them from
    memory as a real decode step does); median of ``passes`` full passes after one warm-up pass.
    """
    import statistics

    import torch.nn.functional as F
    from vllm import _custom_ops as ops

    gen = torch.Generator().manual_seed(0)
    shapes = _linear_shapes() * SHAPE["num_layers"] + [(vocab, SHAPE["hidden_size"])]
    weights = [(torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16) for n, k in shapes]
    inputs = {k: torch.randn(batch, k, generator=gen).to(torch.bfloat16) for _, k in shapes}
    arms = {"torch": lambda w, x: F.linear(x, w)}
    if getattr(ops, "_supports_onednn", False):
        handlers = {id(w): ops.create_onednn_mm(w.t(), 32) for w in weights}
        arms["onednn"] = lambda w, x: ops.onednn_mm(handlers[id(w)], x, None)
    floors = {}
    for name, linear in arms.items():
        seconds = []
        for _ in range(passes + 1):
            start = time.perf_counter()
            for w in weights:
                linear(w, inputs[w.shape[1]])
            seconds.append(time.perf_counter() - start)
        floors[name] = batch / statistics.median(seconds[1:])
    return floors


def _report(rows: dict, floors: dict, args: argparse.Namespace, vocab: int) -> str:
    """The section's markdown: the engines' table, their ratio and, on a CPU, the decode GEMM floor."""
    (v_s, v_tok, _), (h_s, h_tok, _) = rows["vLLM (in-process LLM)"], rows["transformers generate"]
    ratio = (v_tok / v_s) / (h_tok / h_s)
    lines = [
        "## Rollout engine throughput (vLLM vs transformers generate)",
        "",
        f"Random bf16 model shaped like Qwen2.5-0.5B ({SHAPE['num_layers']} layers, hidden {SHAPE['hidden_size']}, "
        f"14/2 heads, intermediate {SHAPE['intermediate_size']}) with a locally trained {vocab}-token vocabulary "
        "(not Qwen's 151,936). CPU modes: vLLM serves the bf16 twin (`vllm-nvfp4-emulated`), transformers "
        f"runs the same directory (`hf-nvfp4-emulated`). {args.prompts} prompts x {args.n} samples, temperature 1, "
        f"max_new_tokens {args.max_new_tokens}, one timed run after a warm-up call each (same batch, 8 new tokens). "
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
    ]
    if floors:
        hf_rate, v_rate = h_tok / h_s, v_tok / v_s
        best = max(floors.values())
        lines += [
            f"Decode GEMM floor, same run ({args.prompts * args.n} sequences per step, the linear layers alone): "
            + ", ".join(f"{name} {rate:.0f} tokens/s" for name, rate in floors.items())
            + f". An engine doing nothing but these GEMMs would reach **{best / hf_rate:.2f}x** transformers; "
            f"vLLM runs at {v_rate / best:.0%} of that floor.",
            "",
        ]
    lines += [
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"threads {torch.get_num_threads()}; one run, so absolute numbers vary between runs (the ratio is what is compared).",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=4096, help="requested; the small corpus may give fewer")
    parser.add_argument("--eager", action="store_true", help="vLLM without torch.compile (test setting)")
    args = parser.parse_args(argv)

    from qerl.pipeline.rollout.hf_engine import HFEngine
    from qerl.pipeline.rollout.vllm_engine import VLLMEngine

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
        del hf_engine
        gc.collect()
    floors = {} if torch.cuda.is_available() else decode_gemm_floor(args.prompts * args.n, vocab)

    text = _report(rows, floors, args, vocab)
    from benchmarks import write_section

    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    write_section(RESULTS, text)
    print(text)
    return text


if __name__ == "__main__":
    main()
