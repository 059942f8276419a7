"""The statistics of evaluations and of ablations: avg@k and pass@k, standard errors and intervals,
and the paired comparison of two arms.

Per benchmark. The headline number is avg@k: the mean over items of each item's fraction of correct
samples, i.e. the expected pass@1 of one sample. The standard error treats items as the sampling
unit: se = sd(per-item rate) / sqrt(n) (sample sd, ddof=1). With k samples per item this is the
clustered standard error: it contains both the item-to-item spread and the sampling noise of the k
draws, which a binomial se over all n*k samples would understate when items differ in difficulty.
A normal 95% interval (clipped to [0, 1]) is reported beside it. The unbiased pass@k estimator of
Chen et al. (2021) is provided for reporting pass@k with k' <= k.

Across runs. An arm's final held-out accuracy gets a Student-t 95% interval across seeds
(``t_interval``); two arms are compared on the same items (``paired_bootstrap``): each item's
accuracy averaged over the seeds of an arm (``mean_items``), the per-item difference, and a seeded
percentile bootstrap over items. The verdict says "no significant difference" whenever the interval
holds 0. The promotion gate uses the analytic form of the same pairing (``paired_difference``): the
mean per-item difference and its standard error sd(diff)/sqrt(n), which a margin in standard errors
is compared with. Departure from a full hierarchical bootstrap (items x seeds): with the 2-5 seeds an
ablation affords, resampling seeds adds little but noise; seed spread is shown by the t interval.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


class AblationError(ValueError):
    """An ablation cannot be set up or compared as asked; the message names the offending thing.

    Defined here, beside the statistics that raise it, so the evaluate stage's code version (its
    import closure) does not take in the ablation arms; ``arms`` re-exports it."""


# ---- one benchmark: avg@k, pass@k, standard error -------------------------------------------------
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


# ---- across runs: t intervals and the paired bootstrap ------------------------------------------
@dataclass(frozen=True)
class Interval:
    """A mean with its confidence interval (``lo``/``hi`` are NaN when n < 2: no spread to measure)."""

    mean: float
    lo: float
    hi: float
    n: int

    def text(self, digits: int = 3) -> str:
        if math.isnan(self.lo):
            return f"{self.mean:.{digits}f} (n={self.n}, no CI)"
        return f"{self.mean:.{digits}f} [{self.lo:.{digits}f}, {self.hi:.{digits}f}] (n={self.n})"


def t_interval(values: Sequence[float], level: float = 0.95) -> Interval:
    """Student-t interval of the mean: mean +- t_{(1+level)/2, n-1} * sd / sqrt(n), sd with n-1."""
    from scipy.stats import t as student_t

    xs = [float(v) for v in values]
    if not xs:
        raise AblationError("no values to summarize")
    n, mean = len(xs), sum(xs) / len(xs)
    if n < 2:
        return Interval(mean, math.nan, math.nan, n)
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    half = float(student_t.ppf((1 + level) / 2, n - 1)) * sd / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n)


@dataclass(frozen=True)
class Paired:
    """Arm ``a`` minus arm ``b`` on the same items: the mean per-item difference and its bootstrap CI."""

    a: str
    b: str
    diff: float
    lo: float
    hi: float
    n_items: int
    n_boot: int

    @property
    def significant(self) -> bool:
        return self.lo > 0 or self.hi < 0

    def verdict(self) -> str:
        ci = f"{self.diff:+.3f}, 95% CI [{self.lo:+.3f}, {self.hi:+.3f}] over {self.n_items} items"
        if not self.significant:
            return f"{self.a} vs {self.b}: no significant difference ({ci})"
        better, worse = (self.a, self.b) if self.diff > 0 else (self.b, self.a)
        return f"{self.a} vs {self.b}: {better} is better than {worse} ({ci})"


def paired_bootstrap(
    a: Mapping[str, float], b: Mapping[str, float], names: tuple[str, str] = ("a", "b"),
    n_boot: int = 10_000, seed: int = 0, level: float = 0.95,
) -> Paired:  # fmt: skip
    """Percentile bootstrap over items of mean(a[i] - b[i]); ``a``/``b`` map item id -> accuracy.

    Both arms must hold exactly the same items (a paired comparison). Seeded: the same inputs give
    the same interval."""
    if set(a) != set(b):
        only = sorted(set(a) ^ set(b))[:5]
        raise AblationError(f"paired comparison needs the same items in both arms; differing ids e.g. {only}")
    if not a:
        raise AblationError("paired comparison over zero items")
    ids = sorted(a)
    diffs = [float(a[i]) - float(b[i]) for i in ids]
    n = len(diffs)
    rng = random.Random(seed)
    means = sorted(sum(diffs[rng.randrange(n)] for _ in range(n)) / n for _ in range(n_boot))
    tail = (1 - level) / 2
    lo = means[max(0, math.floor(tail * n_boot))]
    hi = means[min(n_boot - 1, math.ceil((1 - tail) * n_boot) - 1)]
    return Paired(names[0], names[1], sum(diffs) / n, lo, hi, n, n_boot)


@dataclass(frozen=True)
class PairedDifference:
    """Mean of ``a[i] - b[i]`` over the shared items, its standard error (sd with n-1, over sqrt n)."""

    diff: float
    se: float
    n_items: int


def paired_difference(a: Mapping[str, float], b: Mapping[str, float]) -> PairedDifference:
    """The paired comparison of two adapters on the same items (``a``/``b``: item id -> rate)."""
    if set(a) != set(b):
        only = sorted(set(a) ^ set(b))[:5]
        raise ValueError(f"paired comparison needs the same items on both sides; differing ids e.g. {only}")
    if not a:
        raise ValueError("paired comparison over zero items")
    diffs = [float(a[i]) - float(b[i]) for i in sorted(a)]
    return PairedDifference(sum(diffs) / len(diffs), stderr(diffs), len(diffs))


def mean_items(per_seed: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Each item's accuracy averaged over an arm's seeds (all seeds must hold the same items)."""
    if not per_seed:
        raise AblationError("no per-item results")
    ids = set(per_seed[0])
    for other in per_seed[1:]:
        if set(other) != ids:
            raise AblationError("the seeds of one arm were evaluated on different items")
    return {i: sum(float(s[i]) for s in per_seed) / len(per_seed) for i in ids}
