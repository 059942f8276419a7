"""The phases of one RL run, in the order ``qerl.flows.rl.rl_flow`` calls them: the base model and
its NVFP4 checkpoint (and dequantized twin), the training data, the plan (data slice and warm start),
the step loop (rollout -> score -> train, with interim evaluations), the final evaluation and the
registration (``qerl.flows.rl_register``). From the plan on, each step's metrics (and each interim
evaluation) go to the run's MLflow run as the step ends (``qerl.pipeline.registry.live``), the run
registration completes.

The training data loses its validation slice first (``eval.validation``, chosen from the data as read,
before the base is quantized: GPTQ's calibration text leaves its questions out; the prompt fit then
filters both, so the data cursor's stream never holds it); the final evaluation scores it beside the
test benchmark, and registration compares it item by item with the champion (or the base model)
evaluated under the same protocol.

``Run`` carries one run's state through them: config, store, record, console and the stage timing.
A stage found in the store is shown as cached (built before this process started). A step or an
evaluation reports its one-time start-up (the engine's start, ``TimedEngine``; the trainer's first
load of the policy) apart from its time, for the console's ETA. The step loop
saves the record after every step and then applies the run's retention policy; a step, rollout or
evaluation that must build from a checkpoint another run's retention pruned gets it rebuilt first
(``qerl.flows.rl_heal``).
"""

from __future__ import annotations

import datetime as _dt
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefect import get_run_logger
from prefect.runtime import flow_run
from qerl.flows import console
from qerl.flows.rl_heal import heal_chain, healing
from qerl.flows.rl_tasks import (
    ablation_run_tags,
    base_task,
    evaluate_task,
    quality_task,
    quantize_task,
    rollout_task,
    score_task,
    train_task,
    twin_task,
    warm_start_task,
)
from qerl.flows.run_record import (
    carried_over,
    eval_entry,
    eval_text,
    load_run_record,
    run_dir,
    run_id_for,
    save_record,
    step_record,
)
from qerl.pipeline.data.datasets import load_problems, problems_digest
from qerl.pipeline.evaluation.eval_config import validation_split
from qerl.pipeline.nvfp4.quality_report import quality_brief, quality_line, quality_metrics
from qerl.pipeline.planning.engine_setup import needs_twin
from qerl.pipeline.planning.prompt_fit import fit_prompts, load_tokenizer, prompt_token_limit
from qerl.pipeline.planning.prompt_stream import DataCursor, data_slice, step_prompts, stream_key
from qerl.pipeline.planning.run_checks import check_model
from qerl.pipeline.planning.run_config import RunConfig
from qerl.pipeline.registry import live
from qerl.pipeline.registry.adapters import base_lineage_digest
from qerl.pipeline.rollout.aqn import sigma_schedule
from qerl.pipeline.rollout.lazy import LazyEngine
from qerl.pipeline.store import retention
from qerl.pipeline.store.artifact_store import ArtifactStore
from qerl.pipeline.store.code_version import dependency_versions, package_version
from qerl.pipeline.store.files import read_json
from qerl.pipeline.store.layout import RUN_RECORD, STORE_DIR
from qerl.pipeline.store.manifest import Manifest
from qerl.stages import train

log = logging.getLogger("qerl.flow")


class Run:
    """One run's state as the flow goes: config, store, record, console, and the stage timing."""

    def __init__(
        self, cfg: RunConfig, work: Path, night: _dt.date | None, ablation: dict[str, Any] | None = None
    ):
        self.cfg, self.work, self.night, self.ablation = cfg, work, night, ablation
        self.store = ArtifactStore(work / STORE_DIR)
        self.run_id = run_id_for(cfg, night)
        self.ui = console.current()
        self.logger = get_run_logger()
        self.since = _dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat()
        path = run_dir(work, self.run_id) / RUN_RECORD
        self.previous: dict[str, Any] = load_run_record(work, self.run_id) if path.is_file() else {}
        self.validation: list[Any] = []  # the held-out training problems promotion decides on
        self.held_out: list[Any] = []  # the validation split as read, before the prompt fit
        self.base_src = ""  # the base model the checkpoint was quantized from (``prepare_base``)
        self.quality: Manifest | None = None  # what quantization cost (``measure_quality``)
        self.live: live.LiveRun | None = None  # its MLflow run, from the plan on (``open_live``)
        self.stopped = False  # set when the attempt passed loop.deadline_h (``park_if_stopped``)
        self.record: dict[str, Any] = {
            "run_id": self.run_id, "config": cfg.model_dump(mode="json"), "status": "running", "steps": [],
            "evaluations": [], "flow_run_id": flow_run.get_id(), "code_version": package_version(),
            "versions": dependency_versions(), "night": night.isoformat() if night else None, "ablation": ablation,
            "started_at": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        }  # fmt: skip
        self.record.update(carried_over(self.previous))  # from the first save on: a crash keeps the plan

    def cached(self, manifest: Manifest | None) -> bool:
        """Built before this process started: a store hit (ISO timestamps in UTC compare as text)."""
        return manifest is not None and manifest.created_at < self.since

    def save(self) -> None:
        self.park_if_stopped()
        save_record(self.work, self.record)

    def park_if_stopped(self) -> None:
        """Past its deadline (``qerl.flows.deadline``) the attempt's thread waits here for the exit:
        the record is the deadline's, and nothing is registered or advanced after it."""
        if self.stopped:
            threading.Event().wait()


class TimedEngine(LazyEngine):
    """A ``LazyEngine`` that adds up the seconds spent bringing its engine up (``startup_s``; a
    rebuild after a death too): the step or evaluation that pays it reports it as start-up, which the
    console's ETA leaves out."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.startup_s = 0.0

    def _real(self) -> Any:
        if self.started:
            return super()._real()
        t0 = time.perf_counter()
        try:
            return super()._real()
        finally:
            self.startup_s += time.perf_counter() - t0


def _engine_startup(engine: LazyEngine) -> float:
    """The engine's start-up seconds so far (``TimedEngine``; 0 for another engine: a lookup of a
    missing attribute would start a ``LazyEngine``'s engine)."""
    return engine.startup_s if isinstance(engine, TimedEngine) else 0.0


def _policy_load(run: Run, t: Manifest) -> float:
    """The trainer's one-time load of the policy, when this process built step ``t`` from a loaded
    (not resident) one: start-up, like the engine's."""
    if run.cached(t) or t.extra.get("policy") != "loaded":
        return 0.0
    return float(t.extra.get("policy_load_s") or 0.0)


def prepare_base(run: Run) -> tuple[Manifest, Manifest | None]:
    """The base model, its quantized checkpoint and, where the engine needs one, the dequantized twin."""
    cfg, store, ui = run.cfg, run.store, run.ui
    t0 = time.perf_counter()
    src = base_task(cfg, store, frozenset(p["group"] for p in run.held_out if p.get("group")))
    ui.stage("base", src, time.perf_counter() - t0)
    if (Path(src) / "config.json").is_file():  # the demo's and the catalogue's are known only now
        check_model(cfg.rollout, read_json(Path(src) / "config.json"))
    run.base_src = src
    t0 = time.perf_counter()
    held_out = frozenset(p["question"] for p in run.held_out)
    quantized = quantize_task(cfg, src, store, console.quantize_progress(ui), held_out)
    what = {"none": "unquantized base", "nf4": "NF4 checkpoint"}.get(cfg.quantize.scheme, "NVFP4 checkpoint")
    ui.stage("quantize", f"{what} ({quantized.mode})", time.perf_counter() - t0, run.cached(quantized))
    run.record["quantize"] = {  # what an ablation's report shows of each arm's starting point
        "manifest": str(quantized.dir),
        "mode": quantized.mode,
        "method": {"nvfp4": cfg.quantize.method, "nf4": "nf4 (bitsandbytes)"}.get(cfg.quantize.scheme),
    }
    twin = None
    if needs_twin(cfg.rollout.engine, cfg.quantize.scheme):
        t0 = time.perf_counter()
        twin = twin_task(cfg, quantized, store)
        ui.stage("twin", f"dequantized {cfg.quantize.twin_dtype}", time.perf_counter() - t0, run.cached(twin))
    return quantized, twin


def measure_quality(run: Run, quantized: Manifest) -> None:
    """What quantization cost (``quantize.quality``), the quality stage's, on the run's validation
    texts where it has them: a line on the console, the whole in the run's log, the numbers in the
    record; nothing for an unquantized base."""
    cfg = run.cfg
    if cfg.quantize.scheme == "none" or not cfg.quantize.quality.enabled:
        return
    t0 = time.perf_counter()
    run.quality = quality_task(cfg, quantized, run.base_src, run.store, run.validation)
    section = run.quality.extra.get("quality")
    texts = (section or {}).get("texts")
    on = f" on {texts['count']} {texts['source']} texts" if texts else ""
    run.ui.stage("quality", quality_brief(section).removeprefix(", ") + on, time.perf_counter() - t0,
                 run.cached(run.quality))  # fmt: skip
    run.logger.info(quality_line(section))
    run.record["quantize"].update(quality_metrics(section))


def read_data(run: Run) -> list[Any]:
    """The training problems as the data gives them, read before anything is built: a malformed file,
    or a benchmark that cannot be read (too few arithmetic problems, a broken file), fails the run
    before the base model is fetched or quantized, not at its first evaluation."""
    rows = load_problems(run.cfg.data, "train")
    for bench in (run.cfg.eval.benchmark, *run.cfg.eval.also):
        load_problems(bench)
    run.held_out = validation_split(rows, run.cfg.eval.validation)[1]
    return rows


def load_data(run: Run, quantized: Manifest, twin: Manifest | None, problems: list[Any]) -> list[Any]:
    """The training problems (``read_data``'s) whose prompts fit the engine: an over-long prompt
    would fail its step."""
    cfg = run.cfg
    tokenizer = load_tokenizer((twin or quantized).dir)
    limit = prompt_token_limit(cfg.rollout)
    fit = fit_prompts(problems, tokenizer, cfg.rollout.template, limit)
    held = {p["id"] for p in run.held_out}  # chosen before the fit, which may drop some of them
    kept = [p for p in fit.kept if p["id"] not in held]
    run.validation = [p for p in fit.kept if p["id"] in held]
    run.record["data"] = {**fit.report(), "dataset_digest": problems_digest(kept)}
    run.record["data"]["validation"] = {
        "n_items": len(run.validation), "digest": problems_digest(run.validation)
    }  # fmt: skip
    dropped = f", {len(fit.dropped)} dropped (prompt > {limit} tokens)" if fit.dropped else ""
    held = f", {len(run.validation)} held out for validation" if run.validation else ""
    run.ui.stage("data", f"{len(kept)} problems from {cfg.data.dataset}/{cfg.data.split}{dropped}{held}")
    return kept


def plan_data(run: Run, quantized: Manifest, problems: list[Any]) -> Manifest | None:
    """The data slice and the warm start; a resumed run reuses its recorded plan. Returns the warm start."""
    cfg, rec = run.cfg, run.record
    stream = stream_key(rec["data"]["dataset_digest"], cfg.loop.seed, cfg.loop.prompts_per_step)
    plan = dict(run.previous.get("plan") or {})
    if not plan:
        start = 0
        if run.night is not None:
            start = DataCursor(run.work, cfg.loop.name).position(stream)
        plan = {
            "stream": stream,
            **data_slice(start, cfg.loop.steps, len(problems), cfg.loop.prompts_per_step),
        }
    rec["plan"] = plan
    if max(plan["epochs"]) > 0:
        run.logger.warning(
            "data slots %d..%d reach epoch %d: the %d problems were all used, a new shuffled epoch repeats them",
            plan["start_slot"], plan["end_slot"] - 1, max(plan["epochs"]), len(problems),
        )  # fmt: skip
    warm = None
    if run.night is not None and cfg.loop.warm_start == "champion":
        pinned = (plan.get("warm_start") or {}).get("version")
        if "warm_start" not in plan or pinned:  # a resumed night started from base stays on base
            warm = warm_start_task(cfg, run.work, run.store, base_lineage_digest(quantized), pinned)
        plan["warm_start"] = {"from": "champion" if warm else "base", "version": warm.extra["version"] if warm else None}  # fmt: skip
        if warm is not None:
            plan["warm_start"]["digest"] = warm.digest
    elif run.night is not None:  # loop.warm_start: base; recorded, as the MLflow tags read it
        plan["warm_start"] = {"from": "base", "version": None}
    slot_text = (
        f"slots {plan['start_slot']}..{plan['end_slot'] - 1} (epoch {', '.join(map(str, plan['epochs']))})"
    )
    start_text = f"warm start from v{warm.extra['version']}" if warm else "fresh LoRA"
    run.ui.stage("plan", f"{slot_text}, {start_text}")
    run.save()
    return warm


def open_live(run: Run) -> None:
    """Open the run's MLflow run for its step metrics (``qerl.pipeline.registry.live``), tagged with
    what is known of its lineage before the first step."""
    rec, tags = run.record, {"flow_run_id": run.record["flow_run_id"], "code_version": package_version()}
    if run.night is not None:
        tags.update(night=run.night.isoformat(), warm_start=str(rec["plan"]["warm_start"].get("version")))
    if run.ablation is not None:
        tags.update(
            ablation_id=run.ablation["id"], arm=run.ablation["arm"], **ablation_run_tags(run.ablation)
        )
    run.live = live.open_run(run.cfg.registry, run.work, rec, run.previous, tags)


def train_loop(
    run: Run, quantized: Manifest, engine: LazyEngine, problems: list[Any], warm: Manifest | None
) -> Manifest:
    """The RL steps (rollout -> score -> train, an evaluation every ``loop.eval_every``); returns the
    last checkpoint."""
    cfg, store, ui, rec = run.cfg, run.store, run.ui, run.record
    steps, start = cfg.loop.steps, rec["plan"]["start_slot"]
    evals = (steps // cfg.loop.eval_every if cfg.loop.eval_every else 0) + 1 + int(cfg.loop.eval_base)
    ui.steps_start(steps, evals)
    prev: Manifest | None = None
    history: list[tuple[Manifest, Manifest]] = []  # (scored, checkpoint) per step so far
    for step in range(steps):
        t0, engine_s = time.perf_counter(), _engine_startup(engine)
        sigma = sigma_schedule(step, steps, cfg.aqn) if cfg.aqn.enabled else 0.0
        batch = step_prompts(problems, start + step, cfg.loop.prompts_per_step, cfg.loop.seed)
        r, prev = healing(  # a pruned adapter of prev is rebuilt first
            run, quantized, history, warm, prev,
            lambda p, b=batch, sg=sigma, k=step: rollout_task(cfg, b, quantized, p or warm, sg, k, store, engine),
        )  # fmt: skip
        s = score_task(cfg, r, store)
        if (
            prev is not None
            and prev.pruned
            and train.cached(cfg=cfg.train, base=quantized, scored=s, prev=prev, step=step, store=store)
            is None
        ):
            prev = heal_chain(run, quantized, history, warm)
        t = train_task(cfg, quantized, s, prev, step, store, init=warm if prev is None else None)
        history.append((s, t))
        entry = step_record(step, sigma, r, s, t)
        rec["steps"].append(entry)
        run.logger.info(
            "step %d/%d sigma=%.2e reward=%.3f accuracy=%.3f", step + 1, steps, sigma,
            s.metrics.get("reward_mean", float("nan")), s.metrics.get("accuracy", float("nan")),
        )  # fmt: skip
        startup = _engine_startup(engine) - engine_s + _policy_load(run, t)
        ui.step(step, entry, time.perf_counter() - t0, all(run.cached(m) for m in (r, s, t)), startup)
        prev = t
        if step + 1 < steps and cfg.loop.eval_every and (step + 1) % cfg.loop.eval_every == 0:
            _, prev = healing(
                run,
                quantized,
                history,
                warm,
                t,
                lambda p, k=step + 1: evaluate_adapter(run, quantized, p, engine, k),
            )
        if run.live is not None:
            live.log_record(run.live, rec)
        run.save()
        retention.prune_run(run.work, run.run_id, cfg.store)  # after the save: the record names this step
    ui.steps_end()
    assert prev is not None  # loop.steps >= 1
    return prev


def evaluate_adapter(
    run: Run, quantized: Manifest, adapter: Manifest | None, engine: LazyEngine, step: int,
    validation: list[Any] | None = None,
) -> Manifest:  # fmt: skip
    """Evaluate ``adapter`` (None: the base alone), and ``validation`` beside the benchmark; add its
    entry to the run record."""
    t0, engine_s = time.perf_counter(), _engine_startup(engine)
    ev = evaluate_task(run.cfg, quantized, adapter, run.store, engine, validation, progress=_progress(run))
    entry = eval_entry(step, adapter, ev)
    if "accuracy_validation" in ev.metrics:
        entry["validation"] = {
            "benchmark": ev.extra.get("validation"),
            "accuracy": ev.metrics["accuracy_validation"],
            "stderr": ev.metrics.get("stderr_validation"),
        }
    run.record["evaluations"].append(entry)
    who = f"adapter after step {step}" if adapter else "base, no adapter"
    run.ui.stage("evaluate", f"{who}: {eval_text(entry)}", time.perf_counter() - t0, run.cached(ev),
                 startup=_engine_startup(engine) - engine_s)  # fmt: skip
    return ev


def _progress(run: Run) -> Callable[[int, int], None]:
    """The evaluate stage's ``progress(done, total)``, shown by the run's console."""

    def progress(done: int, total: int) -> None:
        run.ui.progress("evaluate", done, total)

    return progress
