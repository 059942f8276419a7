"""Trainer step time next to a live vLLM engine vs in a process that never started one (issue 12).

Model and batch: about the demo's shapes (Qwen2 architecture, hidden 128, 4 layers, intermediate 256
where the demo has 384, vocab 384, float32), random weights built here and quantized by the real
quantize stage; a scored batch of 16 prompts x 8 samples, ~24 prompt + 4-12 completion tokens, mixed rewards; the demo
preset's train settings (LoRA r16 on all projections, 4 minibatches of 32, one update each).

Two child processes run side by side, in lockstep (one step in one, then one in the other, and so
on), so that whatever else loads the machine loads both alike:
  fresh   never imports vLLM
  engine  starts the vLLM engine on the dequantized twin (the demo's: worker processes; ``--in-process``
          for the in-process engine), generates once, and keeps it alive
Each child alternates two arms per round: ``pinned`` (the train stage's way: intra-op thread i on CPU
i, ``pipeline.threads.pinned_intra_op_threads``) and ``free`` (threads left to the scheduler, as
before the fix). A step is ``train_step`` on a freshly loaded state (same input every time).

Reported: median / min / max seconds per arm and the engine/fresh ratio of medians; the goal is
pinned engine/fresh <= 1.3 (the exit status is 1 when it is missed, after the results are written).

Run: ``.venv/bin/python benchmarks/bench_contention.py [--rounds N] [--in-process]``; writes
benchmarks/results/contention.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GOAL = 1.3
TRAIN = dict(lora_r=16, lora_alpha=32, lr=1e-3, warmup_steps=0, total_steps=240, minibatch_size=32)
TRAIN.update(grad_accum=1, max_grad_norm=1.0, dtype="float32", temperature=1.0)
ROLLOUT = dict(engine="vllm", n_samples=8, max_new_tokens=12, max_model_len=128, template="terse")
ROLLOUT.update(dtype="float32", kv_cache_gib=0.5, enforce_eager=True, max_lora_rank=16)


def make_inputs(work: Path) -> dict[str, str]:
    """Demo-shaped base, its NVFP4 checkpoint and twin (real stages), and a scored batch."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    from pipeline.artifacts import ArtifactStore
    from pipeline.nvfp4 import QuantizeConfig
    from pipeline.tiny import build_tiny_model
    from stages.quantize import run as quantize
    from stages.quantize import run_twin

    src = build_tiny_model(work / "base", dtype=torch.float32, vocab_size=384, hidden_size=128, num_layers=4)
    store = ArtifactStore(work / "store")
    qcfg = (
        QuantizeConfig(twin_dtype="float32")
        if "twin_dtype" in QuantizeConfig.model_fields
        else QuantizeConfig()
    )
    quantized = quantize(qcfg, str(src), store)
    twin = run_twin(qcfg, quantized, store)
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    gen = torch.Generator().manual_seed(0)
    rows: dict[str, list] = {k: [] for k in ("group_id", "prompt_ids", "completion_ids", "logprobs")}
    rows.update(finish_reason=[], reward=[], temperature=[])
    for g in range(16):
        prompt = torch.randint(3, vocab, (24,), generator=gen).tolist()
        for j in range(8):
            n = int(torch.randint(4, 13, (1,), generator=gen))
            rows["group_id"].append(g)
            rows["prompt_ids"].append(prompt)
            rows["completion_ids"].append(torch.randint(3, vocab, (n,), generator=gen).tolist())
            rows["logprobs"].append((-torch.rand(n, generator=gen) * 4).tolist())
            rows["finish_reason"].append("stop")
            rows["reward"].append(float((g + j) % 3 == 0))
            rows["temperature"].append(1.0)
    pq.write_table(pa.table(rows), work / "scored.parquet")
    return {"quantized": str(quantized.dir), "twin": str(twin.dir), "scored": str(work / "scored.parquet")}


def _child(kind: str, paths: dict[str, str], in_process: bool) -> None:
    """Line protocol on stdin/stdout: 'pinned' or 'free' -> one step, answer its seconds as JSON."""
    import contextlib

    import torch

    from pipeline.artifacts import Manifest
    from pipeline.threads import pinned_intra_op_threads
    from pipeline.training import TrainConfig, init_state, load_rollout_batch, train_step

    cfg = TrainConfig(**TRAIN)
    batch = load_rollout_batch(paths["scored"], temperature=1.0)
    engine = None
    if kind == "engine":
        from pipeline.engines import RolloutConfig, SamplingSpec, build_engine

        rollout = RolloutConfig(**ROLLOUT, in_process=in_process)
        engine = build_engine(rollout, Manifest.load(paths["quantized"]), Manifest.load(paths["twin"]))
        engine.generate(["1+1="], 2, SamplingSpec(max_new_tokens=8, logprobs=False), 0)
    print(json.dumps({"ready": True, "threads": torch.get_num_threads()}), flush=True)
    for line in sys.stdin:
        arm = line.strip()
        if arm == "quit":
            break
        state = init_state(paths["quantized"], cfg)
        pin = pinned_intra_op_threads("cpu") if arm == "pinned" else contextlib.nullcontext({})
        with pin as pins:
            t0 = time.perf_counter()
            train_step(state, batch, cfg)
            seconds = time.perf_counter() - t0
        print(json.dumps({"arm": arm, "seconds": seconds, "pinned": bool(pins)}), flush=True)
    if engine is not None:
        engine.close()


def _start(kind: str, paths_file: Path, in_process: bool) -> subprocess.Popen:
    cmd = [sys.executable, __file__, "--child", kind, "--paths", str(paths_file)]
    cmd += ["--in-process"] if in_process else []
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    ready = _answer(proc)
    if not ready.get("ready"):
        raise RuntimeError(f"{kind} child did not start: {ready}")
    return proc


def _answer(proc: subprocess.Popen) -> dict:
    for line in proc.stdout:  # vLLM may print to stdout too: the answers are the JSON lines
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"child exited with {proc.wait()}")


def _stats(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def main(rounds: int = 6, in_process: bool = False) -> tuple[str, bool]:
    import torch

    with tempfile.TemporaryDirectory(prefix="qerl-bench-contention-") as tmp:
        work = Path(tmp)
        paths_file = work / "paths.json"
        paths_file.write_text(json.dumps(make_inputs(work)))
        children = {"fresh": _start("fresh", paths_file, in_process)}
        children["engine"] = _start("engine", paths_file, in_process)
        times: dict[tuple[str, str], list[float]] = {}
        loads = []
        try:
            for r in range(rounds + 1):  # round 0 warms both arms up and is not counted
                for arm in ("pinned", "free") if r % 2 else ("free", "pinned"):
                    for kind, proc in children.items():
                        proc.stdin.write(arm + "\n")
                        proc.stdin.flush()
                        out = _answer(proc)
                        if r:
                            times.setdefault((kind, arm), []).append(out["seconds"])
                loads.append(os.getloadavg()[0])
        finally:
            for proc in children.values():
                with __import__("contextlib").suppress(Exception):
                    proc.stdin.write("quit\n")
                    proc.stdin.close()
                proc.wait(timeout=120)
    med = {key: statistics.median(v) for key, v in times.items()}
    ratio = {arm: med[("engine", arm)] / med[("fresh", arm)] for arm in ("pinned", "free")}
    ok = ratio["pinned"] <= GOAL
    engine_kind = "in-process" if in_process else "worker processes (the demo's)"
    lines = [
        "## Train step next to a live vLLM engine",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch "
        f"{torch.__version__}, {torch.get_num_threads()} intra-op threads. Demo-shaped NVFP4 base (hidden 128, "
        "4 layers), 128 scored rows, the demo's train settings; `train_step` timed in two processes run in "
        f"lockstep: one that never imported vLLM and one with a live vLLM engine ({engine_kind}); {rounds} "
        "rounds after a warm-up round, arms alternating. `pinned`: intra-op thread i on CPU i (what the "
        "train stage does); `free`: threads left to the scheduler (before the fix). Load average over the "
        f"run: {min(loads):.1f}-{max(loads):.1f} (other jobs on the machine load both processes alike).",
        "",
        "| arm | fresh s (median, min-max) | engine live s (median, min-max) | engine / fresh |",
        "|---|---:|---:|---:|",
    ]
    for arm in ("pinned", "free"):
        f, e = _stats(times[("fresh", arm)]), _stats(times[("engine", arm)])
        lines.append(
            f"| {arm} | {f[0]:.2f} ({f[1]:.2f}-{f[2]:.2f}) | {e[0]:.2f} ({e[1]:.2f}-{e[2]:.2f}) | "
            f"{ratio[arm]:.2f}x |"
        )
    free_vs_pinned = med[("engine", "free")] / med[("engine", "pinned")]
    lines += [
        "",
        f"- With the engine live, pinned vs fresh: **{ratio['pinned']:.2f}x** (goal <= {GOAL}x): "
        f"{'met' if ok else 'NOT met'}.",
        f"- With the engine live, unpinned threads take {free_vs_pinned:.2f}x the pinned time.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    return text, ok


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--in-process", action="store_true")
    parser.add_argument("--child", choices=["fresh", "engine"])
    parser.add_argument("--paths")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "contention.md"))
    cli = parser.parse_args()
    if cli.child:
        _child(cli.child, json.loads(Path(cli.paths).read_text()), cli.in_process)
    else:
        from pipeline.artifacts import atomic_write_text

        result, met = main(cli.rounds, cli.in_process)
        atomic_write_text(cli.out, result)
        sys.exit(0 if met else 1)
