"""Trainer step time next to a live vLLM engine vs in a process that never started one (issue 12).

Model and batch: about the demo's shapes (Qwen2 architecture, hidden 128, 4 layers, intermediate 256
where the demo has 384, vocab 384, float32), random weights built here and quantized by the real
quantize stage; a scored batch of 16 prompts x 8 samples, ~24 prompt + 4-12 completion tokens, mixed
rewards; the demo preset's train settings (LoRA r16 on all projections, 4 minibatches of 32, one
update each).

Child processes run side by side, in lockstep (one step in each, in turn, round after round), so
that whatever else loads the machine loads them alike:
  fresh   never imports vLLM; runs the ``stage`` arm
  engine  starts the vLLM engine on the dequantized twin (the demo's: worker processes; ``--in-process``
          for the in-process engine), generates once, and keeps it alive; one such process per arm,
          because what a step leaves in a process (libgomp's pool, MKL's state) decides later steps
The arms (``qerl.pipeline.runtime.threads``):
  stage   what the train stage does (``trainer_threads``: ``unpinned`` + one core per thread)
  unpinned  MKL and OpenMP as a fresh process has them, no pinning (``fresh_process_threading``)
  pinned  one core per intra-op thread only (``pinned_intra_op_threads``: the first, partial fix)
  bare    neither (before the fix)
A step is ``train_step`` on a freshly loaded state (same input every time). Beside its seconds, each
step reports how many tasks the machine created meanwhile (``/proc/sys/kernel/ns_last_pid``): the
nested-team thread churn that was the cause shows there.

Reported: median / min / max seconds per child and each engine arm's ratio of medians to fresh; the
goal is stage engine/fresh <= 1.3 (the exit status is 1 when it is missed, after the results are written).

Run: ``.venv/bin/python benchmarks/bench_contention.py [--rounds N] [--in-process] [--busy N]
[--arms A,B] [--out FILE]``; writes benchmarks/results/contention.md. ``--busy 1`` adds a process that
spins on a core for the whole run (the load of another job).
"""

from __future__ import annotations

import argparse
import contextlib
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
    from qerl.pipeline.demo.tiny_model import build_tiny_model
    from qerl.pipeline.nvfp4.recipe import QuantizeConfig
    from qerl.pipeline.store.artifact_store import ArtifactStore
    from qerl.stages.dequantize import run as run_twin
    from qerl.stages.quantize import run as quantize

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


_PID_MAX = int(Path("/proc/sys/kernel/pid_max").read_text())
ARMS = ("stage", "unpinned", "pinned", "bare")


def _last_pid() -> int:
    """The last task id the kernel handed out (machine-wide): differences count tasks created."""
    return int(Path("/proc/sys/kernel/ns_last_pid").read_text())


def _child(kind: str, paths: dict[str, str], in_process: bool) -> None:
    """Line protocol on stdin/stdout: an arm name -> one step, answer its seconds and tasks as JSON."""
    import torch
    from qerl.pipeline.rl.batch import load_rollout_batch
    from qerl.pipeline.rl.policy import init_state
    from qerl.pipeline.rl.step import train_step
    from qerl.pipeline.rl.train_config import TrainConfig
    from qerl.pipeline.runtime.threads import (
        fresh_process_threading,
        pinned_intra_op_threads,
        trainer_threads,
    )
    from qerl.pipeline.store.manifest import Manifest

    cfg = TrainConfig(**TRAIN)
    batch = load_rollout_batch(paths["scored"], temperature=1.0)
    engine = None
    if kind == "engine":
        from qerl.pipeline.rollout.config import RolloutConfig
        from qerl.pipeline.rollout.factory import build_engine
        from qerl.pipeline.rollout.protocol import SamplingSpec

        rollout = RolloutConfig(**ROLLOUT, in_process=in_process)
        engine = build_engine(rollout, Manifest.load(paths["quantized"]), Manifest.load(paths["twin"]))
        engine.generate(["1+1="], 2, SamplingSpec(max_new_tokens=8, logprobs=False), 0)
    print(json.dumps({"ready": True, "threads": torch.get_num_threads()}), flush=True)
    for line in sys.stdin:
        arm = line.strip()
        if arm == "quit":
            break
        state = init_state(paths["quantized"], cfg)
        threads = {
            "stage": lambda: trainer_threads("cpu"),
            "unpinned": fresh_process_threading,
            "pinned": lambda: pinned_intra_op_threads("cpu"),
            "bare": contextlib.nullcontext,
        }[arm]
        with threads():
            tasks0 = _last_pid()
            t0 = time.perf_counter()
            train_step(state, batch, cfg)
            seconds = time.perf_counter() - t0
            tasks = (_last_pid() - tasks0) % _PID_MAX
        print(json.dumps({"arm": arm, "seconds": seconds, "tasks": tasks}), flush=True)
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


def _busy_loops(n: int) -> list[subprocess.Popen]:
    """``n`` processes that spin on a core each: the load of another job on the machine."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def measure(
    rounds: int, in_process: bool, arms: tuple[str, ...], busy: int
) -> tuple[dict[tuple[str, str], list[float]], dict[tuple[str, str], list[int]], list[float]]:
    """Seconds and tasks created per step for every (process, arm) child, and the load averages."""
    runs = [("fresh", "stage")] + [("engine", arm) for arm in arms]
    with tempfile.TemporaryDirectory(prefix="qerl-bench-contention-") as tmp:
        work = Path(tmp)
        paths_file = work / "paths.json"
        paths_file.write_text(json.dumps(make_inputs(work)))
        children = {run: _start(run[0], paths_file, in_process) for run in runs}
        times: dict[tuple[str, str], list[float]] = {}
        tasks: dict[tuple[str, str], list[int]] = {}
        loads = []
        spinners = _busy_loops(busy)
        try:
            for r in range(rounds + 1):  # round 0 warms every child up and is not counted
                for run in runs[r % len(runs) :] + runs[: r % len(runs)]:  # each goes first in turn
                    proc = children[run]
                    proc.stdin.write(run[1] + "\n")
                    proc.stdin.flush()
                    out = _answer(proc)
                    if r:
                        times.setdefault(run, []).append(out["seconds"])
                        tasks.setdefault(run, []).append(out["tasks"])
                loads.append(os.getloadavg()[0])
        finally:
            for proc in spinners:
                proc.kill()
            for proc in children.values():
                with contextlib.suppress(Exception):
                    proc.stdin.write("quit\n")
                    proc.stdin.close()
                proc.wait(timeout=120)
    return times, tasks, loads


def main(
    rounds: int = 6, in_process: bool = False, arms: tuple[str, ...] = ARMS, busy: int = 0
) -> tuple[str, bool]:
    import torch

    runs = [("fresh", "stage")] + [("engine", arm) for arm in arms]
    times, tasks, loads = measure(rounds, in_process, arms, busy)
    for run in runs:  # every step, for whoever reads the log
        print(
            f"{run[0]:>6} {run[1]:>6}: "
            + " ".join(f"{t:.2f}s/{n}" for t, n in zip(times[run], tasks[run], strict=True))
        )
    fresh = statistics.median(times[("fresh", "stage")])
    ratio = {arm: statistics.median(times[("engine", arm)]) / fresh for arm in arms}
    ok = ratio["stage"] <= GOAL
    engine_kind = "in-process" if in_process else "worker processes (the demo's)"
    lines = [
        "## Train step next to a live vLLM engine" + (f", {busy} busy process(es) beside it" if busy else ""),
        "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch "
        f"{torch.__version__}, {torch.get_num_threads()} intra-op threads. Demo-shaped NVFP4 base (hidden 128, "
        "4 layers), 128 scored rows, the demo's train settings; `train_step` timed in processes run in "
        f"lockstep: one that never imported vLLM and one per arm with a live vLLM engine ({engine_kind}); "
        f"{rounds} rounds after a warm-up round. `stage`: what the train stage does (MKL and OpenMP reset as "
        "in a fresh process, intra-op thread i on CPU i); `unpinned`: the same without pinning; `pinned`: pinning only; "
        "`bare`: nothing (before the fix). Tasks: how many tasks the machine created during a step "
        f"(median). Busy processes (`--busy`): {busy}, each spinning on a core. Load average over the run: {min(loads):.1f}-{max(loads):.1f} (other jobs on the machine "
        "load every process alike).",
        "",
        "| process | arm | s per step (median, min-max) | / fresh | tasks per step |",
        "|---|---|---:|---:|---:|",
    ]
    for run in runs:
        med, lo, hi = _stats(times[run])
        lines.append(
            f"| {run[0]} | {run[1]} | {med:.2f} ({lo:.2f}-{hi:.2f}) | {med / fresh:.2f}x | "
            f"{statistics.median(tasks[run]):.0f} |"
        )
    lines += [
        "",
        f"- With the engine live, the train stage's way vs fresh: **{ratio['stage']:.2f}x** (goal <= {GOAL}x): "
        f"{'met' if ok else 'NOT met'}.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    return text, ok


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--in-process", action="store_true")
    parser.add_argument("--busy", type=int, default=0, help="spinning processes beside the children (load)")
    parser.add_argument(
        "--arms", default=",".join(ARMS), help=f"engine arms, comma-separated, from {ARMS}; stage is required"
    )
    parser.add_argument("--child", choices=["fresh", "engine"])
    parser.add_argument("--paths")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "contention.md"))
    cli = parser.parse_args()
    if cli.child:
        _child(cli.child, json.loads(Path(cli.paths).read_text()), cli.in_process)
    else:
        from benchmarks import write_section

        result, met = main(cli.rounds, cli.in_process, tuple(cli.arms.split(",")), cli.busy)
        write_section(cli.out, result)
        sys.exit(0 if met else 1)
