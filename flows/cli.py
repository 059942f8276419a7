"""The ``qerl`` command line: one entry point, a subcommand per user task.

Handlers import their stage lazily so ``qerl --help`` stays fast and a missing optional backend
only fails the command that needs it.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {}


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--work-dir", default=None, help="work directory (default: $QERL_WORK_DIR or ./qerl-work)"
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="debug logging; run/resume: libraries' output on the terminal too (else only in run.log)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qerl", description="Quantization-enhanced RL (NVFP4 + LoRA + GRPO + AQN)"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    # --- subcommands (each block adds a parser and registers its handler in COMMANDS) ---
    _add_score(sub)
    _add_quantize(sub)
    _add_promote(sub)
    _add_eval(sub)
    _add_run(sub)
    _add_bench(sub)
    _add_gc(sub)
    _add_plan(sub)
    _add_ablate(sub)
    return parser


def _add_ablate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "ablate", help="compare arms (bf16-lora, nvfp4-lora, nvfp4-aqn) over seeds: a run each, then a report"
    )
    p.add_argument("--config", default=None, help="YAML file or preset name (see pipeline/planning/presets)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a setting")
    p.add_argument("--arms", required=True, help="comma-separated arms, e.g. bf16-lora,nvfp4-lora,nvfp4-aqn")
    p.add_argument("--seeds", type=int, default=3, help="replicates per arm (default 3)")
    p.add_argument("--bootstrap", type=int, default=10_000, help="bootstrap resamples over items")
    p.add_argument(
        "--ray",
        default=None,
        metavar="ADDRESS",
        help="run the runs concurrently on this Ray cluster (host:port, ray://host:10001, auto, local; "
        "default: $QERL_RAY_ADDRESS, else one after the other here); see flows/fanout.py",
    )
    p.add_argument("--cpus-per-run", type=float, default=1.0, help="with --ray: CPUs each run asks for")
    p.add_argument(
        "--gpus-per-run",
        type=float,
        default=None,
        help="with --ray: GPUs each run asks for (default: rollout.tensor_parallel_size if the cluster has GPUs, else 0)",
    )
    _common(p)
    COMMANDS["ablate"] = _cmd_ablate


def _cmd_ablate(args: argparse.Namespace) -> int:
    """Run (or continue) an ablation with the console; the log is <work>/ablations/<id>/run.log."""
    from pathlib import Path

    from qerl.flows import console, runner
    from qerl.pipeline.evaluation.ablation import ablation_id, parse_arms
    from qerl.pipeline.planning.run_config import load_run_config

    cfg = load_run_config(args.config, args.set)
    work = Path(_work_dir(args)).resolve()
    arms = parse_arms(args.arms)  # a bad --arms fails before Prefect starts
    aid = ablation_id(cfg.model_dump(mode="json"), arms, args.seeds)
    runner.prepare_environment(work)
    address, tracking_uri = _ablate_ray_checks(args, cfg, work)  # a bad cluster setup fails before the flow
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
    from qerl.flows.ablate import ablate_flow, ablation_dir

    params = {
        "config": cfg.model_dump(mode="json"), "work_dir": str(work), "arms": arms, "seeds": args.seeds,
        "n_boot": args.bootstrap,
    }  # fmt: skip
    with console.session(ablation_dir(work, aid), verbose=args.verbose) as ui:
        ui.line(
            f"ablation {aid}: {len(arms)} arms x {args.seeds} seeds (details in {ablation_dir(work, aid)})"
        )
        runner.start_temporary_server()
        with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
            if address is None:
                record = ablate_flow(**params)
            else:
                from qerl.flows import fanout

                with fanout.cluster(
                    address, work, tracking_uri, args.cpus_per_run, args.gpus_per_run,
                    cfg.rollout.tensor_parallel_size,
                ) as (task_runner, plan):  # fmt: skip
                    record = ablate_flow.with_options(task_runner=task_runner)(**params, ray=plan)
    print(f"ablation {aid}: {record['status']}", flush=True)
    for verdict in record.get("verdicts", []):
        print(f"  {verdict}", flush=True)
    print(f"  report: {record.get('report')}", flush=True)
    return 0


def _ablate_ray_checks(args: argparse.Namespace, cfg: Any, work: Any) -> tuple[str | None, str]:
    """The Ray address (--ray, else $QERL_RAY_ADDRESS) and the resolved MLflow URI, with the static rules
    of qerl.flows.fanout checked before the flow starts (after prepare_environment: fanout imports Prefect)."""
    from qerl.flows import fanout

    address = fanout.resolve_address(args.ray)
    if address is None:
        return None, ""
    from qerl.pipeline.registry import tracking as registry

    tracking_uri, _ = registry.resolve_uris(cfg.registry, work)
    remote = bool(fanout.address_is_remote(address))
    fanout.check_settings(address, str(work), tracking_uri, os.environ.get("PREFECT_API_URL"), remote)
    fanout.check_reachable(address)
    return address, tracking_uri


def _add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan", help="GPU memory budget of a colocated run (vLLM + trainer on one GPU): does it fit?"
    )
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="config.json, model dir, hub id or known shape (qwen2.5-7b ...); default: model.source",
    )
    p.add_argument("--gpu-mem", required=True, help="one GPU's memory: 80 (GiB), 80GiB, 80GB or 81559MiB")
    p.add_argument("--config", default=None, help="YAML file or preset name (see pipeline/planning/presets)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a setting")
    p.add_argument("--prompt-tokens", type=int, default=None, help="longest prompt (default: the worst case)")
    p.add_argument(
        "--base", choices=["nvfp4", "bf16"], default="nvfp4", help="trainer's base (bf16: compare)"
    )
    COMMANDS["plan"] = _cmd_plan


def _cmd_plan(args: argparse.Namespace) -> int:
    from qerl.pipeline.planning.memory import plan_for_run

    plan = plan_for_run(args.model, args.gpu_mem, args.config, args.set, args.prompt_tokens, args.base)
    print(plan.render(), end="")
    return 0 if plan.fits else 1


def _add_run(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="run the RL flow (no --config: the embedded demo)")
    p.add_argument("--config", default=None, help="YAML file or preset name (see pipeline/planning/presets)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a setting")
    p.add_argument(
        "--night",
        default=None,
        metavar="YYYY-MM-DD|today",
        help="run that night's nightly run by hand (warm start, next data slice), as the schedule would",
    )
    _common(p)
    COMMANDS["run"] = _cmd_run
    p = sub.add_parser("resume", help="continue a recorded run: completed stages are reused")
    p.add_argument("run_id", metavar="RUN", help="run id (see <work>/runs)")
    _common(p)
    COMMANDS["resume"] = _cmd_resume
    p = sub.add_parser("schedule", help="serve the nightly deployment on a Prefect server")
    p.add_argument("--cron", required=True, help="cron expression, e.g. '0 2 * * *'")
    p.add_argument("--config", default=None, help="YAML file or preset name")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a setting")
    _common(p)
    COMMANDS["schedule"] = _cmd_schedule


def _print_run(record: dict, work: str) -> None:
    """The run's result for people: the last thing ``qerl run``/``qerl resume`` prints."""
    from pathlib import Path

    from qerl.flows.rl import eval_text

    def say(text: str) -> None:
        print(text, flush=True)

    reg = record.get("registration") or {}
    night = f", night {record['night']}" if record.get("night") else ""
    say(f"run {record['run_id']}: {record['status']} (engine mode {record.get('engine_mode')}{night})")
    data = record.get("data") or {}
    if data.get("dropped_too_long"):
        say(f"  data: {data['kept']} problems, {data['dropped_too_long']} dropped (prompt > {data['prompt_token_limit']} tokens)")  # fmt: skip
    warm = (record.get("plan") or {}).get("warm_start") or {}
    if warm.get("version"):
        say(f"  warm start: {reg.get('model_name') or 'adapter'} v{warm['version']}")
    for e in record.get("evaluations", []):
        who = "base (no adapter)" if e["adapter"] is None else f"adapter after step {e['step']}"
        say(f"  {eval_text(e)}  {who}")
    if reg:
        say(f"  registered {reg.get('model_name')} v{reg.get('version')}; champion: {reg.get('promoted')}")
    run_path = Path(work) / "runs" / record["run_id"]
    say(f"  run record: {run_path / 'run.json'}")
    say(f"  log:        {run_path / 'run.log'}")
    say(f"  adapter:    {record.get('final_adapter')}")
    uri = ((record.get("config") or {}).get("registry") or {}).get("tracking_uri") or ""
    if uri.startswith(("http://", "https://")):  # a tracking server serves its own UI
        say(f"  MLflow UI:  {uri}")
    else:  # a database URI may hold a password: name the setting, not its value
        store = "<registry.tracking_uri>" if uri else f"sqlite:///{Path(work) / 'mlflow.db'}"
        say(f"  MLflow UI:  mlflow ui --backend-store-uri {store}")


def _run_with_console(args: argparse.Namespace, cfg: Any, work: Any, night: Any) -> int:
    """Run the flow with the console (flows/console.py): lines for people, chatter in run.log."""
    from qerl.flows import console, runner

    runner.prepare_environment(work)  # before qerl.flows.rl imports Prefect, which reads its settings once
    from qerl.flows.rl import run_dir, run_id_for

    rid = run_id_for(cfg, night)
    with console.session(run_dir(work, rid), verbose=args.verbose) as ui:
        ui.line(f"run {rid}: starting (details in {run_dir(work, rid) / console.LOG_NAME})")
        record = runner.run(cfg, work, night)
    _print_run(record, str(work))
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from qerl.pipeline.planning.run_config import load_run_config
    from qerl.pipeline.planning.run_plan import parse_night

    cfg = load_run_config(args.config, args.set)
    work = Path(_work_dir(args)).resolve()
    return _run_with_console(args, cfg, work, parse_night(args.night) if args.night else None)


def _cmd_resume(args: argparse.Namespace) -> int:
    from pathlib import Path

    from qerl.flows import runner

    work = Path(_work_dir(args)).resolve()
    runner.prepare_environment(work)  # recorded_run imports Prefect
    cfg, night = runner.recorded_run(args.run_id, work)
    return _run_with_console(args, cfg, work, night)


def _cmd_schedule(args: argparse.Namespace) -> int:
    from pathlib import Path

    from qerl.flows import runner
    from qerl.pipeline.planning.run_config import load_run_config

    cfg = load_run_config(args.config, args.set)
    runner.schedule(cfg, Path(_work_dir(args)).resolve(), args.cron)
    return 0


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run benchmarks (all, or one by name) and rewrite BENCHMARKS.md")
    p.add_argument("name", nargs="?", default=None, help="quantize, score, rollout, train or contention")
    _common(p)
    COMMANDS["bench"] = _cmd_bench


def _cmd_bench(args: argparse.Namespace) -> int:
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    names = [args.name] if args.name else ["quantize", "score", "rollout", "train", "contention"]
    for name in names:
        script = root / "benchmarks" / f"bench_{name}.py"
        if not script.is_file():
            print(f"no benchmark '{name}' ({script} not found)", file=sys.stderr)
            return 2
    missed = []  # a benchmark exits 1 when it misses its goal, after writing its results: collect them all
    for name in names:
        if subprocess.run(
            [sys.executable, str(root / "benchmarks" / f"bench_{name}.py")], cwd=root
        ).returncode:
            missed.append(name)
    subprocess.run([sys.executable, str(root / "benchmarks" / "collect.py")], check=True, cwd=root)
    if missed:
        print(f"benchmarks that failed or missed their goal: {', '.join(missed)}", file=sys.stderr)
    return 1 if missed else 0


def _add_quantize(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("quantize", help="quantize a HF model (dir or hub id) to an NVFP4A16 checkpoint")
    p.add_argument(
        "src",
        metavar="SRC",
        help="local model directory, a catalogue model (smollm2-135m-instruct), or a hub id where the hub is reachable",
    )
    p.add_argument("--out", required=True, metavar="DST", help="directory to write the checkpoint to")
    p.add_argument("--config", default=None, help="YAML file with quantize settings (QuantizeConfig)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a setting")
    _common(p)
    COMMANDS["quantize"] = _cmd_quantize


def _cmd_quantize(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from qerl.pipeline.config import load_config
    from qerl.pipeline.nvfp4.checkpoint import QuantizeConfig
    from qerl.pipeline.store.artifacts import ArtifactStore
    from qerl.stages.fetch_model import resolve_base
    from qerl.stages.quantize import export, run_with_status

    t0 = time.perf_counter()
    cfg = load_config(QuantizeConfig, args.config, args.set)
    work = Path(_work_dir(args))
    store = ArtifactStore(work / "store")
    manifest, cached = run_with_status(cfg, resolve_base(args.src, store), store)
    dst = export(manifest, args.out)
    status = "cache hit" if cached else f"quantized ({manifest.mode})"
    print(
        f"{status}: {dst} ({manifest.extra.get('quantized_tensors')} linears) in {time.perf_counter() - t0:.2f}s"
    )
    return 0


def _add_score(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("score", help="score completions against gold answers (JSONL in, JSONL out)")
    p.add_argument("--input", required=True, help="JSONL file; each line has 'completion' and 'answer'")
    p.add_argument(
        "--output", required=True, help="JSONL file to write (input + correct/reward/extracted/status)"
    )
    p.add_argument("--config", default=None, help="YAML file with reward settings (RewardConfig)")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a reward setting"
    )
    _common(p)
    COMMANDS["score"] = _cmd_score


def _cmd_score(args: argparse.Namespace) -> int:
    from qerl.pipeline.config import load_config
    from qerl.pipeline.data.rewards import RewardConfig
    from qerl.stages.score import score_jsonl
    from tqdm import tqdm

    cfg = load_config(RewardConfig, args.config, args.set)
    total = None
    if os.path.isfile(args.input):
        with open(args.input, encoding="utf-8") as fh:
            total = sum(1 for line in fh if line.strip())
    with tqdm(total=total, unit="answer", desc="score") as bar:
        metrics = score_jsonl(args.input, args.output, cfg, progress=bar.update)
    print(
        f"{metrics['n']} answers: accuracy {metrics['accuracy']:.3f}, reward mean {metrics['reward_mean']:.3f}, "
        f"no_answer {metrics['no_answer_count']}, timeout {metrics['timeout_count']}, error {metrics['error_count']}, "
        f"{metrics['answers_per_s'] or 0:.0f} answers/s -> {args.output}"
    )
    return 0


def _work_dir(args: argparse.Namespace) -> str:
    from qerl.pipeline.store.artifacts import default_work_dir

    return str(default_work_dir(args.work_dir))


def _add_promote(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("promote", help="make a registered adapter version the champion (manual promotion)")
    p.add_argument("name", metavar="NAME", help="registered model name (e.g. qerl-adapter)")
    p.add_argument("version", metavar="VERSION", help="model version number")
    p.add_argument("--config", default=None, help="YAML file with registry settings (RegistryConfig)")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a registry setting"
    )
    _common(p)
    COMMANDS["promote"] = _cmd_promote


def _cmd_promote(args: argparse.Namespace) -> int:
    from qerl.pipeline.config import load_config
    from qerl.pipeline.registry import tracking as registry

    cfg = load_config(registry.RegistryConfig, args.config, args.set).model_copy(
        update={"model_name": args.name}
    )
    registry.open_tracking(cfg, _work_dir(args))
    registry.promote(cfg, args.name, args.version)
    info = registry.version_info(cfg, args.version)
    print(f"{args.name} v{args.version} is now @{cfg.champion_alias} (aliases: {', '.join(info['aliases'])})")
    return 0


def _add_eval(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="evaluate an adapter (or none) on a benchmark: pass@1 averaged over k")
    p.add_argument("--adapter", required=True, metavar="DIR|none", help="peft adapter folder, or 'none'")
    p.add_argument(
        "--benchmark", default=None, metavar="NAME", help="arithmetic|gsm8k|math500|aime24|amc23|FILE"
    )
    p.add_argument(
        "--base",
        required=True,
        metavar="DIR",
        help="checkpoint from 'qerl quantize' (or a HF model dir or catalogue model to quantize)",
    )
    p.add_argument("--engine", choices=["vllm", "hf"], default="vllm", help="rollout engine (default vllm)")
    p.add_argument("--config", default=None, help="YAML file with evaluation settings (EvalConfig)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override an eval setting, or the engine's with rollout.KEY (e.g. rollout.max_model_len=4096; "
        "by default the context is capped by the model and the LoRA rank read from the adapter)",
    )
    _common(p)
    COMMANDS["eval"] = _cmd_eval


def _cmd_eval(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from qerl.pipeline.config import apply_overrides, load_config
    from qerl.pipeline.data.rewards import RewardConfig
    from qerl.pipeline.evaluation.metrics import EvalConfig
    from qerl.pipeline.planning.run_config import eval_rollout_config
    from qerl.pipeline.rollout.engine import build_engine
    from qerl.pipeline.runtime.device import cuda_available
    from qerl.pipeline.store.artifacts import ArtifactStore
    from qerl.stages import evaluate, fetch_model

    engine_sets = [s.removeprefix("rollout.") for s in args.set if s.startswith("rollout.")]
    cfg = load_config(EvalConfig, args.config, [s for s in args.set if not s.startswith("rollout.")])
    if args.benchmark:
        cfg = apply_overrides(cfg, {"benchmark": {"dataset": args.benchmark}})
    store = ArtifactStore(Path(_work_dir(args)) / "store")
    # vLLM on CUDA serves the NVFP4 checkpoint itself; everywhere else the engine needs the twin
    need_twin = args.engine == "hf" or not cuda_available()
    base = fetch_model.resolve_base(args.base, store)  # a catalogue name becomes its directory
    quantized, twin = evaluate.base_artifacts(base, store, need_twin)
    adapter = None if args.adapter.lower() == "none" else Path(args.adapter)
    digest = None if adapter is None else store.source_digest(adapter)
    rollout_cfg = eval_rollout_config(cfg, args.engine, quantized.dir, adapter, engine_sets)
    engine = build_engine(rollout_cfg, quantized, twin)
    try:
        manifest = evaluate.run(cfg, quantized, adapter, digest, store, engine, RewardConfig())
    finally:
        engine.close()
    s = evaluate.load_summary(manifest)
    print(
        f"{s['benchmark']}: avg@{s['k']} = {s['accuracy']:.4f} +- {s['stderr']:.4f} over {s['n_items']} items "
        f"(engine {s['engine_mode']}) -> {manifest.dir}"
    )
    print(json.dumps({k: s[k] for k in ("benchmark", "accuracy", "stderr", "n_items", "k")}))
    return 0


def _add_gc(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "gc",
        help="free store space: old optimizer states, thinned adapters, trash (live runs are never touched)",
    )
    p.add_argument(
        "--dry-run", action="store_true", help="list what would be deleted and the bytes; delete nothing"
    )
    p.add_argument("--keep-optimizer-last", type=int, default=None, metavar="K",
                   help="override every run's store.keep_optimizer_last")  # fmt: skip
    p.add_argument("--keep-adapters-every", type=int, default=None, metavar="E",
                   help="override every run's store.keep_adapters_every (0: keep all adapters)")  # fmt: skip
    p.add_argument("--live-window-h", type=float, default=None, metavar="H",
                   help="override store.live_window_h: a running run updated within H hours is live")  # fmt: skip
    _common(p)
    COMMANDS["gc"] = _cmd_gc


def _cmd_gc(args: argparse.Namespace) -> int:
    from qerl.pipeline.store import retention
    from qerl.pipeline.store.artifacts import default_work_dir

    work = default_work_dir(args.work_dir)
    names = ("keep_optimizer_last", "keep_adapters_every", "live_window_h")
    overrides = {n: getattr(args, n) for n in names if getattr(args, n) is not None}
    gc_plan = retention.plan(work, overrides=overrides)
    for note in gc_plan.notes:
        print(f"  {note}")
    for d in gc_plan.deletions:
        what = ", ".join(d.files) if d.files else "(leftovers)" if d.kind == "prune" else "whole folder"
        print(f"  {retention.human_bytes(d.nbytes):>10}  {d.kind:5} {d.path}: {what}  [{d.reason}]")
    if not gc_plan.deletions:
        print(f"gc {work / 'store'}: nothing to delete")
    elif args.dry_run:
        print(
            f"gc --dry-run: would free {retention.human_bytes(gc_plan.nbytes)} in {len(gc_plan.deletions)} deletions"
        )
    else:
        freed = retention.apply(work, gc_plan)
        print(f"gc: freed {retention.human_bytes(freed)} in {len(gc_plan.deletions)} deletions")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if getattr(args, "verbose", False) else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return COMMANDS[args.command](args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        # ConfigError, ArtifactError, EngineError and friends: a clear message, not a traceback.
        if getattr(args, "verbose", False):
            raise
        print(f"qerl {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
