"""The one-shot commands: ``qerl score``, ``quantize``, ``eval``, ``plan``, ``bench``.

Each handler turns its parsed arguments into a call of the stage or library function that does the
work and prints the result; none runs a Prefect flow. The command line imports this module only when
one of these commands runs, so ``qerl --help`` stays fast. ``qerl quantize`` and ``qerl eval`` run
under the console (``qerl.flows.console``): their stage lines and progress on the terminal, what the
libraries and the engine print in ``<work>/logs/<command>-<time>-<pid>.log``, named on stderr.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from qerl.flows import console
from qerl.pipeline.config import apply_overrides, load_config
from qerl.pipeline.data.datasets import load_problems
from qerl.pipeline.data.heldout import quality_texts
from qerl.pipeline.data.rewards import RewardConfig
from qerl.pipeline.nvfp4.quality_report import quality_line, quality_table
from qerl.pipeline.nvfp4.recipe import UNQUANTIZED_MODE, QuantizeConfig
from qerl.pipeline.planning.engine_setup import eval_rollout_config, needs_twin
from qerl.pipeline.planning.memory_plan import plan_for_run
from qerl.pipeline.planning.registered import RunProtocol, eval_settings, run_protocol
from qerl.pipeline.registry import adapters
from qerl.pipeline.registry.release import check_not_released
from qerl.pipeline.registry.tracking import RegistryConfig
from qerl.pipeline.rollout.adapter_fit import check_adapter_fits
from qerl.pipeline.rollout.factory import base_scheme, build_engine
from qerl.pipeline.schemes import mode_scheme
from qerl.pipeline.store.artifact_store import ArtifactStore
from qerl.pipeline.store.layout import RUNS_DIR, STORE_DIR, default_work_dir
from qerl.pipeline.store.manifest import Manifest
from qerl.stages import base as bases
from qerl.stages import dequantize, evaluate, quality, quantize
from qerl.stages.fetch_model import resolve_base
from qerl.stages.score import score_jsonl
from tqdm import tqdm


def cmd_plan(args: argparse.Namespace) -> int:
    """``qerl plan``: the memory table; exit 1 when the run does not fit."""
    plan = plan_for_run(args.model, args.gpu_mem, args.config, args.set, args.prompt_tokens, args.base)
    print(plan.render(), end="")
    return 0 if plan.fits else 1


def cmd_bench(args: argparse.Namespace) -> int:
    """``qerl bench``: each benchmark script in turn, then ``collect.py`` rewrites BENCHMARKS.md."""
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
    over the tensors; what the libraries print (transformers' loading bars) goes to a log file,
    named on stderr; the result is printed after."""
    t0 = time.perf_counter()
    # `method=gptq` or, as in a run config and `qerl eval`, `quantize.method=gptq`
    prefixed = any(s.startswith("quantize.") for s in args.set)
    sets = [s.removeprefix("quantize.") for s in args.set]
    cfg = load_config(QuantizeConfig, args.config, sets, prefix="quantize" if prefixed else "")
    work = default_work_dir(args.work_dir)
    store = ArtifactStore(work / STORE_DIR)
    log_file = console.log_path(work, "quantize")
    with console.session(log_file, args.verbose) as ui:
        src = resolve_base(args.src, store)
        manifest, cached = quantize.run_with_status(
            cfg, src, store, progress=lambda done, total: ui.progress("quantize", done, total, "tensors")
        )
        dst = quantize.export(manifest, args.out)
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
    q = cfg.quality
    if not q.enabled:
        return None
    texts = quality_texts(q.source, q.texts, q.data_root)
    return quality.run(q, quantized, quantize.resolve_source(src), store, texts).extra.get("quality")


def cmd_score(args: argparse.Namespace) -> int:
    cfg = load_config(RewardConfig, args.config, args.set)
    if not Path(args.input).is_file():  # said before a progress bar is drawn
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
    """``qerl eval``: one adapter (or none) on one benchmark, outside any run. A registered version
    (``models:/NAME/VERSION``, ``models:/NAME@ALIAS``) is evaluated under its run's protocol on the
    exact base it trained on (``qerl.pipeline.planning.registered``, ``qerl.stages.base``). Its
    terminal shows the stage lines and a progress bar; the engine's output goes to a log file."""
    work = default_work_dir(args.work_dir)
    log_file = console.log_path(work, "eval")
    with console.session(log_file, args.verbose) as ui:
        manifest, version = _evaluate(args, work, ui)
    s = evaluate.load_summary(manifest)
    if not args.verbose:
        print(f"log: {log_file}", file=sys.stderr, flush=True)
    print(
        f"{s['benchmark']}: avg@{s['k']} = {s['accuracy']:.4f} +- {s['stderr']:.4f} over {s['n_items']} items "
        f"(engine {s['engine_mode']}) -> {manifest.dir}"
    )
    if version is not None and version.tags.get("eval_benchmark"):
        print(registered_figure(version, s["benchmark"]))
    print(json.dumps({k: s[k] for k in ("benchmark", "accuracy", "stderr", "n_items", "k")}))
    return 0


def registered_figure(version: Any, benchmark: str) -> str:
    """What the registered version's own run measured, and whether it is comparable with this
    evaluation (the same benchmark id: the same items and protocol)."""
    tags = version.tags
    same = tags["eval_benchmark"] == benchmark
    where = (
        "this benchmark and protocol" if same else f"{tags['eval_benchmark']} (another benchmark or protocol)"
    )
    return f"registered: {version.name} v{version.version} at {float(tags.get('eval_accuracy', 'nan')):.4f} on {where}"


def _sections(sets: list[str]) -> tuple[dict[str, list[str]], list[str]]:
    """``--set`` split by the section it names (``rollout.``, ``quantize.``, ``registry.``,
    ``reward.``), and the eval settings."""
    names = ("rollout", "quantize", "registry", "reward")
    by = {n: [s.removeprefix(f"{n}.") for s in sets if s.startswith(f"{n}.")] for n in names}
    return by, [s for s in sets if not s.startswith(tuple(f"{n}." for n in names))]


def _evaluate(args: argparse.Namespace, work: Path, ui: console.RunConsole) -> tuple[Manifest, Any]:
    """``qerl eval``'s work: the protocol, the base, the adapter, the engine; the evaluate stage's
    manifest and the registered version evaluated (None for a folder or 'none')."""
    sets, own = _sections(args.set)
    version = _registered_version(args.adapter, sets["registry"], work)
    protocol = None if version is None else run_protocol(version, work)
    if version is not None and not args.config:
        ui.stage("protocol", _protocol_text(version, protocol, work))
    cfg, reward, recipe, run_recipe = eval_settings(
        protocol, args.config, own, sets["reward"], sets["quantize"]
    )
    if args.benchmark:
        cfg = apply_overrides(cfg, {"benchmark": {"dataset": args.benchmark}})
    for benchmark in (cfg.benchmark, *cfg.also):  # read before the base is built: a missing file fails now
        load_problems(benchmark)
    store = ArtifactStore(work / STORE_DIR)
    need_twin = needs_twin(args.engine, (recipe or run_recipe or QuantizeConfig()).scheme)
    quantized, twin = _base(args.base, store, need_twin, recipe, version, protocol, ui)
    adapter = _adapter(args.adapter, version, quantized, store, ui)
    adapter = None if adapter is None else check_adapter_fits(adapter, quantized.dir)
    if twin is None and needs_twin(args.engine, base_scheme(quantized)):  # the scheme is known only now
        twin = dequantize.run(recipe or run_recipe or QuantizeConfig(), quantized, store)
    rollout_cfg = eval_rollout_config(cfg, args.engine, quantized.dir, adapter, sets["rollout"])
    t0 = time.perf_counter()
    engine = build_engine(rollout_cfg, quantized, twin)
    try:
        manifest = evaluate.run(
            cfg,
            quantized,
            adapter,
            None if adapter is None else store.source_digest(adapter),
            store,
            engine,
            reward,
            max_model_len=rollout_cfg.max_model_len,
            progress=lambda d, t: ui.progress("evaluate", d, t),
        )
    finally:
        engine.close()
    s = evaluate.load_summary(manifest)
    detail = f"accuracy {s['accuracy']:.3f} ± {s['stderr']:.3f} ({s['benchmark']}, {s['n_items']} items)"
    ui.stage("evaluate", detail, time.perf_counter() - t0)
    return manifest, version


def _protocol_text(version: Any, protocol: RunProtocol | None, work: Path) -> str:
    """Whose sections ``qerl eval`` of a registered version runs under, for its console line."""
    if protocol is None:
        run_id = version.tags.get("run_id")
        where = f"run {run_id}'s record is not in {work / RUNS_DIR}" if run_id else "it names no run"
        return f"the defaults ({where}, nor a protocol.json in its MLflow run; --config for another)"
    if protocol.where.startswith("run record"):
        return f"run {protocol.run_id}'s eval, reward and quantize sections (--config for another)"
    return (
        f"run {protocol.run_id}'s eval, reward and quantize sections, from its MLflow run's protocol.json "
        "(--config for another)"
    )


def _base(
    spec: str,
    store: ArtifactStore,
    need_twin: bool,
    recipe: QuantizeConfig | None,
    version: Any,
    protocol: RunProtocol | None,
    ui: console.RunConsole,
) -> tuple[Manifest, Manifest | None]:
    """The base (``qerl.stages.base.eval_base``) with a console line for the model and one for the
    checkpoint, as a run shows them."""
    t0, written = time.perf_counter(), []  # a build reports its tensors; a cache hit reports nothing
    shown = console.quantize_progress(ui)

    def progress(done: int, total: int) -> None:
        written.append(done)
        shown(done, total)

    lineage = dict(version.tags) if version is not None else None
    src, quantized, twin, how = bases.eval_base(spec, store, need_twin, recipe, lineage, protocol, progress)
    ui.stage("base", src, time.perf_counter() - t0)
    what = {"none": "unquantized base", "nf4": "NF4 checkpoint"}.get(
        mode_scheme(quantized.mode), "NVFP4 checkpoint"
    )
    how = f": {how}" if how else ""
    ui.stage(
        "quantize",
        f"{what} {quantized.dir} ({quantized.mode}){how}",
        time.perf_counter() - t0,
        cached=not written,
    )
    return quantized, twin


def _registered_version(spec: str, registry_sets: list[str], work: Path) -> Any:
    """The registered version ``--adapter models:/...`` names, None for a folder or 'none'. Asked
    before the base is prepared, so a wrong name fails in seconds, not after a quantize."""
    if not spec.startswith("models:/"):
        return None
    registry = load_config(RegistryConfig, None, registry_sets, prefix="registry")
    found = adapters.resolve_model_uri(spec, registry, work)
    check_not_released(found)
    return found


def _adapter(
    spec: str, version: Any, quantized: Manifest, store: ArtifactStore, ui: console.RunConsole
) -> Path | None:
    """``--adapter``'s folder: None for 'none', a registered version's once it is known to have been
    trained on this base (fetched into the store), else the folder as given."""
    if version is None:
        ui.stage("adapter", "none: the base alone" if spec.lower() == "none" else spec)
        return None if spec.lower() == "none" else Path(spec)
    hint = "evaluate it on the base it was trained on"
    adapters.check_base(version, adapters.base_lineage_digest(quantized), "--base", hint)
    manifest, _ = adapters.fetch_adapter(version, store)
    ui.stage("adapter", f"{spec}: {version.name} v{version.version}")
    return manifest.dir / "adapter"
