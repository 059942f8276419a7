"""Stage ``score``: verifiable rewards for a rollouts table, plus the ``qerl score`` file scorer.

What: reads ``rollouts.parquet`` from the rollout stage's manifest, scores ``completion_text``
against the gold ``answer`` with ``qerl.pipeline.data.rewards.score_batch`` (worker processes, a wall-clock
deadline per answer), and writes ``scored.parquet``: every input column, then ``extracted``,
``correct``, ``reward``, ``status``, ``group_reward_mean``, ``group_reward_std`` and ``group_size``
(groups by ``group_id``, rows in input order). Metrics: reward mean/std, accuracy, counts per status,
answers/s, the slowest answer's latency, and the rollouts' AQN sigma (``aqn_sigma``, where the table
has one ``sigma`` for all rows).

Group statistics use the sample standard deviation (ddof=1, 0 for a group of one), as TRL's GRPO
does; the train stage may recompute advantages from ``reward`` and ``group_id`` instead.
The manifest's ``mode`` names how verification ran (``process-pool/<n>-workers``), so a reader can
tell the result came from the real math-verify path.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qerl.pipeline.data.jsonl import read_jsonl
from qerl.pipeline.data.rewards import STATUSES, RewardConfig, ScoreRecord, score_batch
from qerl.pipeline.store.artifact_store import ArtifactStore
from qerl.pipeline.store.code_version import code_version
from qerl.pipeline.store.files import atomic_write_text
from qerl.pipeline.store.manifest import BuildResult, Manifest

STAGE = "score"
REQUIRED_COLUMNS = ("group_id", "completion_text", "answer")
ADDED_COLUMNS = (
    "extracted",
    "correct",
    "reward",
    "status",
    "group_reward_mean",
    "group_reward_std",
    "group_size",
)


def summarize(records: list[ScoreRecord], seconds: float) -> dict[str, Any]:
    """Batch metrics: reward mean/std, accuracy, per-status counts, throughput, worst latency."""
    n = len(records)
    rewards = [r.reward for r in records]
    mean = sum(rewards) / n if n else 0.0
    std = math.sqrt(sum((x - mean) ** 2 for x in rewards) / n) if n else 0.0
    metrics: dict[str, Any] = {
        "n": n,
        "reward_mean": mean,
        "reward_std": std,
        "accuracy": sum(r.correct for r in records) / n if n else 0.0,
        "format_rate": sum(r.format_ok for r in records) / n if n else 0.0,
        "seconds": seconds,
        "answers_per_s": n / seconds if seconds > 0 else None,
        "max_latency_s": max((r.latency_s for r in records), default=0.0),
    }
    for status in STATUSES:
        metrics[f"{status}_count"] = sum(r.status == status for r in records)
    return metrics


def group_stats(group_ids: list[Any], rewards: list[float]) -> tuple[list[float], list[float], list[int]]:
    """Per-row mean, sample std (ddof=1) and size of the row's group."""
    groups: dict[Any, list[float]] = {}
    for gid, reward in zip(group_ids, rewards, strict=True):
        groups.setdefault(gid, []).append(reward)
    stats = {}
    for gid, values in groups.items():
        m = sum(values) / len(values)
        var = sum((v - m) ** 2 for v in values) / (len(values) - 1) if len(values) > 1 else 0.0
        stats[gid] = (m, math.sqrt(var), len(values))
    return (
        [stats[g][0] for g in group_ids],
        [stats[g][1] for g in group_ids],
        [stats[g][2] for g in group_ids],
    )


def _score_table(cfg: RewardConfig, source: Path, out: Path) -> BuildResult:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(source)
    missing = [c for c in REQUIRED_COLUMNS if c not in table.column_names]
    if missing:
        raise ValueError(f"{source}: missing column(s) {missing}; has {table.column_names}")
    clash = [c for c in ADDED_COLUMNS if c in table.column_names]
    if clash:
        raise ValueError(f"{source}: already has column(s) {clash} that scoring would write")
    completions = table.column("completion_text").to_pylist()
    answers = table.column("answer").to_pylist()
    for i, (text, gold) in enumerate(zip(completions, answers, strict=True)):
        if text is None:
            raise ValueError(f"{source}: row {i} has a null completion_text")
        if gold is None or not str(gold).strip():
            raise ValueError(f"{source}: row {i} has no gold answer")
    start = time.perf_counter()
    records = score_batch(completions, [str(a) for a in answers], cfg)
    seconds = time.perf_counter() - start
    rewards = [r.reward for r in records]
    means, stds, sizes = group_stats(table.column("group_id").to_pylist(), rewards)
    added = {
        "extracted": pa.array([r.extracted for r in records], pa.string()),
        "correct": pa.array([r.correct for r in records], pa.bool_()),
        "reward": pa.array(rewards, pa.float64()),
        "status": pa.array([r.status for r in records], pa.string()),
        "group_reward_mean": pa.array(means, pa.float64()),
        "group_reward_std": pa.array(stds, pa.float64()),
        "group_size": pa.array(sizes, pa.int32()),
    }
    for name, column in added.items():
        table = table.append_column(name, column)
    pq.write_table(table, out)
    metrics = summarize(records, seconds)
    metrics["groups"] = len(set(table.column("group_id").to_pylist()))
    sigmas = set(table.column("sigma").to_pylist()) if "sigma" in table.column_names else set()
    if len(sigmas) == 1 and None not in sigmas:  # the step's AQN sigma: the train key needs it (train.py)
        metrics["aqn_sigma"] = float(sigmas.pop())
    return BuildResult(mode=f"process-pool/{cfg.workers}-workers", metrics=metrics)


def run(cfg: RewardConfig, rollouts: Manifest, store: ArtifactStore) -> Manifest:
    """Score ``rollouts`` (a rollout stage manifest with ``rollouts.parquet``) into ``scored.parquet``."""
    manifest, _ = store.produce(
        STAGE,
        cfg,
        inputs={"rollouts": rollouts.digest},
        code=code_version(sys.modules[__name__]),  # the import closure: rewards, answers
        # the table is read on a miss only: a cache hit needs none (retention may have pruned it)
        build=lambda tmp: _score_table(cfg, rollouts.file("rollouts.parquet"), tmp / "scored.parquet"),
    )
    return manifest


def score_jsonl(
    input_path: str | Path,
    output_path: str | Path,
    cfg: RewardConfig | None = None,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Score a JSONL file of {completion, answer, ...} lines; write input + correct/reward/extracted/status.

    The output keeps the input order and is written atomically. Returns the batch metrics.
    """
    cfg = cfg or RewardConfig()
    input_path = Path(input_path)
    if not input_path.is_file():
        raise FileNotFoundError(f"input file not found: {input_path}")
    rows: list[dict[str, Any]] = []
    for lineno, row in read_jsonl(input_path, skip_blank=False):
        for key in ("completion", "answer"):
            if key not in row or row[key] is None:
                raise ValueError(f"{input_path}:{lineno}: missing '{key}'")
        if not isinstance(row["completion"], str):
            raise ValueError(f"{input_path}:{lineno}: 'completion' must be a string")
        if not str(row["answer"]).strip():
            raise ValueError(f"{input_path}:{lineno}: empty 'answer'")
        rows.append(row)
    start = time.perf_counter()
    records = score_batch(
        [r["completion"] for r in rows], [str(r["answer"]) for r in rows], cfg, progress=progress
    )
    seconds = time.perf_counter() - start
    out_lines = []
    for row, rec in zip(rows, records, strict=True):
        row = {
            **row,
            "correct": rec.correct,
            "reward": rec.reward,
            "extracted": rec.extracted,
            "status": rec.status,
        }
        out_lines.append(json.dumps(row, ensure_ascii=False))
    atomic_write_text(output_path, "".join(line + "\n" for line in out_lines))
    return summarize(records, seconds)
