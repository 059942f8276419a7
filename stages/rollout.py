"""Stage ``rollout``: problems -> ``rollouts.parquet`` (n sampled completions per problem).

What: renders each problem with the configured template, sets the engine's adapter version and
the step's AQN sigma, generates ``cfg.n_samples`` completions per prompt and writes one row per
completion: ids and text of prompt and completion, the sampler's per-token logprobs
(``log_softmax(logits / T)``, see ``qerl.pipeline.rollout.protocol``), finish reason, the problem's gold answer
(so scoring needs only this table), and the provenance of the row (seed, sigma, AQN noise seed, step,
adapter digest, engine mode, temperature). The manifest's metrics hold the requested AQN sigma and the one
the engine realised (``aqn_sigma``, ``aqn_sigma_realised``: measured from the engine's norm
weights, ``qerl.pipeline.rollout.aqn``).

The engine is built once per run by the caller and passed in (a vLLM engine costs seconds to
minutes to start, a rollout step should not). The cache key covers the rollout config, the base
model's digest, the problems' digest, the adapter digest, sigma, step and the engine mode; the
sampling and noise seeds derive from (cfg.seed, step), so the same inputs give the same table.
On a cache hit the engine is not touched. Throughput numbers go to the manifest's metrics, never
into the table, so the table's bytes depend only on the inputs.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from qerl.pipeline.data.prompts import render_prompt
from qerl.pipeline.rollout.config import RolloutConfig
from qerl.pipeline.rollout.protocol import Completion, RolloutEngine, engine_module
from qerl.pipeline.runtime.seeds import derive_seed
from qerl.pipeline.store.artifact_store import ArtifactStore
from qerl.pipeline.store.code_version import code_version
from qerl.pipeline.store.files import sha256_json
from qerl.pipeline.store.manifest import BuildResult, Manifest
from qerl.pipeline.store.retention_inputs import require_adapter

STAGE = "rollout"
TABLE = "rollouts.parquet"
log = logging.getLogger("qerl.stages.rollout")

SCHEMA = pa.schema(
    [
        ("prompt_id", pa.string()),
        ("group_id", pa.int64()),
        ("sample_idx", pa.int32()),
        ("prompt_text", pa.string()),
        ("prompt_ids", pa.list_(pa.int32())),
        ("completion_text", pa.string()),
        ("completion_ids", pa.list_(pa.int32())),
        ("logprobs", pa.list_(pa.float32())),
        ("finish_reason", pa.string()),
        ("answer", pa.string()),
        ("seed", pa.int64()),
        ("sigma", pa.float64()),
        ("noise_seed", pa.int64()),  # the AQN draw's seed: a trainer can apply the same noise
        ("step", pa.int64()),
        ("adapter_digest", pa.string()),
        ("engine_mode", pa.string()),
        ("temperature", pa.float64()),
    ]
)


def step_seed(seed: int, step: int, purpose: str) -> int:
    """A 63-bit seed for one RL step and purpose ("sample" or "aqn"): independent streams."""
    return derive_seed("qerl-rollout", seed, step, purpose)


def _check_problems(problems: Sequence[Any]) -> list[dict[str, Any]]:
    rows = []
    for index, problem in enumerate(problems):
        if not isinstance(problem, dict):
            raise ValueError(
                f"rollout: problem row {index} is a {type(problem).__name__}, not a Problem/dict"
            )
        missing = [k for k in ("id", "question", "answer") if k not in problem or problem[k] is None]
        if missing:
            raise ValueError(f"rollout: problem row {index} (id {problem.get('id')!r}) lacks {missing}")
        rows.append(dict(problem))
    if not rows:
        raise ValueError("rollout: no problems given")
    ids = [str(r["id"]) for r in rows]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise ValueError(f"rollout: problem id {dup!r} appears more than once")
    return rows


def _columns(
    rows: list[dict[str, Any]],
    prompts: list[str],
    results: list[list[Completion]],
    provenance: dict[str, Any],
) -> dict[str, list[Any]]:
    """The table's columns: one row per completion, ``provenance`` (seed, sigma, ...) on each."""
    columns: dict[str, list[Any]] = {name: [] for name in SCHEMA.names}
    for group_id, (row, prompt, completions) in enumerate(zip(rows, prompts, results, strict=True)):
        for sample_idx, c in enumerate(completions):
            values = {
                "prompt_id": str(row["id"]),
                "group_id": group_id,
                "sample_idx": sample_idx,
                "prompt_text": prompt,
                "prompt_ids": c.prompt_ids,
                "completion_text": c.completion_text,
                "completion_ids": c.completion_ids,
                "logprobs": c.logprobs,
                "finish_reason": c.finish_reason,
                "answer": str(row["answer"]),
                **provenance,
            }
            for name in SCHEMA.names:
                columns[name].append(values[name])
    return columns


def _metrics(columns: dict[str, list[Any]], seconds: float) -> dict[str, Any]:
    lengths = [len(ids) for ids in columns["completion_ids"]]
    tokens = sum(lengths)
    return {
        "rows": len(lengths),
        "tokens_generated": tokens,
        "generate_seconds": seconds,
        "tokens_per_s": tokens / seconds if seconds > 0 else None,
        "mean_completion_len": tokens / len(lengths),
        "truncation_rate": columns["finish_reason"].count("length") / len(lengths),
    }


def _realised_sigma(engine: RolloutEngine, sigma: float) -> float:
    """The AQN sigma the engine realised (``sigma_realised``, set by ``set_noise``).

    A noisy step requires it; a noise-free one takes 0.0 from an engine that adds no noise at all
    (test doubles), whose weights are clean by construction."""
    if hasattr(engine, "sigma_realised"):
        return float(engine.sigma_realised)  # type: ignore[attr-defined]
    if sigma > 0:
        raise RuntimeError(
            f"rollout: engine {type(engine).__name__} ({engine.mode}) does not report sigma_realised "
            f"after set_noise({sigma:g}); the realised AQN noise must be recorded"
        )
    return 0.0


def run(
    *,
    cfg: RolloutConfig,
    problems: Sequence[Any],
    base: Manifest,
    adapter_dir: Path | None,
    adapter_digest: str | None,
    sigma: float,
    step: int,
    store: ArtifactStore,
    engine: RolloutEngine,
) -> Manifest:
    """Generate (or reuse) the rollouts of one RL step; returns the stage manifest."""
    rows = _check_problems(problems)
    if (adapter_dir is None) != (adapter_digest is None):
        raise ValueError("rollout: adapter_dir and adapter_digest must be given together")
    if sigma < 0:
        raise ValueError(f"rollout: sigma must be >= 0, got {sigma}")
    inputs = {"base": base.digest, "problems": sha256_json(rows), "adapter": adapter_digest or "none"}
    config = {
        "rollout": cfg,  # the key leaves out its resource fields (engine sizing); the manifest keeps them
        "sigma": float(sigma),
        "step": int(step),
        "engine_mode": engine.mode,
    }
    # this module's import closure, and the engine implementation's (chosen at run time by name)
    code = code_version(sys.modules[__name__], engine_module(engine))
    sample_seed, noise_seed = step_seed(cfg.seed, step, "sample"), step_seed(cfg.seed, step, "aqn")

    def build(tmp: Path) -> BuildResult:
        require_adapter(adapter_dir, f"rollout step {step}")  # pruned: say which step and file
        engine.set_adapter(adapter_dir, adapter_digest)
        engine.set_noise(float(sigma), noise_seed)
        realised = _realised_sigma(engine, float(sigma))
        prompts = [render_prompt(engine.tokenizer, r["question"], cfg.template) for r in rows]
        start = time.perf_counter()
        results = engine.generate(prompts, cfg.n_samples, cfg.sampling(), sample_seed)
        seconds = time.perf_counter() - start
        for row, completions in zip(rows, results, strict=True):
            if len(completions) != cfg.n_samples:
                raise RuntimeError(
                    f"rollout: engine returned {len(completions)} completions for problem {row['id']}"
                )
        provenance = {
            "seed": sample_seed,
            "sigma": float(sigma),
            "noise_seed": noise_seed,
            "step": int(step),
            "adapter_digest": adapter_digest or "",
            "engine_mode": engine.mode,
            "temperature": cfg.temperature,
        }
        columns = _columns(rows, prompts, results, provenance)
        pq.write_table(pa.table(columns, schema=SCHEMA), tmp / TABLE)
        metrics = {**_metrics(columns, seconds), "aqn_sigma": float(sigma), "aqn_sigma_realised": realised}
        log.info(
            "rollout step %d [%s] sigma=%g (realised %.3g): %d completions, %d tokens, %.1f tok/s",
            step,
            engine.mode,
            sigma,
            realised,
            metrics["rows"],
            metrics["tokens_generated"],
            metrics["tokens_per_s"] or 0.0,
        )
        extra = {"engine": dict(engine.info), "sample_seed": sample_seed, "noise_seed": noise_seed}
        return BuildResult(mode=engine.mode, metrics=metrics, extra=extra)

    manifest, cached = store.produce(STAGE, config, inputs, code, build)
    if cached:
        log.info("rollout step %d: cached %s", step, manifest.dir)
    return manifest


def read_rollouts(manifest: Manifest) -> pa.Table:
    """The rollouts table of a rollout manifest."""
    return pq.read_table(manifest.file(TABLE))
