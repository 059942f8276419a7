"""Stage ``evaluate``: pass@1 averaged over k samples (avg@k) of the base + adapter on a benchmark.

What: load the benchmark's problems (``qerl.pipeline.data.datasets``, test split by default), render each with
the benchmark's prompt template through the engine's tokenizer, generate k completions per
item with the rollout engine (clean weights: AQN noise is set to 0), score them with the training
scorer (``qerl.pipeline.data.rewards.score_batch``, same config as training, so "correct" means the same in
both), and write

* ``results.parquet`` - one row per (item, sample): id, question, answer, sample, completion_text,
  extracted, correct, reward, status, finish_reason, completion_tokens;
* ``items.parquet`` - one row per item: id, n_samples, n_correct, rate;
* ``summary.json`` - benchmark id (name/split@digest of the exact items), n_items, k, accuracy
  (avg@k), stderr, ci95, pass@k, adapter digest, engine mode and sampling;
* for each further benchmark of ``eval.also`` (a training task's held-out split beside the real
  benchmark, say) the same two tables under ``also/<name>-<split>/`` and its summary in the main
  summary's ``also`` list; its accuracy is in the metrics as ``accuracy_<name>_<split>``. The main
  benchmark alone is the artifact's ``accuracy``, the number registration compares.

The cache key covers the eval and reward configs, the engine mode, the base and adapter digests and
the digest of the problems themselves, so a changed dataset file re-evaluates.
The engine is passed in, not built here: the flow keeps one engine across rollout and evaluation.
"""

from __future__ import annotations

import collections
import json
import logging
import sys
from pathlib import Path

from qerl.pipeline.data import prompts, rewards
from qerl.pipeline.data.datasets import DataConfig, dataset_name, load_problems, problems_digest
from qerl.pipeline.data.rewards import RewardConfig, score_batch
from qerl.pipeline.evaluation import eval_config, statistics
from qerl.pipeline.evaluation.eval_config import EvalConfig, benchmark_id
from qerl.pipeline.evaluation.statistics import per_item, summarize
from qerl.pipeline.rollout.protocol import RolloutEngine, SamplingSpec
from qerl.pipeline.store.artifact_store import ArtifactStore
from qerl.pipeline.store.code_version import code_version
from qerl.pipeline.store.layout import MANIFEST
from qerl.pipeline.store.manifest import ArtifactError, BuildResult, Manifest

log = logging.getLogger("qerl.stages.evaluate")

STAGE = "evaluate"


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
        "benchmark": benchmark_id(bench_cfg, digest),
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
    tmp: Path, main: bool, name: str, bench_cfg: DataConfig, problems: list, engine: RolloutEngine,
    sampling: SamplingSpec, n: int, seed: int, reward_cfg: RewardConfig,
) -> dict:  # fmt: skip
    """Evaluate one benchmark and write its two tables (the main one at ``tmp``, a further one of
    ``eval.also`` under ``tmp/also/<name>-<split>``); returns its summary."""
    log.info("evaluating %s: %d items x %d samples (%s), engine %s", name, len(problems), n,
             sampling, engine.mode)  # fmt: skip
    rows, items, summary = _evaluate(bench_cfg, problems, engine, sampling, n, seed, reward_cfg)
    out = tmp if main else tmp / "also" / f"{summary['benchmark_name']}-{summary['split']}"
    out.mkdir(parents=True, exist_ok=True)
    _write_parquet(out / "results.parquet", rows)
    _write_parquet(out / "items.parquet", items)
    log.info("%s: avg@%d = %.4f +- %.4f (%d items)", name, n, summary["accuracy"], summary["stderr"],
             len(items))  # fmt: skip
    return summary


def _build_result(
    tmp: Path, cfg: EvalConfig, summaries: list[dict], bench: str, adapter_digest: str | None,
    engine_mode: str, sampling: SamplingSpec,
) -> BuildResult:  # fmt: skip
    """``summary.json`` (the main benchmark's summary, the run's settings, the others under ``also``)
    and the manifest's metrics and extra."""
    summary = {
        **summaries[0],
        "adapter_digest": adapter_digest,
        "engine_mode": engine_mode,
        "sampling": {"temperature": sampling.temperature, "top_p": sampling.top_p, "greedy": cfg.greedy},
        "max_new_tokens": cfg.max_new_tokens,
        "also": summaries[1:],
    }
    (tmp / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    metrics = {k: summary[k] for k in ("accuracy", "stderr", "n_items", "k")}
    for other in summaries[1:]:
        tag = f"{other['benchmark_name']}_{other['split']}"
        metrics.update({f"accuracy_{tag}": other["accuracy"], f"stderr_{tag}": other["stderr"]})
    extra = {"benchmark": bench, "benchmark_name": summary["benchmark_name"], "split": summary["split"]}
    if summaries[1:]:
        extra["also"] = [o["benchmark"] for o in summaries[1:]]
    return BuildResult(mode=engine_mode, metrics=metrics, extra=extra)


def run(
    cfg: EvalConfig,
    base: Manifest,
    adapter_dir: Path | None,
    adapter_digest: str | None,
    store: ArtifactStore,
    engine: RolloutEngine,
    reward_cfg: RewardConfig,
) -> Manifest:
    """Evaluate ``engine`` (serving ``base``) with the adapter (or none) on ``cfg.benchmark``, and on
    each of ``cfg.also`` (reported beside it; the main benchmark alone is the artifact's accuracy)."""
    if (adapter_dir is None) != (adapter_digest is None):
        raise ValueError(
            f"adapter_dir {adapter_dir} and adapter_digest {adapter_digest} must be given together"
        )
    benches = [(b, load_problems(b)) for b in [cfg.benchmark, *cfg.also]]
    digests = [problems_digest(p) for _, p in benches]
    bench = benchmark_id(cfg.benchmark, digests[0])
    inputs = {"base": base.digest, "benchmark": digests[0], "adapter": adapter_digest or "none"}
    inputs.update({f"also_{i}": d for i, d in enumerate(digests[1:])})
    config = {
        "eval": cfg.model_dump(mode="json"),
        "reward": reward_cfg.model_dump(mode="json"),
        "engine_mode": engine.mode,
    }
    code = code_version(sys.modules[__name__], eval_config, statistics, rewards, prompts)
    sampling = SamplingSpec(
        temperature=cfg.sampling_temperature,
        top_p=cfg.sampling_top_p,
        max_new_tokens=cfg.max_new_tokens,
        logprobs=False,
    )
    n = cfg.n_samples

    def build(tmp: Path) -> BuildResult:
        engine.set_adapter(adapter_dir, adapter_digest)
        engine.set_noise(0.0, cfg.seed)  # evaluation sees the clean quantized weights
        summaries = []
        for i, (bench_cfg, problems) in enumerate(benches):
            name = benchmark_id(bench_cfg, digests[i])
            summaries.append(
                _evaluate_benchmark(
                    tmp, i == 0, name, bench_cfg, problems, engine, sampling, n, cfg.seed, reward_cfg
                )
            )
        return _build_result(tmp, cfg, summaries, bench, adapter_digest, engine.mode, sampling)

    manifest, cached = store.produce(STAGE, config, inputs, code, build)
    if cached:
        log.info("evaluate %s: cached (%s)", bench, manifest.dir)
    return manifest


def base_artifacts(
    base: str | Path, store: ArtifactStore, need_twin: bool = True
) -> tuple[Manifest, Manifest | None]:
    """(quantized, twin) for a base given as a ``qerl quantize`` export or as a plain HF model dir.

    An export carries its manifest: it is checked against its files and used as is. A plain model
    directory is quantized with the default recipe (a cached stage, so a repeat is a lookup). The
    twin (what CPU serving needs) is derived through the dequantize stage, also cached.
    """
    from qerl.pipeline.nvfp4.recipe import QuantizeConfig
    from qerl.stages import quantize

    base = Path(base)
    if not base.is_dir():
        raise ArtifactError(f"--base {base} is not a directory")
    if (base / MANIFEST).is_file():
        quantized = Manifest.load(base)
        if quantized.stage != quantize.STAGE:
            raise ArtifactError(
                f"{base} holds a '{quantized.stage}' artifact, not a '{quantize.STAGE}' checkpoint"
            )
        bad = store.problems(quantized)
        if bad:
            raise ArtifactError(f"{base} does not match its manifest: {'; '.join(bad)}")
        qcfg = QuantizeConfig.model_validate(quantized.config)
    else:
        qcfg = QuantizeConfig()
        quantized = quantize.run(qcfg, base, store)
    twin = quantize.run_twin(qcfg, quantized, store) if need_twin else None
    return quantized, twin


def load_summary(manifest: Manifest) -> dict:
    """The evaluation summary of an ``evaluate`` manifest."""
    return json.loads(manifest.file("summary.json").read_text())
