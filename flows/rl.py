"""The RL flow: quantize once, then N steps of rollout -> score -> train, evaluate, register.

Prefect lives only here and in the CLI. Every task wraps one stage; the stages cache themselves in
the content-addressed store, so Prefect's own task caching is off (``NO_CACHE``) and resumption is
exact: a re-run of the same config (``qerl run`` again or ``qerl resume RUN``) finds every finished
stage under its key and executes only what is missing, down to the half-done step. The store's key
is the task's cache key in effect; Prefect's result persistence would duplicate it.

The rollout engine is built once per run (vLLM startup is the expensive part) and handed to the
rollout and evaluate tasks; it takes each step's adapter version and AQN sigma. Transient failures
(an engine hiccup, a locked database) retry; deterministic ones fail the run, and the run record
says where. A run that dies is continued by ``qerl resume RUN`` with the same config.

Run records: ``<work>/runs/<run_id>/run.json`` (config, status, per-step manifests, history,
registration). The run id is a hash of the config, so "the same config" means the same run.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import random
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run

from pipeline.aqn import sigma_schedule
from pipeline.artifacts import ArtifactStore, Manifest, atomic_write_json, default_work_dir, package_version
from pipeline.config import config_hash
from pipeline.data import load_problems, problems_digest
from pipeline.engines import LazyEngine, RolloutEngine
from pipeline.runconfig import RunConfig
from stages import demo_base, evaluate, quantize, register, rollout, score, train

log = logging.getLogger("qerl.flow")

TASK_OPTS: dict[str, Any] = {"cache_policy": NO_CACHE, "persist_result": False}
RETRY_OPTS: dict[str, Any] = {**TASK_OPTS, "retries": 2, "retry_delay_seconds": 2}


def run_id_for(cfg: RunConfig) -> str:
    return f"{cfg.loop.name}-{config_hash(cfg)[:10]}"


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


def step_prompts(problems: list[Any], step: int, n: int, seed: int) -> list[Any]:
    """The step's prompts: a seeded pass over shuffled epochs, so every problem is used in turn."""
    per_epoch = max(1, len(problems) // n)
    epoch, slot = divmod(step, per_epoch)
    order = list(range(len(problems)))
    random.Random(f"qerl-prompts-{seed}-{epoch}").shuffle(order)
    return [problems[i] for i in order[slot * n : slot * n + n]]


# ---- tasks: thin wrappers over stages ------------------------------------------------------------
@task(name="base-model", **RETRY_OPTS)
def base_task(cfg: RunConfig, store: ArtifactStore) -> str:
    if cfg.model.source == "demo":
        return str(demo_base.run(cfg.model.demo, store).dir)
    return cfg.model.source


@task(name="quantize", **RETRY_OPTS)
def quantize_task(cfg: RunConfig, src: str, store: ArtifactStore) -> Manifest:
    return quantize.run(cfg.quantize, src, store)


@task(name="dequantize-twin", **RETRY_OPTS)
def twin_task(cfg: RunConfig, quantized: Manifest, store: ArtifactStore) -> Manifest:
    return quantize.run_twin(cfg.quantize, quantized, store)


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
    cfg: RunConfig, base: Manifest, scored: Manifest, prev: Manifest | None, step: int, store: ArtifactStore
) -> Manifest:
    return train.run(cfg.train, base, scored, prev, step, store)


@task(name="evaluate", **RETRY_OPTS)
def evaluate_task(
    cfg: RunConfig, base: Manifest, adapter: Manifest | None, store: ArtifactStore, engine: RolloutEngine
) -> Manifest:
    adapter_dir, digest = (adapter.dir / "adapter", adapter.digest) if adapter else (None, None)
    return evaluate.run(cfg.eval, base, adapter_dir, digest, store, engine, cfg.reward)


@task(name="register", **RETRY_OPTS)
def register_task(
    cfg: RunConfig, final: Manifest, evaluation: Manifest, lineage: dict[str, Any], history: list[dict[str, Any]],
    work: Path, store: ArtifactStore,
) -> Manifest:  # fmt: skip
    return register.run(cfg.registry, final, evaluation, lineage, history, work, True, store)


# ---- the flow --------------------------------------------------------------------------------------
def _step_record(step: int, sigma: float, r: Manifest, s: Manifest, t: Manifest) -> dict[str, Any]:
    metrics: dict[str, Any] = {"step": step, "sigma": sigma}
    metrics.update({f"rollout_{k}": v for k, v in r.metrics.items() if isinstance(v, int | float)})
    keep = ("reward_mean", "reward_std", "accuracy")  # the headline names; the rest are score_*
    metrics.update(
        {k if k in keep else f"score_{k}": v for k, v in s.metrics.items() if isinstance(v, int | float)}
    )
    metrics.update({f"train_{k}": v for k, v in t.metrics.items() if isinstance(v, int | float | bool)})
    metrics["manifests"] = {"rollout": r.key, "score": s.key, "train": t.key}
    return metrics


def _summary_markdown(record: dict[str, Any]) -> str:
    lines = [f"# qerl run `{record['run_id']}`", "", f"status: **{record['status']}**", ""]
    evals = record.get("evaluations", [])
    if evals:
        lines += ["| after step | adapter | accuracy |", "|---|---|---|"]
        lines += [f"| {e['step']} | {e['adapter'] or 'none (base)'} | {e['accuracy']:.3f} |" for e in evals]
    reg = record.get("registration") or {}
    if reg:
        lines += [
            "",
            f"registered `{reg.get('model_name')}` v{reg.get('version')}, champion: {reg.get('promoted')}",
        ]
    return "\n".join(lines)


@flow(name="qerl-rl", log_prints=True)
def rl_flow(config: dict[str, Any], work_dir: str) -> dict[str, Any]:
    """One QeRL run (see the module docstring); returns the run record."""
    cfg = RunConfig.model_validate(config)
    work = default_work_dir(work_dir)
    store = ArtifactStore(work / "store")
    logger = get_run_logger()
    rid = run_id_for(cfg)
    record: dict[str, Any] = {
        "run_id": rid, "config": cfg.model_dump(mode="json"), "status": "running", "steps": [],
        "evaluations": [], "flow_run_id": flow_run.get_id(), "code_version": package_version(),
        "started_at": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
    }  # fmt: skip
    _save_record(work, record)
    engine = None
    try:
        src = base_task(cfg, store)
        quantized = quantize_task(cfg, src, store)
        twin = None if _has_cuda() else twin_task(cfg, quantized, store)
        engine = LazyEngine(cfg.rollout, quantized, twin)  # started by the first stage that generates
        record["engine_mode"] = engine.mode
        logger.info("run %s: base %s, engine mode %s, work dir %s", rid, src, engine.mode, work)
        problems = load_problems(cfg.data, "train")
        prev: Manifest | None = None
        steps = cfg.loop.steps
        for step in range(steps):
            sigma = sigma_schedule(step, steps, cfg.aqn) if cfg.aqn.enabled else 0.0
            batch = step_prompts(problems, step, cfg.loop.prompts_per_step, cfg.loop.seed)
            r = rollout_task(cfg, batch, quantized, prev, sigma, step, store, engine)
            s = score_task(cfg, r, store)
            t = train_task(cfg, quantized, s, prev, step, store)
            record["steps"].append(_step_record(step, sigma, r, s, t))
            logger.info(
                "step %d/%d sigma=%.2e reward=%.3f accuracy=%.3f", step + 1, steps, sigma,
                s.metrics.get("reward_mean", float("nan")), s.metrics.get("accuracy", float("nan")),
            )  # fmt: skip
            prev = t
            last = step + 1 == steps
            if last or (cfg.loop.eval_every and (step + 1) % cfg.loop.eval_every == 0):
                ev = evaluate_task(cfg, quantized, t, store, engine)
                record["evaluations"].append(_eval_entry(step + 1, t, ev))
            _save_record(work, record)
        baseline = None
        if cfg.loop.eval_base:
            baseline = evaluate_task(cfg, quantized, None, store, engine)
            record["evaluations"].append(_eval_entry(0, None, baseline))
        final_eval = evaluate_task(cfg, quantized, prev, store, engine)
        lineage = {
            "base_digest": quantized.extra.get("base_digest", quantized.inputs.get("base")),
            "quant_recipe": config_hash(quantized.extra.get("recipe", {}))[:16],
            "dataset_digest": problems_digest(problems),
            "code_version": package_version(),
            "flow_run_id": str(flow_run.get_id()),
            "run_id": rid,
            "engine_mode": engine.mode,
        }
        history = [{k: v for k, v in h.items() if k != "manifests"} for h in record["steps"]]
        reg = register_task(cfg, prev, final_eval, lineage, history, work, store)
        record["registration"] = {**reg.extra, **reg.metrics}
        record["final_adapter"] = str(prev.dir / "adapter")
        record["baseline_accuracy"] = baseline.metrics.get("accuracy") if baseline else None
        record["final_accuracy"] = final_eval.metrics.get("accuracy")
        record["status"] = "completed"
    except BaseException as err:
        record["status"] = "failed"
        record["error"] = f"{type(err).__name__}: {err}"
        raise
    finally:
        _save_record(work, record)
        if engine is not None:
            engine.close()
        _publish(record)
    return record


def _eval_entry(step: int, adapter: Manifest | None, ev: Manifest) -> dict[str, Any]:
    return {
        "step": step,
        "adapter": adapter.key if adapter else None,
        "accuracy": float(ev.metrics.get("accuracy", float("nan"))),
        "manifest": str(ev.dir),
    }


def _publish(record: dict[str, Any]) -> None:
    """Prefect artifacts: a markdown summary and the evaluation table.

    Called from the flow's ``finally``: raising here would replace the run's own error, so a
    failure to publish is logged as a warning (the run record on disk holds the same facts)."""
    try:
        key = record["run_id"].lower().replace("_", "-").replace(".", "-")
        create_markdown_artifact(_summary_markdown(record), key=f"{key}-summary", description="qerl run")
        if record.get("evaluations"):
            rows = [{k: v for k, v in e.items() if k != "manifest"} for e in record["evaluations"]]
            create_table_artifact(rows, key=f"{key}-evaluation", description="evaluations")
    except Exception as err:  # noqa: BLE001
        log.warning("could not publish Prefect artifacts for %s: %s", record.get("run_id"), err)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
