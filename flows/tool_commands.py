"""The one-shot commands: ``qerl score``, ``quantize``, ``eval``, ``plan``, ``bench``.

Each handler turns its parsed arguments into a call of the stage or library function that does the
work and prints the result; none runs a Prefect flow. Stages are imported inside the handlers, so
``qerl --help`` stays fast and a missing optional backend only fails the command that needs it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any


def work_dir(args: argparse.Namespace) -> str:
    """The work directory: ``--work-dir``, else ``$QERL_WORK_DIR``, else ``./qerl-work``."""
    from qerl.pipeline.store.layout import default_work_dir

    return str(default_work_dir(args.work_dir))


def cmd_plan(args: argparse.Namespace) -> int:
    """``qerl plan``: the memory table; exit 1 when the run does not fit."""
    from qerl.pipeline.planning.memory_plan import plan_for_run

    plan = plan_for_run(args.model, args.gpu_mem, args.config, args.set, args.prompt_tokens, args.base)
    print(plan.render(), end="")
    return 0 if plan.fits else 1


def cmd_bench(args: argparse.Namespace) -> int:
    """``qerl bench``: each benchmark script in turn, then ``collect.py`` rewrites BENCHMARKS.md."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    names = [args.name] if args.name else ["quantize", "score", "rollout", "train", "contention"]
    for name in names:
        script = root / "benchmarks" / f"bench_{name}.py"
        if not script.is_file():  # from a checkout only: an installed qerl has no benchmarks/
            known = sorted(p.stem.removeprefix("bench_") for p in (root / "benchmarks").glob("bench_*.py"))
            raise FileNotFoundError(
                f"no benchmark '{name}' ({script} not found; benchmarks: {', '.join(known) or 'none'})"
            )
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


def cmd_quantize(args: argparse.Namespace) -> int:
    """``qerl quantize``: the checkpoint and what quantization cost. Its terminal shows a progress bar
    over the tensors; what the libraries print (transformers' loading bars) goes to a log file
    (``tool_console``), named on stderr; the result is printed after."""
    import time

    from qerl.flows import tool_console
    from qerl.pipeline.config import load_config
    from qerl.pipeline.nvfp4.quality_report import quality_line, quality_table
    from qerl.pipeline.nvfp4.recipe import UNQUANTIZED_MODE, QuantizeConfig
    from qerl.pipeline.store.artifact_store import ArtifactStore
    from qerl.pipeline.store.layout import STORE_DIR
    from qerl.stages.fetch_model import resolve_base
    from qerl.stages.quantize import export, run_with_status

    t0 = time.perf_counter()
    # `method=gptq` or, as in a run config and `qerl eval`, `quantize.method=gptq`
    prefixed = any(s.startswith("quantize.") for s in args.set)
    sets = [s.removeprefix("quantize.") for s in args.set]
    cfg = load_config(QuantizeConfig, args.config, sets, prefix="quantize" if prefixed else "")
    work = Path(work_dir(args))
    store = ArtifactStore(work / STORE_DIR)
    log_file = tool_console.log_path(work, "quantize")
    with tool_console.session(log_file, args.verbose) as ui:
        src = resolve_base(args.src, store)
        manifest, cached = run_with_status(
            cfg, src, store, progress=lambda done, total: ui.progress("quantize", done, total, "tensors")
        )
        dst = export(manifest, args.out)
        quantized = manifest.mode != UNQUANTIZED_MODE
        section = measured_quality(cfg, manifest, src, store) if quantized else None  # what it cost
    if not args.verbose:
        print(f"log: {log_file}", file=sys.stderr, flush=True)
    status = "cache hit" if cached else f"quantized ({manifest.mode})"
    print(
        f"{status}: {dst} ({manifest.extra.get('quantized_tensors')} linears) in {time.perf_counter() - t0:.2f}s"
    )
    if quantized:
        print(quality_line(section))
        if "keep" in manifest.extra:  # what mixed precision costs
            keep, mib = manifest.extra["keep"], 2**20
            print(
                f"kept dense: {len(keep['linears'])} linears, {keep['bytes'] / mib:.1f} MiB "
                f"(+{(keep['bytes'] - keep['nvfp4_bytes']) / mib:.1f} MiB over NVFP4)"
            )
        if args.report and section:
            print(quality_table(section), end="")
    return 0


def measured_quality(cfg: Any, quantized: Any, src: str, store: Any) -> dict[str, Any] | None:
    """The quality stage's section for ``quantized`` (``cfg``: its QuantizeConfig) on the held-out
    texts ``quantize.quality.source`` names; None when it is off."""
    from qerl.pipeline.data.heldout import quality_texts
    from qerl.stages import quality, quantize

    q = cfg.quality
    if not q.enabled:
        return None
    texts = quality_texts(q.source, q.texts, q.data_root)
    return quality.run(q, quantized, quantize.resolve_source(src), store, texts).extra.get("quality")


def cmd_score(args: argparse.Namespace) -> int:
    from qerl.pipeline.config import load_config
    from qerl.pipeline.data.rewards import RewardConfig
    from qerl.stages.score import score_jsonl
    from tqdm import tqdm

    cfg = load_config(RewardConfig, args.config, args.set)
    if not os.path.isfile(args.input):  # said before a progress bar is drawn
        raise FileNotFoundError(f"input file not found: {args.input}")
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


def cmd_eval(args: argparse.Namespace) -> int:
    """``qerl eval``: one adapter (or none) on one benchmark, outside any run. Its terminal shows the
    stage lines and a progress bar; the engine's output goes to a log file (``tool_console``)."""
    import json

    from qerl.flows import tool_console
    from qerl.stages import evaluate

    log_file = tool_console.log_path(work_dir(args), "eval")
    with tool_console.session(log_file, args.verbose) as ui:
        manifest, registered = _evaluate(args, ui)
    s = evaluate.load_summary(manifest)
    if not args.verbose:
        print(f"log: {log_file}", file=sys.stderr, flush=True)
    print(
        f"{s['benchmark']}: avg@{s['k']} = {s['accuracy']:.4f} +- {s['stderr']:.4f} over {s['n_items']} items "
        f"(engine {s['engine_mode']}) -> {manifest.dir}"
    )
    if registered is not None and registered.tags.get("eval_benchmark"):
        print(_registered_figure(registered, s["benchmark"]))
    print(json.dumps({k: s[k] for k in ("benchmark", "accuracy", "stderr", "n_items", "k")}))
    return 0


def _registered_figure(version: Any, benchmark: str) -> str:
    """What the registered version's own run measured, and whether it is comparable with this
    evaluation (the same benchmark id: the same items and protocol)."""
    tags = version.tags
    same = tags["eval_benchmark"] == benchmark
    where = (
        "this benchmark and protocol" if same else f"{tags['eval_benchmark']} (another benchmark or protocol)"
    )
    return f"registered: {version.name} v{version.version} at {float(tags.get('eval_accuracy', 'nan')):.4f} on {where}"


def _evaluate(args: argparse.Namespace, ui: Any) -> tuple[Any, Any]:
    """``qerl eval``'s work: the base, the adapter, the engine; the evaluate stage's manifest and the
    registered version evaluated (None for a folder or 'none')."""
    import time

    from qerl.pipeline.config import apply_overrides, load_config
    from qerl.pipeline.data.datasets import load_problems
    from qerl.pipeline.data.rewards import RewardConfig
    from qerl.pipeline.evaluation.eval_config import EvalConfig
    from qerl.pipeline.nvfp4.recipe import QuantizeConfig
    from qerl.pipeline.planning.engine_setup import eval_rollout_config, needs_twin
    from qerl.pipeline.planning.registered import run_protocol
    from qerl.pipeline.rollout.adapter_fit import check_adapter_fits
    from qerl.pipeline.rollout.factory import base_scheme, build_engine
    from qerl.pipeline.store.artifact_store import ArtifactStore
    from qerl.pipeline.store.layout import STORE_DIR
    from qerl.stages import evaluate

    sections = ("rollout", "quantize", "registry", "reward")
    sets = {
        name: [s.removeprefix(f"{name}.") for s in args.set if s.startswith(f"{name}.")] for name in sections
    }
    own = [s for s in args.set if not s.startswith(tuple(f"{name}." for name in sections))]
    registered = _registered_adapter(args.adapter, sets["registry"], work_dir(args))
    protocol = None if registered is None else run_protocol(registered, work_dir(args))
    if registered is not None:
        _say_protocol(ui, registered, protocol, work_dir(args), bool(args.config))
    if protocol is None or args.config:
        cfg = load_config(EvalConfig, args.config, own)
        reward = load_config(RewardConfig, None, sets["reward"], prefix="reward")
    else:  # the protocol the version was evaluated under
        cfg = apply_overrides(protocol.eval, own)
        reward = apply_overrides(protocol.reward, sets["reward"], "reward")
    base_recipe = None if protocol is None else protocol.quantize  # what its adapter was trained on
    recipe = None
    if sets["quantize"]:
        start = base_recipe or QuantizeConfig()
        recipe = apply_overrides(start, sets["quantize"], "quantize")
    if args.benchmark:
        cfg = apply_overrides(cfg, {"benchmark": {"dataset": args.benchmark}})
    for benchmark in (cfg.benchmark, *cfg.also):  # read before the base is built: a missing file fails now
        load_problems(benchmark)
    store = ArtifactStore(Path(work_dir(args)) / STORE_DIR)
    scheme = (recipe or base_recipe or QuantizeConfig()).scheme
    need_twin = needs_twin(args.engine, scheme)
    quantized, twin = _eval_base(args.base, need_twin, recipe, store, ui, registered, protocol, base_recipe)
    adapter = _eval_adapter(args.adapter, registered, quantized, store, ui)
    adapter = None if adapter is None else check_adapter_fits(adapter, quantized.dir)
    digest = None if adapter is None else store.source_digest(adapter)
    if twin is None and needs_twin(args.engine, base_scheme(quantized)):  # the scheme is known only now
        from qerl.stages import dequantize

        twin = dequantize.run(recipe or base_recipe or QuantizeConfig(), quantized, store)
    rollout_cfg = eval_rollout_config(cfg, args.engine, quantized.dir, adapter, sets["rollout"])
    t0 = time.perf_counter()
    engine = build_engine(rollout_cfg, quantized, twin)
    try:
        context = rollout_cfg.max_model_len  # items that leave no room for the completion are dropped
        manifest = evaluate.run(
            cfg, quantized, adapter, digest, store, engine, reward, max_model_len=context,
            progress=lambda done, total: ui.progress("evaluate", done, total),
        )  # fmt: skip
    finally:
        engine.close()
    s = evaluate.load_summary(manifest)
    ui.stage("evaluate", f"accuracy {s['accuracy']:.3f} ± {s['stderr']:.3f} ({s['benchmark']}, {s['n_items']} items)", time.perf_counter() - t0)  # fmt: skip
    return manifest, registered


def _say_protocol(ui: Any, version: Any, protocol: Any, work: str, own_config: bool) -> None:
    """The console line saying whose sections ``qerl eval`` of a registered version runs under."""
    from qerl.pipeline.store.layout import RUNS_DIR

    if own_config:
        return
    if protocol is None:
        run_id = version.tags.get("run_id")
        where = f"run {run_id}'s record is not in {Path(work) / RUNS_DIR}" if run_id else "it names no run"
        ui.stage(
            "protocol", f"the defaults ({where}, nor a protocol.json in its MLflow run; --config for another)"
        )
    elif protocol.where.startswith("run record"):
        ui.stage(
            "protocol", f"run {protocol.run_id}'s eval, reward and quantize sections (--config for another)"
        )
    else:
        ui.stage(
            "protocol",
            f"run {protocol.run_id}'s eval, reward and quantize sections, from its MLflow run's "
            "protocol.json (--config for another)",
        )


def _eval_base(
    spec: str, need_twin: bool, recipe: Any, store: Any, ui: Any, registered: Any, protocol: Any,
    run_recipe: Any,
) -> tuple[Any, Any]:  # fmt: skip
    """``qerl eval --base``: the model (a catalogue name is fetched), its quantized checkpoint (for a
    registered version the exact one it trained on, ``qerl.stages.base.registered_base``; else a
    plain model quantized by ``recipe``, else by ``run_recipe``, with a progress bar) and the twin
    where the engine needs one; a console line for the model and one for the checkpoint, as a run
    shows them. No quality report: the evaluation does not need one."""
    import time

    from qerl.flows.console import quantize_progress
    from qerl.pipeline.schemes import mode_scheme
    from qerl.stages import base as bases
    from qerl.stages import fetch_model

    t0 = time.perf_counter()
    base = fetch_model.resolve_base(spec, store)  # a catalogue name becomes its directory
    ui.stage("base", str(base), time.perf_counter() - t0)
    t0, written = time.perf_counter(), []  # a build reports its tensors; a cache hit reports nothing
    shown = quantize_progress(ui)

    def progress(done: int, total: int) -> None:
        written.append(done)
        shown(done, total)

    how = ""
    if registered is not None:
        tags = dict(registered.tags)
        quantized, twin, how = bases.registered_base(base, store, tags, protocol, recipe, need_twin, progress)
        how = f": {how}"
    else:
        plain = recipe if recipe is not None or bases.is_checkpoint(base) else run_recipe
        quantized, twin = bases.base_artifacts(base, store, need_twin, plain, progress=progress)
    what = {"none": "unquantized base", "nf4": "NF4 checkpoint"}.get(
        mode_scheme(quantized.mode), "NVFP4 checkpoint"
    )
    ui.stage("quantize", f"{what} {quantized.dir} ({quantized.mode}){how}", time.perf_counter() - t0,
             cached=not written)  # fmt: skip
    return quantized, twin


def _registered_adapter(spec: str, registry_sets: list[str], work: str) -> Any:
    """The registered version ``qerl eval --adapter models:/NAME/VERSION`` or ``models:/NAME@ALIAS``
    names (``qerl.pipeline.registry.adapters``), None for a folder or 'none'. Asked before the base
    is prepared, so a wrong name fails in seconds, not after a quantize."""
    if not spec.startswith("models:/"):
        return None
    from qerl.pipeline.config import load_config
    from qerl.pipeline.registry import adapters
    from qerl.pipeline.registry.release import check_not_released
    from qerl.pipeline.registry.tracking import RegistryConfig

    registry = load_config(RegistryConfig, None, registry_sets, prefix="registry")
    found = adapters.resolve_model_uri(spec, registry, work)
    check_not_released(found)
    return found


def _eval_adapter(spec: str, registered: Any, quantized: Any, store: Any, ui: Any) -> Path | None:
    """``qerl eval --adapter``'s folder: None for 'none', a registered version's once it is known to
    have been trained on this base (fetched into the store), else the folder as given."""
    if registered is None:
        ui.stage("adapter", "none: the base alone" if spec.lower() == "none" else spec)
        return None if spec.lower() == "none" else Path(spec)
    from qerl.pipeline.registry import adapters

    hint = "evaluate it on the base it was trained on"
    adapters.check_base(registered, adapters.base_lineage_digest(quantized), "--base", hint)
    manifest, _ = adapters.fetch_adapter(registered, store)
    ui.stage("adapter", f"{spec}: {registered.name} v{registered.version}")
    return manifest.dir / "adapter"
