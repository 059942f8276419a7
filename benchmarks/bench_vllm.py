"""GPU benchmark: rollout tokens/s of the default GPU engine (vLLM on FP4 Marlin) against bf16.

What, on one CUDA GPU, side by side in one run: a Qwen2-shaped model with random weights at
Qwen2.5-0.5B's shape (``--models 0.5b,7b`` adds 7B's), built there (nothing downloaded), with a
locally trained tokenizer of about 4,096 tokens instead of Qwen's 151,936 (the lm_head stays bf16 in
both arms, so the vocabulary would only add the same cost to both). Two arms, each in its own process
through the project's own path:

- ``nvfp4``: the quantize stage's NVFP4A16 checkpoint, served by ``build_engine`` in the mode
  ``vllm-nvfp4-marlin`` (vLLM's compressed-tensors W4A16 FP4 scheme on the Marlin kernel);
- ``bf16``: the same weights registered unquantized (``quantize.scheme: none``), mode
  ``vllm-unquantized``;
- ``nf4`` (only with ``--arms``): QLoRA's NF4 checkpoint of the same weights (``quantize.scheme:
  nf4``), served by vLLM's bitsandbytes support (mode ``vllm-nf4-bitsandbytes``): the rollout side
  of the paper's QLoRA comparison;
- ``nvfp4-aqn`` (only with ``--arms``): the ``nvfp4`` arm's engine built for AQN, as a run with AQN
  builds it (its norms fp32 from the load on), timed with noise set at the 7B schedule's last sigma
  (5e-4); it reports the realised sigma, and its tokens/s against ``nvfp4`` is what exact AQN costs.

Both as a run serves: CUDA graphs and torch.compile on, logprobs recorded, temperature 1. Each arm
reports its start-up (load, compile, graph capture), then one warm-up call over the whole batch (8 new
tokens) and ``--repeats`` timed generate calls (default 3, the same seed, so the same tokens) of
``--prompts`` x ``--n`` samples of up to ``--max-new-tokens`` tokens; tokens/s counts the completion
tokens produced (a random model's early EOS can shorten a few) over the median call, and the table
gives the calls' range. A timed call is seconds against an arm's start-up of minutes, so the
repeats cost little and show the clock's noise.
The ratio nvfp4/bf16 is the result: decode is weight-bandwidth bound, so 4-bit weights should be
faster at small batch, and how much Marlin's dequantization costs shows at large batch.

``--dry-run``: the same code on the CPU at a tiny shape with vLLM's CPU engine, eager (the NVFP4 arm
serves the dequantized twin there, mode ``vllm-nvfp4-emulated``), in about a minute; its numbers say
nothing about a GPU. Results: ``vllm.md`` and ``vllm.json`` in ``--out-dir`` (default
benchmarks/results for a CUDA run, never for a dry run), rewritten after every arm, so a run cut off
by a time budget keeps what it measured.

``--layers N`` builds each model with N decoder layers of its own shape (named "7b-4l"): the ratio
at 7B's matrix shapes for a fraction of a 7B arm's build, load and compile (minutes of a lease); its
tokens/s are not 7B's.

Run: ``python benchmarks/bench_vllm.py [--models 0.5b,7b] [--layers N] [--prompts 16 --n 8 --max-new-tokens 256]``
(on the GPU machine through ``scripts/gpu/gpu_check.sh``, in the GPU install's environment).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import vllm_report  # noqa: E402 - after the path: this file also runs as a script

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

MODELS = {"0.5b": "qwen2.5-0.5b", "7b": "qwen2.5-7b"}  # KNOWN_SHAPES names; Marlin's tiles hold for both
TINY = dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=256)
ARMS = ("nvfp4", "bf16", "nvfp4-aqn", "nf4")
SCHEMES = {"bf16": "none", "nf4": "nf4"}  # every other arm: nvfp4
AQN_SIGMA = 5e-4  # the nvfp4-aqn arm's noise: the 7B schedule's last stage, which bf16 would round away
# the quantize stage's settings here: no quality section (two passes of a random model, at 7B minutes of
# a lease for a KL nobody reads); parent and arms use the same, so each arm gets the parent's artifact
QUANTIZE = {"quality": {"enabled": False}}


def _rollout_config(args: argparse.Namespace, dry: bool) -> Any:
    from qerl.pipeline.rollout.config import RolloutConfig

    return RolloutConfig(
        engine="vllm", dtype="bfloat16", temperature=1.0, max_new_tokens=args.max_new_tokens,
        max_model_len=args.max_new_tokens + 256, template="boxed", enforce_eager=dry, enable_lora=False,
        max_num_seqs=args.prompts * args.n, gpu_memory_utilization=0.5,
        in_process=dry,  # the CPU: no engine-core process to start (seconds, not minutes)
    )  # fmt: skip


def child(arm: str, model_dir: str, store_dir: str, args: argparse.Namespace) -> dict[str, Any]:
    """One arm in this process: the base registered as the arm says, served, timed."""
    from qerl.pipeline.data.arithmetic import arithmetic_problems
    from qerl.pipeline.data.prompts import render_prompt
    from qerl.pipeline.nvfp4.recipe import QuantizeConfig
    from qerl.pipeline.planning.engine_setup import needs_twin
    from qerl.pipeline.rollout.factory import build_engine
    from qerl.pipeline.rollout.protocol import SamplingSpec
    from qerl.pipeline.runtime import device
    from qerl.pipeline.store.artifact_store import ArtifactStore
    from qerl.stages import dequantize, quantize

    dry = not device.cuda_available()
    store = ArtifactStore(Path(store_dir))
    qcfg = QuantizeConfig(scheme=SCHEMES.get(arm, "nvfp4"), **QUANTIZE)
    quantized = quantize.run(qcfg, model_dir, store)  # the parent built it: a cache hit
    twin = dequantize.run(qcfg, quantized, store) if needs_twin("vllm", qcfg.scheme) else None
    cfg = _rollout_config(args, dry)
    t0 = time.perf_counter()
    engine = build_engine(cfg, quantized, twin, aqn=arm == "nvfp4-aqn")
    startup = time.perf_counter() - t0
    noise = {}
    try:
        questions = [p["question"] for p in arithmetic_problems(args.prompts, seed=0, levels=[1, 2, 3])]
        prompts = [render_prompt(engine.tokenizer, q, cfg.template) for q in questions]
        engine.generate(prompts, args.n, SamplingSpec(max_new_tokens=8), seed=123)  # warm-up
        if arm == "nvfp4-aqn":
            realised = engine.set_noise(AQN_SIGMA, 1)
            noise = {
                "aqn_sigma": AQN_SIGMA,
                "aqn_sigma_realised": realised,
                "aqn_norms": engine.info["aqn_norms"],
            }
        times = []
        for _ in range(args.repeats):  # the same seed each time: the same tokens, only the clock varies
            t0 = time.perf_counter()
            rows = engine.generate(prompts, args.n, cfg.sampling(), seed=0)
            times.append(time.perf_counter() - t0)
        seconds = statistics.median(times)
    finally:
        engine.close()
    tokens = sum(len(c.completion_ids) for row in rows for c in row)
    planned = {}
    if not dry:
        import torch

        planned = planned_gib(model_dir, cfg, torch.cuda.get_device_properties(0).total_memory, arm)
    return {
        "arm": arm,
        "mode": engine.mode,
        "startup_s": startup,
        "seconds": seconds,
        "seconds_all": times,
        "tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "sequences": sum(len(row) for row in rows),
        "planned_gib": planned,
        **noise,
    }


def bench_model(out: Path, shape: dict[str, Any], vocab_size: int) -> Path:
    """The arm's random-weight model at ``shape`` in ``out``, built unless ``out`` already holds the
    same build (a 7B build takes minutes of a lease; the kit keeps ``out`` between its calls)."""
    from qerl.pipeline.demo.tiny_model import build_tiny_model
    from qerl.pipeline.store.files import atomic_write_json

    spec = {"shape": shape, "vocab_size": vocab_size, "max_position_embeddings": 4096, "seed": 0}
    marker = out / "bench_vllm_model.json"
    if marker.is_file() and json.loads(marker.read_text()) == spec:
        print(f"bench_vllm: reusing the model in {out}", file=sys.stderr, flush=True)
        return out
    shutil.rmtree(out, ignore_errors=True)  # a different or unfinished build
    build_tiny_model(out, vocab_size=vocab_size, max_position_embeddings=4096, seed=0, **shape)
    atomic_write_json(marker, spec)  # last: a build cut off midway is never reused
    return out


def bench_code() -> str:
    """The code version of what an arm runs and records: the hash of this script, the qerl modules it
    imports, transitively (the store's cache-key rule, ``qerl.pipeline.store.code_version``), and the
    log reader beside it (``vllm_report.py``)."""
    from qerl.pipeline.store.code_version import code_version

    return code_version(sys.modules[__name__], Path(vllm_report.__file__))


def earlier_arms(path: Path, results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The arms an earlier run wrote to ``path``, when it measured on the same machine with the same
    settings and the same code as ``results`` (a lease's later call then completes its table); none
    otherwise, with the first difference named."""
    if not path.is_file():
        return {}
    earlier = json.loads(path.read_text())
    same = ("mode", "machine", "torch", "prompts", "n", "max_new_tokens", "repeats", "code")
    differ = next((k for k in same if earlier.get(k) != results[k]), None)
    if differ:
        print(
            f"bench_vllm: not merging {path}: its {differ} is {earlier.get(differ)!r}, "
            f"this run's {results[differ]!r}",
            file=sys.stderr,
        )
        return {}
    return {m: {a: r for a, r in arms.items() if "error" not in r} for m, arms in earlier["models"].items()}


def planned_gib(model_dir: str | Path, rollout: Any, gpu_bytes: float, arm: str) -> dict[str, float]:
    """``qerl plan``'s vLLM rows (GiB) for the arm's model and engine config on a GPU of ``gpu_bytes``,
    set beside what vLLM reports (the parent reads the arm's log)."""
    from qerl.pipeline.planning.memory_plan import vllm_share
    from qerl.pipeline.planning.model_shape import resolve_model

    shape, _ = resolve_model(str(model_dir))
    share = vllm_share(shape, rollout, gpu_bytes, {"bf16": "bf16", "nf4": "nf4"}.get(arm, "nvfp4"))
    return {k: v / 2**30 for k, v in share.items()}


def _run_arm(arm: str, model_dir: Path, store: Path, argv: list[str]) -> dict[str, Any]:
    """``child`` in a fresh process (vLLM gives its GPU memory back only when its process ends)."""
    cmd = [sys.executable, __file__, "--child", arm, "--model-dir", str(model_dir), "--store", str(store)]
    proc = subprocess.run(cmd + argv, capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    # every line where vLLM states a memory figure (the CUDA context, non-torch memory, profiling):
    # what the plan's rows are read against beyond the parsed ones
    memory_log = [ln.strip()[:300] for ln in log.splitlines() if "GiB" in ln and "RESULT " not in ln][-30:]
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT ") :])
            return {**result, "reported": vllm_report.vllm_reported(log), "memory_log": memory_log}
    error = f"exit {proc.returncode}: {vllm_report.root_cause(proc.stderr or proc.stdout)}"
    return {"arm": arm, "error": error, "memory_log": memory_log}


def tiny_model_sizes(name: str) -> dict[str, Any]:
    """``build_tiny_model``'s sizes for a known Qwen2.5 shape (its vocabulary stays the local one)."""
    from qerl.pipeline.planning.model_shape import KNOWN_SHAPES

    shape = KNOWN_SHAPES[MODELS[name]]
    return dict(
        hidden_size=shape.hidden, num_layers=shape.layers, num_heads=shape.heads, num_kv_heads=shape.kv_heads,
        intermediate_size=shape.intermediate, tie_word_embeddings=shape.tie_embeddings,
    )  # fmt: skip


def bench_shapes(models: list[str], layers: int | None = None) -> dict[str, dict[str, Any]]:
    """The models to build, by the name the results give them: a known shape's own, or with
    ``layers`` decoder layers in place of its own, named so ("7b-4l"). Every layer has the model's
    matrix shapes, so the Marlin/bf16 ratio keeps its meaning while the build, the load and the
    compile of a 7B arm shrink with the layer count; the tokens/s do not transfer."""
    if layers is not None and layers < 1:
        raise ValueError(f"--layers must be at least 1, got {layers}")
    shapes = {}
    for m in models:
        sizes = tiny_model_sizes(m)
        if layers is None or layers == sizes["num_layers"]:
            shapes[m] = sizes
        else:
            shapes[f"{m}-{layers}l"] = {**sizes, "num_layers": layers}
    return shapes


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _write(results: dict[str, Any], out_dir: Path) -> None:
    from qerl.pipeline.store.files import atomic_write_text

    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_dir / "vllm.json", json.dumps(results, indent=1) + "\n")  # in the arms' order
    atomic_write_text(out_dir / "vllm.md", vllm_report.report(results))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="0.5b", help=f"comma-separated, of {sorted(MODELS)}")
    parser.add_argument(
        "--layers",
        type=int,
        default=None,
        help="decoder layers of each model (default: its own; fewer: a shorter lease)",
    )
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3, help="timed generate calls; the median counts")
    parser.add_argument("--dry-run", action="store_true", help="the CPU, a tiny shape, eager, seconds")
    parser.add_argument("--out-dir", type=Path, default=None)
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=None,
        help="keep the built models and their quantized store here and reuse them (default: a temporary folder)",
    )
    parser.add_argument(
        "--arms", default="nvfp4,bf16", help=f"comma-separated, of {list(ARMS)} (run in this order)"
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the arms in --out-dir's vllm.json measured on this machine with these settings "
        "and this code",
    )
    parser.add_argument("--child", choices=ARMS, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args.model_dir, args.store, args)), flush=True)
        return 0

    import torch

    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device: this benchmark measures a GPU (--dry-run runs its code on the CPU)")
    unknown = sorted(set(args.models.split(",")) - set(MODELS))
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {sorted(MODELS)}")
    arms = args.arms.split(",")
    if set(arms) - set(ARMS):
        parser.error(f"unknown arm(s) {sorted(set(arms) - set(ARMS))}; choose from {list(ARMS)}")
    if args.dry_run:
        args.prompts, args.n, args.max_new_tokens = 2, 2, 8
    out_dir = args.out_dir or (
        Path(tempfile.gettempdir()) if args.dry_run else ROOT / "benchmarks" / "results"
    )
    shapes = {"tiny": TINY} if args.dry_run else bench_shapes(args.models.split(","), args.layers)
    child_argv = [
        str(x) for k in ("prompts", "n", "max_new_tokens", "repeats") for x in (_flag(k), getattr(args, k))
    ]
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"{platform.machine()} CPU"
    results: dict[str, Any] = {
        "mode": "dry-run-cpu" if args.dry_run else "cuda",
        "machine": gpu,
        "torch": torch.__version__,
        "prompts": args.prompts,
        "n": args.n,
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "code": bench_code(),
        "models": {},
    }
    if args.merge:
        results["models"] = earlier_arms(out_dir / "vllm.json", results)
    from qerl.pipeline.nvfp4.recipe import QuantizeConfig
    from qerl.pipeline.store.artifact_store import ArtifactStore
    from qerl.stages import quantize

    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        work = args.work_dir or Path(tmp)
        for name, shape in shapes.items():
            model_dir = bench_model(work / name, shape, vocab_size=512 if args.dry_run else 4096)
            store = work / f"{name}-store"
            # on the GPU when there is one; a hit in a kept --work-dir
            quantize.run(QuantizeConfig(**QUANTIZE), model_dir, ArtifactStore(store))
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # the arms' engines measure the GPU's free memory at start-up
            results["models"].setdefault(name, {})
            for arm in arms:
                print(f"bench_vllm: {name} {arm} ...", file=sys.stderr, flush=True)
                t0 = time.perf_counter()
                try:
                    result = _run_arm(arm, model_dir, store, child_argv)
                except KeyboardInterrupt:  # the kit's budget: say so in the results, keep the others
                    cut = f"cut off after {time.perf_counter() - t0:.0f} s (the time budget)"
                    results["models"][name][arm] = {"arm": arm, "error": cut}
                    _write(results, out_dir)
                    raise
                results["models"][name][arm] = {**result, "wall_s": time.perf_counter() - t0}
                print(
                    f"bench_vllm: {name} {arm} took {time.perf_counter() - t0:.0f} s",
                    file=sys.stderr,
                    flush=True,
                )
                _write(results, out_dir)
    text = vllm_report.report(results)
    print(text)
    failed = [f"{m}/{a}" for m, arms in results["models"].items() for a, r in arms.items() if "error" in r]
    if failed:
        print(f"bench_vllm: failed arms: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
