"""The phases of one RL run, in the order ``qerl.flows.rl.rl_flow`` calls them: the base model and
its NVFP4 checkpoint (and dequantized twin), the training data, the plan (data slice and warm start),
the step loop (rollout -> score -> train, with interim evaluations), the final evaluation and the
registration.

``Run`` carries one run's state through them: config, store, record, console and the stage timing.
A stage found in the store is shown as cached (built before this process started). The step loop
saves the record after every step and then applies the run's retention policy; a step whose previous
checkpoint was pruned by another run's retention gets that checkpoint rebuilt first (``_heal_chain``).
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import time
from pathlib import Path
from typing import Any

from prefect import get_run_logger
from prefect.runtime import flow_run
from qerl.flows import console
from qerl.flows.rl_tasks import (
    base_task,
    evaluate_task,
    quantize_task,
    register_task,
    rollout_task,
    score_task,
    train_task,
    twin_task,
    warm_start_task,
)
from qerl.flows.run_record import eval_entry, eval_text, run_dir, run_id_for, save_record, step_record
from qerl.pipeline.config import config_hash
from qerl.pipeline.data.datasets import load_problems, problems_digest
from qerl.pipeline.planning.engine_setup import needs_twin
from qerl.pipeline.planning.prompt_fit import fit_prompts, load_tokenizer, prompt_token_limit
from qerl.pipeline.planning.prompt_stream import DataCursor, data_slice, step_prompts, stream_key
from qerl.pipeline.planning.run_config import RunConfig
from qerl.pipeline.rollout.aqn import sigma_schedule
from qerl.pipeline.rollout.lazy import LazyEngine
from qerl.pipeline.store import retention
from qerl.pipeline.store.artifact_store import ArtifactStore
from qerl.pipeline.store.code_version import package_version
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
        self.previous: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
        self.record: dict[str, Any] = {
            "run_id": self.run_id, "config": cfg.model_dump(mode="json"), "status": "running", "steps": [],
            "evaluations": [], "flow_run_id": flow_run.get_id(), "code_version": package_version(),
            "night": night.isoformat() if night else None, "ablation": ablation,
            "started_at": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        }  # fmt: skip

    def cached(self, manifest: Manifest | None) -> bool:
        """Built before this process started: a store hit (ISO timestamps in UTC compare as text)."""
        return manifest is not None and manifest.created_at < self.since

    def save(self) -> None:
        save_record(self.work, self.record)


def prepare_base(run: Run) -> tuple[Manifest, Manifest | None]:
    """The base model, its quantized checkpoint and, where the engine needs one, the dequantized twin."""
    cfg, store, ui = run.cfg, run.store, run.ui
    t0 = time.perf_counter()
    src = base_task(cfg, store)
    ui.stage("base", src, time.perf_counter() - t0)
    t0 = time.perf_counter()
    quantized = quantize_task(cfg, src, store)
    what = "unquantized base" if cfg.quantize.scheme == "none" else "NVFP4 checkpoint"
    ui.stage("quantize", f"{what} ({quantized.mode})", time.perf_counter() - t0, run.cached(quantized))
    twin = None
    if needs_twin(cfg.rollout.engine, cfg.quantize.scheme):
        t0 = time.perf_counter()
        twin = twin_task(cfg, quantized, store)
        ui.stage("twin", f"dequantized {cfg.quantize.twin_dtype}", time.perf_counter() - t0, run.cached(twin))
    return quantized, twin


def load_data(run: Run, quantized: Manifest, twin: Manifest | None) -> list[Any]:
    """The training problems whose prompts fit the engine: an over-long prompt would fail its step."""
    cfg = run.cfg
    problems = load_problems(cfg.data, "train")
    tokenizer = load_tokenizer((twin or quantized).dir)
    limit = prompt_token_limit(cfg.rollout)
    fit = fit_prompts(problems, tokenizer, cfg.rollout.template, limit)
    run.record["data"] = {**fit.report(), "dataset_digest": problems_digest(fit.kept)}
    dropped = f", {len(fit.dropped)} dropped (prompt > {limit} tokens)" if fit.dropped else ""
    run.ui.stage("data", f"{len(fit.kept)} problems from {cfg.data.dataset}/{cfg.data.split}{dropped}")
    return fit.kept


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
            warm = warm_start_task(cfg, run.work, run.store, _base_digest(quantized), pinned)
        plan["warm_start"] = {"from": "champion" if warm else "base", "version": warm.extra["version"] if warm else None}  # fmt: skip
        if warm is not None:
            plan["warm_start"]["digest"] = warm.digest
    slot_text = (
        f"slots {plan['start_slot']}..{plan['end_slot'] - 1} (epoch {', '.join(map(str, plan['epochs']))})"
    )
    start_text = f"warm start from v{warm.extra['version']}" if warm else "fresh LoRA"
    run.ui.stage("plan", f"{slot_text}, {start_text}")
    run.save()
    return warm


def _base_digest(quantized: Manifest) -> str:
    return str(quantized.extra.get("base_digest", quantized.inputs.get("base")))


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
        t0 = time.perf_counter()
        sigma = sigma_schedule(step, steps, cfg.aqn) if cfg.aqn.enabled else 0.0
        batch = step_prompts(problems, start + step, cfg.loop.prompts_per_step, cfg.loop.seed)
        r = rollout_task(cfg, batch, quantized, prev or warm, sigma, step, store, engine)
        s = score_task(cfg, r, store)
        if (
            prev is not None
            and prev.pruned
            and train.cached(cfg=cfg.train, base=quantized, scored=s, prev=prev, step=step, store=store)
            is None
        ):
            prev = _heal_chain(run, quantized, history, warm)
        t = train_task(cfg, quantized, s, prev, step, store, init=warm if prev is None else None)
        history.append((s, t))
        entry = step_record(step, sigma, r, s, t)
        rec["steps"].append(entry)
        run.logger.info(
            "step %d/%d sigma=%.2e reward=%.3f accuracy=%.3f", step + 1, steps, sigma,
            s.metrics.get("reward_mean", float("nan")), s.metrics.get("accuracy", float("nan")),
        )  # fmt: skip
        ui.step(step, entry, time.perf_counter() - t0, all(run.cached(m) for m in (r, s, t)))
        prev = t
        if step + 1 < steps and cfg.loop.eval_every and (step + 1) % cfg.loop.eval_every == 0:
            evaluate_adapter(run, quantized, t, engine, step + 1)
        run.save()
        retention.prune_run(run.work, run.run_id, cfg.store)  # after the save: the record names this step
    ui.steps_end()
    assert prev is not None  # loop.steps >= 1
    return prev


def _heal_chain(
    run: Run, quantized: Manifest, history: list[tuple[Manifest, Manifest]], warm: Manifest | None
) -> Manifest:
    """The last checkpoint of ``history`` made whole again, for a step that must be built from it.

    A run that found its steps cached can reach one it must build (it diverges from the run that
    made them: the AQN arm after the noise-free first stage) whose previous checkpoint the other
    run's retention pruned. The checkpoints from the last whole one on are rebuilt in order, each
    checked against its recorded digests (``ArtifactStore._heal``): the same bytes, so the keys
    downstream stay valid.
    """
    last_whole = max((i for i, (_, t) in enumerate(history) if not t.pruned), default=-1)
    prev = history[last_whole][1] if last_whole >= 0 else None
    log.info(
        "run %s: rebuilding the pruned checkpoints of steps %d..%d",
        run.run_id,
        last_whole + 1,
        len(history) - 1,
    )
    for i in range(last_whole + 1, len(history)):
        init = warm if prev is None else None
        init_adapter = (init.dir / "adapter", init.digest) if init is not None else None
        prev = train.run(
            cfg=run.cfg.train,
            base=quantized,
            scored=history[i][0],
            prev=prev,
            step=i,
            store=run.store,
            init_adapter=init_adapter,
            heal=True,
        )
        history[i] = (history[i][0], prev)
    assert prev is not None
    return prev


def evaluate_adapter(
    run: Run, quantized: Manifest, adapter: Manifest | None, engine: LazyEngine, step: int
) -> Manifest:
    """Evaluate ``adapter`` (None: the base alone) and add its entry to the run record."""
    t0 = time.perf_counter()
    ev = evaluate_task(run.cfg, quantized, adapter, run.store, engine)
    entry = eval_entry(step, adapter, ev)
    run.record["evaluations"].append(entry)
    who = f"adapter after step {step}" if adapter else "base, no adapter"
    run.ui.stage("evaluate", f"{who}: {eval_text(entry)}", time.perf_counter() - t0, run.cached(ev))
    return ev


def register_final(
    run: Run, quantized: Manifest, final: Manifest, final_eval: Manifest, engine: LazyEngine
) -> None:
    """Register the final adapter with its lineage (promoted on a win, never for an ablation run)."""
    rec = run.record
    lineage = {
        "base_digest": _base_digest(quantized),
        "quant_recipe": config_hash(quantized.extra.get("recipe", {}))[:16],
        "dataset_digest": rec["data"]["dataset_digest"],
        "code_version": package_version(),
        "flow_run_id": str(flow_run.get_id()),
        "run_id": run.run_id,
        "engine_mode": engine.mode,
    }
    if run.night is not None:
        lineage.update(
            night=run.night.isoformat(), warm_start=str((rec["plan"].get("warm_start") or {}).get("version"))
        )
    if run.ablation is not None:
        lineage.update(ablation_id=run.ablation["id"], arm=run.ablation["arm"])
    history = [{k: v for k, v in h.items() if k != "manifests"} for h in rec["steps"]]
    t0 = time.perf_counter()
    reg = register_task(run.cfg, final, final_eval, lineage, history, run.work, run.store, run.ablation)
    rec["registration"] = {**reg.extra, **reg.metrics}
    promoted = "champion" if reg.metrics.get("promoted") else "not promoted"
    run.ui.stage("register", f"{reg.extra.get('model_name')} v{reg.metrics.get('version')}, {promoted}",
                 time.perf_counter() - t0, run.cached(reg))  # fmt: skip
