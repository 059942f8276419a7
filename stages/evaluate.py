"""Stage ``evaluate``: pass@1 averaged over k samples (avg@k) of the base + adapter on a benchmark.

What: load the benchmark's problems (``qerl.pipeline.data.datasets``, test split by default), render each with
the benchmark's prompt template through the engine's tokenizer, generate k completions per
item with the rollout engine (clean weights: AQN noise is set to 0), score them with the training
scorer (``qerl.pipeline.data.rewards.score_batch``, same config as training, so "correct" means the same in
both), and write

* ``results.parquet`` - one row per (item, sample): id, question, answer, sample, completion_text,
  extracted, correct, reward, status, finish_reason, completion_tokens;
* ``items.parquet`` - one row per item: id, n_samples, n_correct, rate;
* ``summary.json`` - benchmark id (``name/split@<items>~<protocol>``: the exact items and the
  protocol, ``qerl.pipeline.evaluation.eval_config.eval_protocol``), the protocol itself, n_items, k,
  accuracy (avg@k), stderr, ci95, pass@k, adapter digest, engine mode and sampling;
* for each further benchmark of ``eval.also`` (a training task's held-out split beside the real
  benchmark, say) the same two tables under ``also/<name>-<split>/`` and its summary in the main
  summary's ``also`` list; its accuracy is in the metrics as ``accuracy_<name>_<split>``. The main
  benchmark alone is the artifact's ``accuracy``, the number reported as the run's test accuracy;
* given validation problems (the run's held-out training problems, ``eval.validation``), the same
  two tables under ``validation/`` and their summary as ``validation`` (benchmark
  ``<name>/validation@...``): the per-item rates promotion's paired test compares.

The cache key covers the eval and reward configs, the engine mode, the base and adapter digests and
the digest of the problems themselves, so a changed dataset file re-evaluates.
The engine is passed in, not built here: the flow keeps one engine across rollout and evaluation.

Progress: the items are generated in chunks (``_ChunkedEngine``: at most ``PROGRESS_CHUNKS`` per
benchmark, each of at least ``MIN_CHUNK_SEQUENCES`` sequences so the engine's batches stay full;
a chunk's tail is the price, a few long completions per chunk), and ``run``'s ``progress(done,
total)`` is called with the items done after each, over all the benchmarks of the evaluation (the
flow shows it; nothing here knows of a console). A chunk after the first samples with a seed derived
from the evaluation's seed and its first item, so no two items share a sample seed; an evaluation
that fits in one chunk (up to ``MIN_CHUNK_SEQUENCES`` sequences), or that nobody watches
(no ``progress``), generates exactly as one call to the engine would.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qerl.pipeline.config import key_payload
from qerl.pipeline.data import prompts
from qerl.pipeline.data.datasets import DataConfig, dataset_name, load_problems, problems_digest
from qerl.pipeline.data.rewards import RewardConfig, score_batch
from qerl.pipeline.evaluation import eval_config
from qerl.pipeline.evaluation.eval_config import EvalConfig, benchmark_id
from qerl.pipeline.evaluation.statistics import per_item, summarize
from qerl.pipeline.planning.prompt_fit import EVAL_LIMIT, PromptFit, fit_prompts, load_tokenizer
from qerl.pipeline.rollout.protocol import Completion, RolloutEngine, SamplingSpec, engine_module
from qerl.pipeline.runtime.seeds import derive_seed
from qerl.pipeline.store.artifact_store import ArtifactStore
from qerl.pipeline.store.code_version import code_version
from qerl.pipeline.store.manifest import BuildResult, Manifest
from qerl.pipeline.store.retention_inputs import require_adapter

log = logging.getLogger("qerl.stages.evaluate")

STAGE = "evaluate"
PROGRESS_CHUNKS = 20  # progress reports per benchmark, at most
# sequences (items x samples) per chunk, at least: the engine's batches stay full, and an evaluation of
# up to this many sequences (the demo's 200 items x 4) samples exactly as one call to the engine
MIN_CHUNK_SEQUENCES = 1024


class _ChunkedEngine:
    """The engine as the evaluation calls it: ``generate`` in chunks, reporting the items done after
    each (module docstring); everything else is the engine's."""

    def __init__(self, engine: RolloutEngine, total: int, progress: Callable[[int, int], None] | None):
        self._engine, self.total, self.done, self._progress = engine, total, 0, progress

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def generate(
        self, prompts: list[str], n: int, sampling: SamplingSpec, seed: int
    ) -> list[list[Completion]]:
        if self._progress is None:  # nobody watches: one call, as without progress
            out = self._engine.generate(prompts, n, sampling, seed)
            self.done += len(prompts)
            return out
        size = max(1, math.ceil(len(prompts) / PROGRESS_CHUNKS), math.ceil(MIN_CHUNK_SEQUENCES / n))
        out: list[list[Completion]] = []
        for start in range(0, len(prompts), size):
            chunk_seed = seed if start == 0 else derive_seed("qerl-eval-chunk", seed, start)
            out += self._engine.generate(prompts[start : start + size], n, sampling, chunk_seed)
            self.done += len(prompts[start : start + size])
            if self._progress is not None:
                self._progress(self.done, self.total)
        return out


def _write_parquet(path: Path, rows: list[dict]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)


def _evaluate(
    bench_cfg: DataConfig,
    problems: list,
    engine: RolloutEngine,
    sampling: SamplingSpec,
    n: int,
    seed: int,
    reward_cfg: RewardConfig,
    protocol: dict | None = None,
) -> tuple[list[dict], list[dict], dict]:
    """Generate n samples per problem and score them: (per-sample rows, per-item rows, summary)."""
    # the engine's own tokenizer: the one its prompts are encoded with
    texts = [prompts.render_prompt(engine.tokenizer, p["question"], bench_cfg.template) for p in problems]
    outputs = engine.generate(texts, n, sampling, seed)
    if len(outputs) != len(problems):
        raise RuntimeError(f"engine returned {len(outputs)} groups for {len(problems)} prompts")
    for i, group in enumerate(outputs):
        if len(group) != n:
            raise RuntimeError(
                f"engine returned {len(group)} samples for item {problems[i]['id']}, expected {n}"
            )
    flat = [(p, j, c) for p, group in zip(problems, outputs, strict=True) for j, c in enumerate(group)]
    scores = score_batch(
        [c.completion_text for _, _, c in flat], [p["answer"] for p, _, _ in flat], reward_cfg
    )
    rows = [
        {
            "id": p["id"],
            "question": p["question"],
            "answer": p["answer"],
            "sample": j,
            "completion_text": c.completion_text,
            "extracted": s.extracted,
            "correct": bool(s.correct),
            "reward": float(s.reward),
            "status": str(s.status),
            "finish_reason": c.finish_reason,
            "completion_tokens": len(c.completion_ids),
        }
        for (p, j, c), s in zip(flat, scores, strict=True)
    ]
    correct = [[bool(s.correct) for s in scores[i * n : (i + 1) * n]] for i in range(len(problems))]
    items = per_item([p["id"] for p in problems], correct)
    digest = problems_digest(problems)
    name, split = dataset_name(bench_cfg)
    summary = {
        **summarize(correct),
        "benchmark": benchmark_id(bench_cfg, digest, protocol),
        "protocol": protocol,
        "benchmark_name": name,
        "split": split,
        "dataset": bench_cfg.dataset,
        "template": bench_cfg.template,
        "benchmark_digest": digest,
        "truncated_fraction": sum(r["finish_reason"] == "length" for r in rows) / len(rows),
        "score_status": dict(collections.Counter(r["status"] for r in rows)),
    }
    return rows, items, summary


def _evaluate_benchmark(
    tmp: Path, role: str, name: str, bench_cfg: DataConfig, problems: list, engine: RolloutEngine,
    sampling: SamplingSpec, n: int, seed: int, reward_cfg: RewardConfig, protocol: dict,
) -> dict:  # fmt: skip
    """Evaluate one benchmark and write its two tables (``role`` main: at ``tmp``; also: a further
    one of ``eval.also`` under ``tmp/also/<name>-<split>``; validation: under ``tmp/validation``);
    returns its summary."""
    log.info("evaluating %s: %d items x %d samples (%s), engine %s", name, len(problems), n,
             sampling, engine.mode)  # fmt: skip
    rows, items, summary = _evaluate(bench_cfg, problems, engine, sampling, n, seed, reward_cfg, protocol)
    if role == "validation":
        summary.update(split="validation", benchmark=name)
    out = {"main": tmp, "validation": tmp / "validation"}.get(role) or (
        tmp / "also" / f"{summary['benchmark_name']}-{summary['split']}"
    )
    out.mkdir(parents=True, exist_ok=True)
    _write_parquet(out / "results.parquet", rows)
    _write_parquet(out / "items.parquet", items)
    log.info("%s: avg@%d = %.4f +- %.4f (%d items)", name, n, summary["accuracy"], summary["stderr"],
             len(items))  # fmt: skip
    return summary


def _build_result(
    tmp: Path, cfg: EvalConfig, summaries: list[dict], bench: str, adapter_digest: str | None,
    engine_mode: str, sampling: SamplingSpec, validation: dict | None = None,
) -> BuildResult:  # fmt: skip
    """``summary.json`` (the main benchmark's summary, the run's settings, the others under ``also``,
    the validation split's under ``validation``) and the manifest's metrics and extra."""
    summary = {
        **summaries[0],
        "adapter_digest": adapter_digest,
        "engine_mode": engine_mode,
        "sampling": {"temperature": sampling.temperature, "top_p": sampling.top_p, "greedy": cfg.greedy},
        "max_new_tokens": cfg.max_new_tokens,
        "also": summaries[1:],
    }
    if validation is not None:
        summary["validation"] = validation
    (tmp / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    metrics = {k: summary[k] for k in ("accuracy", "stderr", "n_items", "k")}
    for other in summaries[1:]:
        tag = f"{other['benchmark_name']}_{other['split']}"
        metrics.update({f"accuracy_{tag}": other["accuracy"], f"stderr_{tag}": other["stderr"]})
    extra = {"benchmark": bench, "benchmark_name": summary["benchmark_name"], "split": summary["split"]}
    if summaries[1:]:
        extra["also"] = [o["benchmark"] for o in summaries[1:]]
    if validation is not None:
        metrics.update(accuracy_validation=validation["accuracy"], stderr_validation=validation["stderr"])
        extra["validation"] = validation["benchmark"]
    return BuildResult(mode=engine_mode, metrics=metrics, extra=extra)


def _fit_to_context(
    benches: list[tuple[DataConfig, list]], tokenizer: Any, limit: int
) -> tuple[list[tuple[DataConfig, list]], list[PromptFit | None]]:
    """Each benchmark's items whose rendered prompt has at most ``limit`` tokens (the engine's context
    less ``eval.max_new_tokens``), as training prompts are fitted (``qerl.pipeline.planning.prompt_fit``),
    and the fits; no tokenizer (no context given): the items as they are."""
    if tokenizer is None:
        return benches, [None] * len(benches)
    fits = [fit_prompts(p, tokenizer, b.template, limit, EVAL_LIMIT) for b, p in benches]
    return [(b, f.kept) for (b, _), f in zip(benches, fits, strict=True)], list(fits)


def _sampling(cfg: EvalConfig) -> SamplingSpec:
    """How the evaluation samples: the config's temperature and top-p, no logprobs recorded."""
    return SamplingSpec(
        temperature=cfg.sampling_temperature,
        top_p=cfg.sampling_top_p,
        max_new_tokens=cfg.max_new_tokens,
        logprobs=False,
    )


def run(
    cfg: EvalConfig,
    base: Manifest,
    adapter_dir: Path | None,
    adapter_digest: str | None,
    store: ArtifactStore,
    engine: RolloutEngine,
    reward_cfg: RewardConfig,
    validation: tuple[DataConfig, list] | None = None,
    progress: Callable[[int, int], None] | None = None,
    max_model_len: int | None = None,
) -> Manifest:
    """Evaluate ``engine`` (serving ``base``) with the adapter (or none) on ``cfg.benchmark``, and on
    each of ``cfg.also`` (reported beside it; the main benchmark alone is the artifact's accuracy).
    ``progress(done, total)``: items generated so far, after each chunk (module docstring).

    ``validation``: (the training data's config, the held-out problems), evaluated with that
    config's template and recorded under ``validation`` (what promotion decides on).

    ``max_model_len``: the engine's context; items whose prompt leaves less than ``cfg.max_new_tokens``
    of it are dropped and counted (``_fit_to_context``); None fits nothing (a test double's engine)."""
    if (adapter_dir is None) != (adapter_digest is None):
        raise ValueError(
            f"adapter_dir {adapter_dir} and adapter_digest {adapter_digest} must be given together"
        )
    benches = [(b, load_problems(b)) for b in [cfg.benchmark, *cfg.also]]
    tokenizer = load_tokenizer(base.dir) if max_model_len is not None else None
    limit = (max_model_len or 0) - cfg.max_new_tokens
    benches, fits = _fit_to_context(benches, tokenizer, limit)
    digests = [problems_digest(p) for _, p in benches]
    scorer = key_payload(reward_cfg)  # the verdict settings; not the verifier pool's resources
    protocols = [eval_config.eval_protocol(cfg, b.template, engine.mode, scorer) for b, _ in benches]
    bench = benchmark_id(cfg.benchmark, digests[0], protocols[0])
    inputs = {"base": base.digest, "benchmark": digests[0], "adapter": adapter_digest or "none"}
    inputs.update({f"also_{i}": d for i, d in enumerate(digests[1:])})
    config = {
        "eval": cfg,  # the key leaves out resource fields; the manifest records them
        "reward": reward_cfg,
        "engine_mode": engine.mode,
    }
    val = validation if validation is not None and validation[1] else None
    val_fit: PromptFit | None = None
    if val is not None:
        (val,), (val_fit,) = _fit_to_context([val], tokenizer, limit)
        inputs["validation"] = problems_digest(val[1])
        config["validation_template"] = val[0].template
    # the import closure (prompts, rewards, statistics) and the engine's implementation
    code = code_version(sys.modules[__name__], engine_module(engine))
    sampling, n = _sampling(cfg), cfg.n_samples
    total = sum(len(p) for _, p in benches) + (len(val[1]) if val is not None else 0)
    engine = _ChunkedEngine(engine, total, progress)  # type: ignore[assignment]  # generates in chunks

    def build(tmp: Path) -> BuildResult:
        require_adapter(adapter_dir, "evaluate")  # pruned: say which step and file
        engine.set_adapter(adapter_dir, adapter_digest)
        engine.set_noise(0.0, cfg.seed)  # evaluation sees the clean quantized weights

        def one(kind: str, name: str, bench_cfg: Any, problems: list, protocol: dict) -> dict:
            return _evaluate_benchmark(tmp, kind, name, bench_cfg, problems, engine, sampling, n, cfg.seed,
                                       reward_cfg, protocol)  # fmt: skip

        summaries = [
            one("main" if i == 0 else "also", benchmark_id(b, digests[i], protocols[i]), b, p, protocols[i])
            for i, (b, p) in enumerate(benches)
        ]
        val_summary = None
        if val is not None:
            protocol = eval_config.eval_protocol(cfg, val[0].template, engine.mode, scorer)
            val_summary = one(
                "validation", validation_id(val[0], inputs["validation"], protocol), *val, protocol
            )
        for summary, fit in zip([*summaries, val_summary], [*fits, val_fit], strict=True):
            if fit is not None and summary is not None:
                summary["prompts"] = fit.report()  # loaded, kept, dropped_too_long, the limit
        return _build_result(tmp, cfg, summaries, bench, adapter_digest, engine.mode, sampling, val_summary)

    manifest, cached = store.produce(STAGE, config, inputs, code, build)
    if cached:
        log.info("evaluate %s: cached (%s)", bench, manifest.dir)
    return manifest


def validation_id(data_cfg: DataConfig, digest: str, protocol: dict) -> str:
    """The benchmark id of a run's held-out training problems: ``<name>/validation@<items>~<protocol>``."""
    name, _ = dataset_name(data_cfg)
    return benchmark_id(
        data_cfg.model_copy(update={"dataset": name, "split": "validation"}), digest, protocol
    )


def load_summary(manifest: Manifest) -> dict:
    """The evaluation summary of an ``evaluate`` manifest."""
    return json.loads(manifest.file("summary.json").read_text())
