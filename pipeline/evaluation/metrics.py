"""Evaluation: configuration and the statistics of pass@1 averaged over k samples (avg@k).

What. A benchmark is a list of problems (from ``qerl.pipeline.data.datasets``); each item gets k sampled
completions (temperature 0.6, top_p 0.95 by default, as in the QeRL/DeepSeek-R1 evaluation
protocol) or one greedy completion, scored by the training scorer (``qerl.pipeline.data.rewards``). The
headline number is avg@k: the mean over items of each item's fraction of correct samples, i.e. the
expected pass@1 of one sample. Per-item rates are kept so two adapters can be compared item by item.

Uncertainty. The standard error treats items as the sampling unit: se = sd(per-item rate) / sqrt(n)
(sample sd, ddof=1). With k samples per item this is the clustered standard error: it contains both
the item-to-item spread and the sampling noise of the k draws, which a binomial se over all n*k
samples would understate when items differ in difficulty. A normal 95% interval (clipped to [0, 1])
is reported beside it. The unbiased pass@k estimator of Chen et al. (2021) is provided for
reporting pass@k with k' <= k.

Departure from the paper: the paper reports GSM8K/MATH/AIME/AMC accuracy; here the embedded default
benchmark is the procedural arithmetic test split, so the pipeline runs with nothing downloaded. The
paper's benchmarks are the named datasets ``gsm8k``, ``math500``, ``aime24`` and ``amc23`` (local
copies under ``data.root``/``$QERL_DATA_DIR``, else the hub).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from pydantic import Field, model_validator
from qerl.pipeline.config import StrictModel
from qerl.pipeline.data.datasets import DataConfig, dataset_name


class BenchmarkConfig(DataConfig):
    """A ``DataConfig`` whose defaults suit evaluation (so ``--set benchmark.limit=9`` keeps them)."""

    split: str = "test"
    # level 1 has only ~112 distinct test-split problems, fewer than DataConfig's default size
    arithmetic_size: int = Field(100, ge=1, description="problems generated for the arithmetic split")


class EvalConfig(StrictModel):
    """Which benchmark to evaluate (a ``DataConfig``, test split) and how to sample it."""

    benchmark: BenchmarkConfig = Field(
        default_factory=BenchmarkConfig, description="dataset, split, limit and prompt template"
    )
    also: list[BenchmarkConfig] = Field(
        default_factory=list,
        description="further benchmarks evaluated and reported beside the main one (which alone decides promotion)",
    )
    k: int = Field(4, ge=1, description="samples per item (avg@k)")
    temperature: float = Field(0.6, ge=0.0)
    top_p: float = Field(0.95, gt=0.0, le=1.0)
    greedy: bool = Field(False, description="one greedy completion per item (k=1, temperature 0)")
    max_new_tokens: int = Field(256, ge=1)
    seed: int = 0

    @model_validator(mode="after")
    def _check(self) -> EvalConfig:
        if not self.greedy and self.temperature == 0.0 and self.k > 1:
            raise ValueError("temperature 0 with k > 1 gives k identical samples: set greedy=true (k=1)")
        return self

    @property
    def n_samples(self) -> int:
        return 1 if self.greedy else self.k

    @property
    def sampling_temperature(self) -> float:
        return 0.0 if self.greedy else self.temperature

    @property
    def sampling_top_p(self) -> float:
        return 1.0 if self.greedy else self.top_p


def benchmark_id(cfg: DataConfig, digest: str) -> str:
    """A benchmark's identity for comparisons: dataset name, split and the digest of its exact items
    (``gsm8k/test@...``; a file ``.../gsm8k/test.jsonl`` is named by its folder, see ``dataset_name``)."""
    name, split = dataset_name(cfg)
    return f"{name}/{split}@{digest[:12]}"


def _check_matrix(correct: Sequence[Sequence[bool]]) -> None:
    if not correct:
        raise ValueError("no items to aggregate")
    for i, row in enumerate(correct):
        if len(row) == 0:
            raise ValueError(f"item {i} has no samples")


def item_rates(correct: Sequence[Sequence[bool]]) -> list[float]:
    """Per item: the fraction of its samples that are correct."""
    _check_matrix(correct)
    return [sum(bool(c) for c in row) / len(row) for row in correct]


def avg_at_k(correct: Sequence[Sequence[bool]]) -> float:
    """pass@1 averaged over each item's samples, then over items."""
    rates = item_rates(correct)
    return sum(rates) / len(rates)


def stderr(rates: Sequence[float]) -> float:
    """Standard error of the mean of per-item rates (sample sd, ddof=1); 0 for one item."""
    n = len(rates)
    if n < 2:
        return 0.0
    mean = sum(rates) / n
    var = sum((r - mean) ** 2 for r in rates) / (n - 1)
    return math.sqrt(var / n)


def confidence_interval(mean: float, se: float, z: float = 1.96) -> tuple[float, float]:
    """Normal-approximation interval, clipped to [0, 1]."""
    return max(0.0, mean - z * se), min(1.0, mean + z * se)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    # product form: no huge binomials
    prob_all_wrong = 1.0
    for i in range(n - c + 1, n + 1):
        prob_all_wrong *= 1.0 - k / i
    return 1.0 - prob_all_wrong


def per_item(ids: Sequence[str], correct: Sequence[Sequence[bool]]) -> list[dict[str, Any]]:
    """One row per item: id, samples, correct count, rate."""
    if len(ids) != len(correct):
        raise ValueError(f"{len(ids)} ids for {len(correct)} items")
    rates = item_rates(correct)
    return [
        {"id": str(i), "n_samples": len(row), "n_correct": sum(bool(c) for c in row), "rate": r}
        for i, row, r in zip(ids, correct, rates, strict=True)
    ]


def summarize(correct: Sequence[Sequence[bool]]) -> dict[str, Any]:
    """avg@k with its standard error and 95% interval, plus pass@k over the samples each item has."""
    rates = item_rates(correct)
    mean = sum(rates) / len(rates)
    se = stderr(rates)
    lo, hi = confidence_interval(mean, se)
    ks = {len(row) for row in correct}
    k = min(ks)
    pass_k = sum(pass_at_k(len(row), sum(bool(c) for c in row), k) for row in correct) / len(correct)
    return {
        "n_items": len(rates),
        "k": k,
        "accuracy": mean,
        "stderr": se,
        "ci95": [lo, hi],
        f"pass@{k}": pass_k,
        "n_samples": sum(len(row) for row in correct),
        "n_correct": sum(sum(bool(c) for c in row) for row in correct),
    }
