"""The RL flow's Prefect tasks: each wraps one stage (``qerl.stages``) and does nothing else.

Every task takes keyword arguments, and an adapter travels as one ``Adapter`` value (folder and
digest). The stages cache themselves in the content-addressed store, so Prefect's own task caching
is off (``NO_CACHE``) and results are not persisted: the store's key is the task's cache key in
effect. Only transient failures retry (``qerl.pipeline.planning.retry.is_transient``: a dead engine,
which ``LazyEngine`` then rebuilds, a dropped connection, a locked database); a config error, a
misconfigured engine or bad data fails the run at once. ``train`` and ``quality`` take no retries:
an out-of-memory error there is not transient.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from qerl.pipeline.data.heldout import quality_texts
from qerl.pipeline.planning.retry import is_transient
from qerl.pipeline.planning.run_config import RunConfig
from qerl.pipeline.planning.warm_start import warm_start_adapter
from qerl.pipeline.rollout.protocol import RolloutEngine
from qerl.pipeline.store.artifact_store import ArtifactStore
from qerl.pipeline.store.manifest import Adapter, Manifest
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
    **TASK_OPTS,
    "retries": 2,
    "retry_delay_seconds": 2,
    "retry_condition_fn": _retry_transient,
}


def _rollout_data(cfg: RunConfig) -> Any:
    """The run's data config with the rollout's template: how its prompts reach the policy (GPTQ's
    calibration, the quality texts and the validation items are rendered so)."""
    return cfg.data.model_copy(update={"template": cfg.rollout.template})


@task(name="base-model", **RETRY_OPTS)
def base_model(*, cfg: RunConfig, store: ArtifactStore, exclude: frozenset[str] = frozenset()) -> str:
    """The base model's directory; the demo's warm-up leaves out the groups in ``exclude``."""
    if cfg.model.source == "demo":
        return str(demo_base.run(cfg.model.demo, store, exclude).dir)
    return fetch_model.resolve_base(cfg.model.source, store)  # a catalogue name, a directory or a hub id


@task(name="quantize", **RETRY_OPTS)
def quantized(
    *,
    cfg: RunConfig,
    src: str,
    store: ArtifactStore,
    held_out: frozenset[str],
    progress: Callable[[int, int], None] | None = None,
) -> Manifest:
    """GPTQ calibrates on the run's data, never on a question of ``held_out`` (the validation split)."""
    return quantize.run(cfg.quantize, src, store, _rollout_data(cfg), progress, held_out)


@task(name="quality", **TASK_OPTS)
def quality_report(
    *, cfg: RunConfig, base: Manifest, src: str, store: ArtifactStore, validation: list[Any]
) -> Manifest:
    """What quantization cost, on the run's validation texts where it has them (``quantize.quality``)."""
    q = cfg.quantize.quality
    texts = quality_texts(q.source, q.texts, q.data_root or cfg.data.root, _rollout_data(cfg), validation)
    return quality.run(q, base, quantize.resolve_source(src), store, texts)


@task(name="dequantize-twin", **RETRY_OPTS)
def twin(*, cfg: RunConfig, base: Manifest, store: ArtifactStore) -> Manifest:
    return dequantize.run(cfg.quantize, base, store)


@task(name="warm-start", **RETRY_OPTS)
def warm_start(
    *, cfg: RunConfig, work: Path, store: ArtifactStore, base_digest: str, version: str | None
) -> Manifest | None:
    """The champion's adapter (``version``'s when given) in the store; None without a champion."""
    return warm_start_adapter(cfg, work, store, base_digest, version)


@task(name="rollout", **RETRY_OPTS)
def rollouts(
    *,
    cfg: RunConfig,
    problems: list[Any],
    base: Manifest,
    adapter: Adapter | None,
    sigma: float,
    step: int,
    store: ArtifactStore,
    engine: RolloutEngine,
) -> Manifest:
    return rollout.run(
        cfg=cfg.rollout,
        problems=problems,
        base=base,
        adapter_dir=adapter.dir if adapter else None,
        adapter_digest=adapter.digest if adapter else None,
        sigma=sigma,
        step=step,
        store=store,
        engine=engine,
    )


@task(name="score", **RETRY_OPTS)
def scored(*, cfg: RunConfig, rollouts: Manifest, store: ArtifactStore) -> Manifest:
    return score.run(cfg.reward, rollouts, store)


@task(name="train", **TASK_OPTS)
def trained(
    *,
    cfg: RunConfig,
    base: Manifest,
    scored: Manifest,
    prev: Manifest | None,
    step: int,
    store: ArtifactStore,
    init: Adapter | None = None,
) -> Manifest:
    """The checkpoint after ``step``; step 0 starts from ``init`` (a warm start) or a fresh LoRA."""
    init_adapter = (init.dir, init.digest) if init is not None else None
    return train.run(
        cfg=cfg.train, base=base, scored=scored, prev=prev, step=step, store=store, init_adapter=init_adapter
    )


@task(name="evaluate", **RETRY_OPTS)
def evaluation(
    *,
    cfg: RunConfig,
    base: Manifest,
    adapter: Adapter | None,
    store: ArtifactStore,
    engine: RolloutEngine,
    validation: list[Any] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Manifest:
    """The test benchmark and, beside it, ``validation`` (the run's held-out training problems)."""
    held_out = (_rollout_data(cfg), validation) if validation else None
    return evaluate.run(
        cfg.eval,
        base,
        adapter.dir if adapter else None,
        adapter.digest if adapter else None,
        store,
        engine,
        cfg.reward,
        held_out,
        progress,
        max_model_len=cfg.rollout.max_model_len,  # items that leave no room for the completion are dropped
    )


@task(name="register", **RETRY_OPTS)
def registration(
    *,
    cfg: RunConfig,
    final: Manifest,
    evaluation: Manifest,
    lineage: Mapping[str, Any],
    history: list[dict[str, Any]],
    work: Path,
    store: ArtifactStore,
    candidate: bool,
    champion_eval: tuple[str, Manifest] | str | None = None,
    run_tags: Mapping[str, Any] | None = None,
    mlflow_run_id: str | None = None,
) -> Manifest:
    """Register the final adapter; ``candidate`` False (an ablation's run): no alias moves."""
    return register.run(
        cfg.registry,
        final,
        evaluation,
        lineage,
        history,
        work,
        complete=True,
        store=store,
        promote=candidate,
        run_tags=run_tags,
        champion_eval=champion_eval,
        mlflow_run_id=mlflow_run_id,
    )
