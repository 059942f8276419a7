"""The RL flow: quantize once, then N steps of rollout -> score -> train, evaluate, register.

Prefect lives only here and in the CLI. Every task wraps one stage; the stages cache themselves in
the content-addressed store, so Prefect's own task caching is off (``NO_CACHE``) and resumption is
exact: a re-run of the same config (``qerl run`` again or ``qerl resume RUN``) finds every finished
stage under its key and executes only what is missing, down to the half-done step. The store's key
is the task's cache key in effect; Prefect's result persistence would duplicate it.

The rollout engine is built once per run (vLLM startup is the expensive part) and handed to the
rollout and evaluate tasks; it takes each step's adapter version and AQN sigma. Only transient
failures retry (``qerl.pipeline.planning.run_plan.is_transient``: a dead engine, which ``LazyEngine`` then rebuilds,
a dropped connection, a locked database); a config error, a misconfigured engine or bad data fails
the run at once, and the run record says where. A run that dies is continued by ``qerl resume RUN``.

Two kinds of run:

- a plain run (``qerl run``): its id is ``<loop.name>-<config hash>``, so the same config is the same
  run; it trains from a fresh LoRA on the first ``loop.steps`` slots of the data stream;
- a nightly run (the ``qerl schedule`` deployment, or ``qerl run --night DATE``): its id adds the
  night (``-YYYYMMDD``, from Prefect's scheduled start time), so every night is a new run and a re-run
  of the same night is that night's run. It warm-starts from the champion (``loop.warm_start``),
  trains on the next slice of the data cursor, evaluates, registers and promotes only on a win; the
  cursor advances when the night completes (``qerl.pipeline.planning.run_plan`` has the rules).

A run of an ablation (``qerl.flows.ablate``, ``qerl ablate``) is a plain run with an ``ablation`` argument
(its id, the arm, the MLflow parent run): these become lineage tags (``ablation_id``, ``arm``) and the
registered version takes no alias, so an ablation never moves the champion.

Run records: ``<work>/runs/<run_id>/run.json`` (config, night, data slice, warm start, status,
per-step manifests, history, evaluations, registration); the console's log is ``run.log`` beside it.
Each evaluation names its benchmark (``gsm8k/test@<digest>``: name, split and the digest of the exact
items), its accuracy (avg@k) with the standard error over items, the item count and k, and the same
for each ``eval.also`` benchmark (``also``), so two runs' numbers can be compared knowing what they
measured and how precisely.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import time
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run
from qerl.flows import console
from qerl.pipeline.config import config_hash
from qerl.pipeline.data.datasets import load_problems, problems_digest
from qerl.pipeline.evaluation import metrics as ev_stats
from qerl.pipeline.planning import run_plan as runplan
from qerl.pipeline.planning.run_config import RunConfig
from qerl.pipeline.rollout.aqn import sigma_schedule
from qerl.pipeline.rollout.engine import LazyEngine, RolloutEngine
from qerl.pipeline.store import retention
from qerl.pipeline.store.artifacts import (
    ArtifactStore,
    Manifest,
    atomic_write_json,
    default_work_dir,
    package_version,
)
from qerl.stages import demo_base, evaluate, fetch_model, quantize, register, rollout, score, train

log = logging.getLogger("qerl.flow")


def _retry_transient(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect's ``retry_condition_fn``: retry a failed task only when its error is transient."""
    err = state.data if isinstance(state.data, BaseException) else None
    transient = err is not None and runplan.is_transient(err)
    log.info(
        "task %s failed with %r: %s", task.name, err, "transient, retrying" if transient else "not retried"
    )
    return transient


TASK_OPTS: dict[str, Any] = {"cache_policy": NO_CACHE, "persist_result": False}
RETRY_OPTS: dict[str, Any] = {
    **TASK_OPTS, "retries": 2, "retry_delay_seconds": 2, "retry_condition_fn": _retry_transient,
}  # fmt: skip


def run_id_for(cfg: RunConfig, night: _dt.date | None = None) -> str:
    # the retention policy (``store``) says what to delete, not what to compute: not part of the identity
    base = f"{cfg.loop.name}-{config_hash(cfg.model_dump(mode='json', exclude={'store'}))[:10]}"
    return f"{base}-{runplan.night_label(night)}" if night else base


def run_dir(work: Path, run_id: str) -> Path:
    return work / "runs" / run_id


def load_run_record(work: Path, run_id: str) -> dict[str, Any]:
    path = run_dir(work, run_id) / "run.json"
    if not path.is_file():
        known = sorted(p.name for p in (work / "runs").glob("*")) if (work / "runs").is_dir() else []
        raise FileNotFoundError(f"no run '{run_id}' under {work / 'runs'} (known runs: {known or 'none'})")
    return json.loads(path.read_text())


def _save_record(work: Path, record: dict[str, Any]) -> None:
    record["updated_at"] = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    atomic_write_json(run_dir(work, record["run_id"]) / "run.json", record)


# ---- tasks: thin wrappers over stages ------------------------------------------------------------
@task(name="base-model", **RETRY_OPTS)
def base_task(cfg: RunConfig, store: ArtifactStore) -> str:
    if cfg.model.source == "demo":
        return str(demo_base.run(cfg.model.demo, store).dir)
    return fetch_model.resolve_base(cfg.model.source, store)  # a catalogue name, a directory or a hub id


@task(name="quantize", **RETRY_OPTS)
def quantize_task(cfg: RunConfig, src: str, store: ArtifactStore) -> Manifest:
    return quantize.run(cfg.quantize, src, store)


@task(name="dequantize-twin", **RETRY_OPTS)
def twin_task(cfg: RunConfig, quantized: Manifest, store: ArtifactStore) -> Manifest:
    return quantize.run_twin(cfg.quantize, quantized, store)


@task(name="warm-start", **RETRY_OPTS)
def warm_start_task(
    cfg: RunConfig, work: Path, store: ArtifactStore, base_digest: str, version: str | None
) -> Manifest | None:
    return runplan.warm_start_adapter(cfg, work, store, base_digest, version)


@task(name="rollout", **RETRY_OPTS)
def rollout_task(
    cfg: RunConfig, problems: list[Any], base: Manifest, prev: Manifest | None, sigma: float, step: int,
    store: ArtifactStore, engine: RolloutEngine,
) -> Manifest:  # fmt: skip
    adapter_dir, digest = (prev.dir / "adapter", prev.digest) if prev else (None, None)
    return rollout.run(cfg.rollout, problems, base, adapter_dir, digest, sigma, step, store, engine)


@task(name="score", **RETRY_OPTS)
def score_task(cfg: RunConfig, rollouts: Manifest, store: ArtifactStore) -> Manifest:
    return score.run(cfg.reward, rollouts, store)


@task(name="train", **TASK_OPTS)
def train_task(
    cfg: RunConfig, base: Manifest, scored: Manifest, prev: Manifest | None, step: int, store: ArtifactStore,
    init: Manifest | None = None,
) -> Manifest:  # fmt: skip
    init_adapter = (init.dir / "adapter", init.digest) if init is not None else None
    return train.run(cfg.train, base, scored, prev, step, store, init_adapter=init_adapter)


@task(name="evaluate", **RETRY_OPTS)
def evaluate_task(
    cfg: RunConfig, base: Manifest, adapter: Manifest | None, store: ArtifactStore, engine: RolloutEngine
) -> Manifest:
    adapter_dir, digest = (adapter.dir / "adapter", adapter.digest) if adapter else (None, None)
    return evaluate.run(cfg.eval, base, adapter_dir, digest, store, engine, cfg.reward)


@task(name="register", **RETRY_OPTS)
def register_task(
    cfg: RunConfig, final: Manifest, evaluation: Manifest, lineage: dict[str, Any], history: list[dict[str, Any]],
    work: Path, store: ArtifactStore, ablation: dict[str, Any] | None = None,
) -> Manifest:  # fmt: skip
    if ablation is None:
        return register.run(
            cfg.registry, final, evaluation, lineage, history, work, complete=True, store=store
        )
    parent = {"mlflow.parentRunId": ablation["parent_run_id"]} if ablation.get("parent_run_id") else {}
    return register.run(
        cfg.registry, final, evaluation, lineage, history, work, complete=True, store=store, promote=False,
        run_tags=parent,
    )  # fmt: skip


# ---- the flow --------------------------------------------------------------------------------------
class _Run:
    """One run's state as the flow goes: config, store, record, console, and the stage timing."""

    def __init__(
        self, cfg: RunConfig, work: Path, night: _dt.date | None, ablation: dict[str, Any] | None = None
    ):
        self.cfg, self.work, self.night, self.ablation = cfg, work, night, ablation
        self.store = ArtifactStore(work / "store")
        self.run_id = run_id_for(cfg, night)
        self.ui = console.current()
        self.logger = get_run_logger()
        self.since = _dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat()
        path = run_dir(work, self.run_id) / "run.json"
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
        _save_record(self.work, self.record)


def _prepare_base(run: _Run) -> tuple[Manifest, Manifest | None]:
    cfg, store, ui = run.cfg, run.store, run.ui
    t0 = time.perf_counter()
    src = base_task(cfg, store)
    ui.stage("base", src, time.perf_counter() - t0)
    t0 = time.perf_counter()
    quantized = quantize_task(cfg, src, store)
    what = "unquantized base" if cfg.quantize.scheme == "none" else "NVFP4 checkpoint"
    ui.stage("quantize", f"{what} ({quantized.mode})", time.perf_counter() - t0, run.cached(quantized))
    twin = None
    if runplan.needs_twin(cfg.rollout, cfg.quantize.scheme):
        t0 = time.perf_counter()
        twin = twin_task(cfg, quantized, store)
        ui.stage("twin", f"dequantized {cfg.quantize.twin_dtype}", time.perf_counter() - t0, run.cached(twin))
    return quantized, twin


def _load_data(run: _Run, quantized: Manifest, twin: Manifest | None) -> list[Any]:
    """The training problems whose prompts fit the engine (issue: one over-long prompt failed a step)."""
    cfg = run.cfg
    problems = load_problems(cfg.data, "train")
    tokenizer = runplan.load_tokenizer((twin or quantized).dir)
    limit = runplan.prompt_token_limit(cfg.rollout)
    fit = runplan.fit_prompts(problems, tokenizer, cfg.rollout.template, limit)
    run.record["data"] = {**fit.report(), "dataset_digest": problems_digest(fit.kept)}
    dropped = f", {len(fit.dropped)} dropped (prompt > {limit} tokens)" if fit.dropped else ""
    run.ui.stage("data", f"{len(fit.kept)} problems from {cfg.data.dataset}/{cfg.data.split}{dropped}")
    return fit.kept


def _plan(run: _Run, quantized: Manifest, problems: list[Any]) -> Manifest | None:
    """The data slice and the warm start; a resumed run reuses its recorded plan. Returns the warm start."""
    cfg, rec = run.cfg, run.record
    stream = runplan.stream_key(rec["data"]["dataset_digest"], cfg.loop.seed, cfg.loop.prompts_per_step)
    plan = dict(run.previous.get("plan") or {})
    if not plan:
        start = 0
        if run.night is not None:
            start = runplan.DataCursor(run.work, cfg.loop.name).position(stream)
        plan = {
            "stream": stream,
            **runplan.data_slice(start, cfg.loop.steps, len(problems), cfg.loop.prompts_per_step),
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


def _train_loop(
    run: _Run, quantized: Manifest, engine: LazyEngine, problems: list[Any], warm: Manifest | None
) -> Manifest:
    cfg, store, ui, rec = run.cfg, run.store, run.ui, run.record
    steps, start = cfg.loop.steps, rec["plan"]["start_slot"]
    evals = (steps // cfg.loop.eval_every if cfg.loop.eval_every else 0) + 1 + int(cfg.loop.eval_base)
    ui.steps_start(steps, evals)
    prev: Manifest | None = None
    history: list[tuple[Manifest, Manifest]] = []  # (scored, checkpoint) per step so far
    for step in range(steps):
        t0 = time.perf_counter()
        sigma = sigma_schedule(step, steps, cfg.aqn) if cfg.aqn.enabled else 0.0
        batch = runplan.step_prompts(problems, start + step, cfg.loop.prompts_per_step, cfg.loop.seed)
        r = rollout_task(cfg, batch, quantized, prev or warm, sigma, step, store, engine)
        s = score_task(cfg, r, store)
        if (
            prev is not None
            and prev.pruned
            and train.cached(cfg.train, quantized, s, prev, step, store) is None
        ):
            prev = _heal_chain(run, quantized, history, warm)
        t = train_task(cfg, quantized, s, prev, step, store, init=warm if prev is None else None)
        history.append((s, t))
        entry = _step_record(step, sigma, r, s, t)
        rec["steps"].append(entry)
        run.logger.info(
            "step %d/%d sigma=%.2e reward=%.3f accuracy=%.3f", step + 1, steps, sigma,
            s.metrics.get("reward_mean", float("nan")), s.metrics.get("accuracy", float("nan")),
        )  # fmt: skip
        ui.step(step, entry, time.perf_counter() - t0, all(run.cached(m) for m in (r, s, t)))
        prev = t
        if step + 1 < steps and cfg.loop.eval_every and (step + 1) % cfg.loop.eval_every == 0:
            _evaluate(run, quantized, t, engine, step + 1)
        run.save()
        retention.prune_run(run.work, run.run_id, cfg.store)  # after the save: the record names this step
    ui.steps_end()
    assert prev is not None  # loop.steps >= 1
    return prev


def _heal_chain(
    run: _Run, quantized: Manifest, history: list[tuple[Manifest, Manifest]], warm: Manifest | None
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
            run.cfg.train, quantized, history[i][0], prev, i, run.store, init_adapter=init_adapter, heal=True
        )
        history[i] = (history[i][0], prev)
    assert prev is not None
    return prev


def _evaluate(
    run: _Run, quantized: Manifest, adapter: Manifest | None, engine: LazyEngine, step: int
) -> Manifest:
    t0 = time.perf_counter()
    ev = evaluate_task(run.cfg, quantized, adapter, run.store, engine)
    entry = _eval_entry(step, adapter, ev)
    run.record["evaluations"].append(entry)
    who = f"adapter after step {step}" if adapter else "base, no adapter"
    run.ui.stage("evaluate", f"{who}: {eval_text(entry)}", time.perf_counter() - t0, run.cached(ev))
    return ev


def _register(
    run: _Run, quantized: Manifest, final: Manifest, final_eval: Manifest, engine: LazyEngine
) -> None:
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


@flow(name="qerl-rl", log_prints=True)
def rl_flow(
    config: dict[str, Any], work_dir: str, nightly: bool = False, night: str | None = None,
    ablation: dict[str, Any] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """One QeRL run (see the module docstring); returns the run record.

    ``nightly``: a nightly run for the night Prefect scheduled this flow run for; ``night``
    (``YYYY-MM-DD``) names the night explicitly (and implies ``nightly``). ``ablation``: ``{"id",
    "arm", "parent_run_id"}`` of the ablation this run belongs to (never promoted)."""
    cfg = RunConfig.model_validate(config)
    if ablation is not None and (nightly or night):
        raise runplan.RunPlanError("an ablation run is a plain run, not a nightly one")
    run = _Run(cfg, default_work_dir(work_dir), _resolve_night(nightly, night), ablation)
    rec = run.record
    run.save()
    engine = None
    try:
        quantized, twin = _prepare_base(run)
        engine = LazyEngine(cfg.rollout, quantized, twin)  # started by the first stage that generates
        rec["engine_mode"] = engine.mode
        run.logger.info("run %s: engine mode %s, work dir %s", run.run_id, engine.mode, run.work)
        problems = _load_data(run, quantized, twin)
        warm = _plan(run, quantized, problems)
        final = _train_loop(run, quantized, engine, problems, warm)
        final_eval = _evaluate(run, quantized, final, engine, cfg.loop.steps)
        baseline = _evaluate(run, quantized, None, engine, 0) if cfg.loop.eval_base else None
        _register(run, quantized, final, final_eval, engine)
        rec["final_adapter"] = str(final.dir / "adapter")
        rec["baseline_accuracy"] = baseline.metrics.get("accuracy") if baseline else None
        rec["final_accuracy"] = final_eval.metrics.get("accuracy")
        rec["status"] = "completed"
        if run.night is not None:  # only a completed night consumes its slice
            cursor = runplan.DataCursor(run.work, cfg.loop.name)
            rec["plan"]["cursor_after"] = cursor.advance(
                rec["plan"]["stream"], rec["plan"]["end_slot"], run.run_id
            )
    except BaseException as err:
        rec["status"] = "failed"
        rec["error"] = f"{type(err).__name__}: {err}"
        raise
    finally:
        run.save()
        if engine is not None:
            engine.close()
        train.drop_resident_policy()  # a serving process (qerl schedule) must not keep it across nights
        _publish(rec)
    return rec


def _resolve_night(nightly: bool, night: str | None) -> _dt.date | None:
    """The night of a nightly run: explicit, else the scheduled start of this Prefect flow run."""
    if night:
        return runplan.parse_night(night)
    if not nightly:
        return None
    scheduled = flow_run.scheduled_start_time
    if scheduled is None:
        raise runplan.RunPlanError(
            "a nightly run needs a night: pass night=YYYY-MM-DD or run it from the deployment"
        )
    return runplan.parse_night(scheduled)


def _step_record(step: int, sigma: float, r: Manifest, s: Manifest, t: Manifest) -> dict[str, Any]:
    metrics: dict[str, Any] = {"step": step, "sigma": sigma}
    metrics.update({f"rollout_{k}": v for k, v in r.metrics.items() if isinstance(v, int | float)})
    keep = ("reward_mean", "reward_std", "accuracy")  # the headline names; the rest are score_*
    metrics.update(
        {k if k in keep else f"score_{k}": v for k, v in s.metrics.items() if isinstance(v, int | float)}
    )
    # a per-token mean of a step that trained no token is None: kept as null, a point the curves skip
    metrics.update(
        {f"train_{k}": v for k, v in t.metrics.items() if v is None or isinstance(v, int | float | bool)}
    )
    metrics["manifests"] = {"rollout": r.key, "score": s.key, "train": t.key}
    return metrics


def _eval_entry(step: int, adapter: Manifest | None, ev: Manifest) -> dict[str, Any]:
    """The run record's entry for one evaluation (module docstring): benchmark id, accuracy, its
    standard error, items and k, and the same for every ``eval.also`` benchmark."""
    summary = evaluate.load_summary(ev) if "summary.json" in ev.files else {}
    stderr = ev.metrics.get("stderr", summary.get("stderr"))
    if stderr is None and "items.parquet" in ev.files:  # a manifest from before stderr was recorded
        import pyarrow.parquet as pq

        stderr = ev_stats.stderr(pq.read_table(ev.file("items.parquet")).column("rate").to_pylist())
    return {
        "step": step,
        "adapter": adapter.key if adapter else None,
        "benchmark": ev.extra.get("benchmark", summary.get("benchmark")),
        "accuracy": float(ev.metrics.get("accuracy", float("nan"))),
        "stderr": None if stderr is None else float(stderr),
        "n_items": ev.metrics.get("n_items", summary.get("n_items")),
        "k": ev.metrics.get("k", summary.get("k")),
        "also": [
            {
                "benchmark": o.get("benchmark"),
                "name": f"{o.get('benchmark_name')}_{o.get('split')}",  # as the manifest's accuracy_<name>
                "accuracy": float(o["accuracy"]),
                "stderr": o.get("stderr"),
                "n_items": o.get("n_items"),
            }
            for o in summary.get("also") or []
        ],
        "manifest": str(ev.dir),
    }


def _pm(accuracy: float, stderr: float | None) -> str:
    return f"{accuracy:.3f}" if stderr is None else f"{accuracy:.3f} ± {stderr:.3f}"


def eval_text(entry: dict[str, Any]) -> str:
    """An evaluation entry in one line (console, CLI summary):
    ``accuracy 0.302 ± 0.041 (arithmetic/test@..., 100 items); gsm8k_test 0.040 ± 0.028``."""
    text = f"accuracy {_pm(entry['accuracy'], entry.get('stderr'))}"
    if entry.get("benchmark"):
        text += f" ({entry['benchmark']}, {entry.get('n_items')} items)"
    others = [f"{o['name']} {_pm(o['accuracy'], o.get('stderr'))}" for o in entry.get("also") or []]
    return "; ".join([text, *others])


def _summary_markdown(record: dict[str, Any]) -> str:
    lines = [f"# qerl run `{record['run_id']}`", "", f"status: **{record['status']}**", ""]
    evals = record.get("evaluations", [])
    if evals:
        lines += [
            "| after step | adapter | benchmark | accuracy ± stderr | items | also |",
            "|---|---|---|---|---|---|",
        ]
        for e in evals:
            also = "; ".join(
                f"{o['name']} {_pm(o['accuracy'], o.get('stderr'))}" for o in e.get("also") or []
            )
            lines.append(
                f"| {e['step']} | {e['adapter'] or 'none (base)'} | {e.get('benchmark') or ''} | "
                f"{_pm(e['accuracy'], e.get('stderr'))} | {e.get('n_items') or ''} | {also} |"
            )
    reg = record.get("registration") or {}
    if reg:
        lines += [
            "",
            f"registered `{reg.get('model_name')}` v{reg.get('version')}, champion: {reg.get('promoted')}",
        ]
    return "\n".join(lines)


def _table_row(entry: dict[str, Any]) -> dict[str, Any]:
    """An evaluation as one flat table row: each ``eval.also`` benchmark becomes its own columns."""
    row = {k: v for k, v in entry.items() if k not in ("manifest", "also")}
    for o in entry.get("also") or []:
        row.update({f"{o['name']}_accuracy": o["accuracy"], f"{o['name']}_stderr": o.get("stderr")})
    return row


def _publish(record: dict[str, Any]) -> None:
    """Prefect artifacts: a markdown summary and the evaluation table.

    Called from the flow's ``finally``: raising here would replace the run's own error, so a
    failure to publish is logged as a warning (the run record on disk holds the same facts)."""
    try:
        key = record["run_id"].lower().replace("_", "-").replace(".", "-")
        create_markdown_artifact(_summary_markdown(record), key=f"{key}-summary", description="qerl run")
        if record.get("evaluations"):
            rows = [_table_row(e) for e in record["evaluations"]]
            create_table_artifact(rows, key=f"{key}-evaluation", description="evaluations")
    except Exception as err:  # noqa: BLE001
        log.warning("could not publish Prefect artifacts for %s: %s", record.get("run_id"), err)
