"""The RL flow's Prefect tasks: each wraps one stage (``qerl.stages``) and does nothing else.

The stages cache themselves in the content-addressed store, so Prefect's own task caching is off
(``NO_CACHE``) and results are not persisted: the store's key is the task's cache key in effect.
Only transient failures retry (``RETRY_OPTS``: ``qerl.pipeline.planning.retry.is_transient``: a dead
engine, which ``LazyEngine`` then rebuilds, a dropped connection, a locked database); a config error,
a misconfigured engine or bad data fails the run at once. ``train`` takes no retries (``TASK_OPTS``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from qerl.pipeline.planning.retry import is_transient
from qerl.pipeline.planning.run_config import RunConfig
from qerl.pipeline.planning.warm_start import warm_start_adapter
from qerl.pipeline.rollout.protocol import RolloutEngine
from qerl.pipeline.store.artifact_store import ArtifactStore
from qerl.pipeline.store.manifest import Manifest
from qerl.stages import (
    demo_base,
    dequantize,
    evaluate,
    fetch_model,
    quality,
    quantize,
    register,
    rollout,
    score,
    train,
)

log = logging.getLogger("qerl.flow")


def _retry_transient(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect's ``retry_condition_fn``: retry a failed task only when its error is transient."""
    err = state.data if isinstance(state.data, BaseException) else None
    transient = err is not None and is_transient(err)
    log.info(
        "task %s failed with %r: %s", task.name, err, "transient, retrying" if transient else "not retried"
    )
    return transient


TASK_OPTS: dict[str, Any] = {"cache_policy": NO_CACHE, "persist_result": False}
RETRY_OPTS: dict[str, Any] = {
    **TASK_OPTS, "retries": 2, "retry_delay_seconds": 2, "retry_condition_fn": _retry_transient,
}  # fmt: skip


@task(name="base-model", **RETRY_OPTS)
def base_task(cfg: RunConfig, store: ArtifactStore, exclude: frozenset[str] = frozenset()) -> str:
    """The base model's directory; the demo's warm-up leaves out the groups in ``exclude``."""
    if cfg.model.source == "demo":
        return str(demo_base.run(cfg.model.demo, store, exclude).dir)
    return fetch_model.resolve_base(cfg.model.source, store)  # a catalogue name, a directory or a hub id


@task(name="quantize", **RETRY_OPTS)
def quantize_task(
    cfg: RunConfig,
    src: str,
    store: ArtifactStore,
    progress: Callable[[int, int], None] | None = None,
    held_out: frozenset[str] = frozenset(),
) -> Manifest:
    """gptq calibrates on the run's data config, its prompts rendered with the template the rollouts
    use (``rollout.template``, as the validation items are), never on a question of ``held_out`` (the
    run's validation split); ``progress(done, total)``: tensors written."""
    data = cfg.data.model_copy(update={"template": cfg.rollout.template})
    return quantize.run(cfg.quantize, src, store, data, progress, held_out)


@task(name="quality", **TASK_OPTS)  # two whole models: an out-of-memory error is not transient
def quality_task(
    cfg: RunConfig, quantized: Manifest, src: str, store: ArtifactStore, validation: list[Any]
) -> Manifest:
    """What quantization cost, on the run's validation texts where it has them (``quantize.quality``)."""
    from qerl.pipeline.data.heldout import quality_texts

    q = cfg.quantize.quality
    data = cfg.data.model_copy(update={"template": cfg.rollout.template})
    texts = quality_texts(q.source, q.texts, q.data_root or cfg.data.root, data, validation)
    return quality.run(q, quantized, quantize.resolve_source(src), store, texts)


@task(name="dequantize-twin", **RETRY_OPTS)
def twin_task(cfg: RunConfig, quantized: Manifest, store: ArtifactStore) -> Manifest:
    return dequantize.run(cfg.quantize, quantized, store)


@task(name="warm-start", **RETRY_OPTS)
def warm_start_task(
    cfg: RunConfig, work: Path, store: ArtifactStore, base_digest: str, version: str | None
) -> Manifest | None:
    return warm_start_adapter(cfg, work, store, base_digest, version)


@task(name="rollout", **RETRY_OPTS)
def rollout_task(
    cfg: RunConfig, problems: list[Any], base: Manifest, prev: Manifest | None, sigma: float, step: int,
    store: ArtifactStore, engine: RolloutEngine,
) -> Manifest:  # fmt: skip
    adapter_dir, digest = (prev.dir / "adapter", prev.digest) if prev else (None, None)
    return rollout.run(
        cfg=cfg.rollout,
        problems=problems,
        base=base,
        adapter_dir=adapter_dir,
        adapter_digest=digest,
        sigma=sigma,
        step=step,
        store=store,
        engine=engine,
    )


@task(name="score", **RETRY_OPTS)
def score_task(cfg: RunConfig, rollouts: Manifest, store: ArtifactStore) -> Manifest:
    return score.run(cfg.reward, rollouts, store)


@task(name="train", **TASK_OPTS)
def train_task(
    cfg: RunConfig, base: Manifest, scored: Manifest, prev: Manifest | None, step: int, store: ArtifactStore,
    init: Manifest | None = None,
) -> Manifest:  # fmt: skip
    init_adapter = (init.dir / "adapter", init.digest) if init is not None else None
    return train.run(
        cfg=cfg.train, base=base, scored=scored, prev=prev, step=step, store=store, init_adapter=init_adapter
    )


@task(name="evaluate", **RETRY_OPTS)
def evaluate_task(
    cfg: RunConfig, base: Manifest, adapter: Manifest | None, store: ArtifactStore, engine: RolloutEngine,
    validation: list[Any] | None = None, adapter_digest: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Manifest:  # fmt: skip
    """``validation``: the run's held-out training problems, evaluated beside the benchmark;
    ``adapter_digest``: the adapter's identity when it is not ``adapter``'s own digest (a registered
    champion fetched through the warm-start stage is known by its train digest); ``progress(done,
    total)``: the items generated so far (the console's progress line)."""
    adapter_dir, digest = (
        (adapter.dir / "adapter", adapter_digest or adapter.digest) if adapter else (None, None)
    )
    held_out = (
        (cfg.data.model_copy(update={"template": cfg.rollout.template}), validation) if validation else None
    )
    return evaluate.run(
        cfg.eval, base, adapter_dir, digest, store, engine, cfg.reward, held_out, progress,
        max_model_len=cfg.rollout.max_model_len,  # items that leave no room for the completion are dropped
    )  # fmt: skip


@task(name="register", **RETRY_OPTS)
def register_task(
    cfg: RunConfig, final: Manifest, evaluation: Manifest, lineage: dict[str, Any], history: list[dict[str, Any]],
    work: Path, store: ArtifactStore, ablation: dict[str, Any] | None = None,
    champion_eval: tuple[str, Manifest] | str | None = None, mlflow_run_id: str | None = None,
) -> Manifest:  # fmt: skip
    if ablation is None:
        return register.run(
            cfg.registry, final, evaluation, lineage, history, work, complete=True, store=store,
            champion_eval=champion_eval, mlflow_run_id=mlflow_run_id,
        )  # fmt: skip
    return register.run(
        cfg.registry, final, evaluation, lineage, history, work, complete=True, store=store, promote=False,
        run_tags=ablation_run_tags(ablation), mlflow_run_id=mlflow_run_id,
    )  # fmt: skip


def ablation_run_tags(ablation: dict[str, Any]) -> dict[str, str]:
    """The MLflow run tags of an ablation's arm: its parent run, so MLflow nests the arms under it."""
    return {"mlflow.parentRunId": ablation["parent_run_id"]} if ablation.get("parent_run_id") else {}
