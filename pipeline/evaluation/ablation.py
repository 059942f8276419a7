"""Ablations (``qerl ablate``): arms as config overrides, and the comparison of their runs.

What. QeRL's claims are comparative: NVFP4 LoRA explores more (higher policy entropy early) and
learns faster than 16-bit LoRA, and AQN adds to that. An ablation runs one ordinary run per
(arm, seed) and compares the arms. This module holds everything that is not Prefect:

- **Arms** (``ARMS``): overrides of the user's config. ``bf16-lora`` serves and trains the
  unquantized base (``quantize.scheme: none``, in the twin dtype = ``train.dtype``; the arm keeps
  the paper's name), ``nvfp4-lora`` the NVFP4 base without AQN, ``nvfp4-aqn`` is QeRL.
- **Seeds** (``arm_config``): "everything else identical, seeds included". Replicate ``i`` adds
  ``i`` to every seed that drives training randomness (``loop.seed``: prompt order; ``rollout.seed``:
  sampling and AQN noise; ``train.seed``: LoRA init) and is the same replicate in every arm, so arm A
  seed 1 and arm B seed 1 differ only by the arm. ``data.seed`` and ``eval.seed`` stay fixed: every run
  trains on the same problems and is evaluated on the same items with the same sampling seeds,
  which is what makes the paired comparison over items valid. Each run's ``loop.name`` becomes
  ``<name>-<arm>-s<i>`` so run ids are readable (the id is still the config hash).
- **Statistics**: the final held-out accuracy per arm with a Student-t 95% interval across seeds
  (``t_interval``); a paired comparison of two arms on the same items (``paired_bootstrap``): each
  item's accuracy averaged over the seeds of an arm, the per-item difference, and a seeded
  percentile bootstrap over items. The verdict says "no significant difference" whenever the
  interval holds 0. Departure from a full hierarchical bootstrap (items x seeds): with the 2-5 seeds
  an ablation affords, resampling seeds adds little but noise; seed spread is shown by the t interval.
- **Curves and report**: reward, rollout accuracy, policy entropy and the rollout/trainer mismatch
  (``train_mismatch_kl``) per step and arm (mean over seeds, min-max band) as PNGs, the entropy
  of the first steps compared explicitly, and a markdown report (``write_report``). A step that
  trained no token (every completion empty or truncated-and-masked) has no entropy or mismatch: the
  trainer records null there (``qerl.pipeline.rl.training``; records written before that hold a placeholder
  0 with ``train_tokens_trained == 0``). Such points are left out of the curves, and the early-entropy
  comparison averages the steps that have a value and says how many that was per run.
"""

from __future__ import annotations

import copy
import math
import os
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qerl.pipeline.config import config_hash
from qerl.pipeline.store.artifacts import atomic_write_text

ARMS: dict[str, dict[str, dict[str, Any]]] = {
    "bf16-lora": {"quantize": {"scheme": "none"}, "aqn": {"enabled": False}},
    "nvfp4-lora": {"quantize": {"scheme": "nvfp4"}, "aqn": {"enabled": False}},
    "nvfp4-aqn": {"quantize": {"scheme": "nvfp4"}, "aqn": {"enabled": True}},
}
SEED_KEYS = (("loop", "seed"), ("rollout", "seed"), ("train", "seed"))
# per-step curves: title -> history key candidates (first present wins); the mismatch is the train stage's
CURVES: dict[str, tuple[str, ...]] = {
    "reward": ("reward_mean",),
    "accuracy": ("accuracy",),
    "entropy": ("train_entropy", "entropy"),
    "mismatch_kl": ("train_mismatch_kl",),
}
EARLY_STEPS = 3  # "higher policy entropy early": the first steps compared explicitly
ABLATION_DIR = "ablations"  # <work>/ablations/<id>/: ablation.json, report.md, plots/ (qerl gc reads it)


class AblationError(ValueError):
    """An ablation cannot be set up or compared as asked; the message names the offending thing."""


# ---- arms and seeds ------------------------------------------------------------------------------
def parse_arms(text: str | Sequence[str]) -> list[str]:
    """``"a,b"`` or a list -> arm names, checked: known, distinct, at least two."""
    names = [a.strip() for a in (text.split(",") if isinstance(text, str) else text) if a.strip()]
    unknown = [a for a in names if a not in ARMS]
    if unknown:
        raise AblationError(f"unknown arm(s) {unknown}; the arms are {sorted(ARMS)}")
    if len(set(names)) != len(names):
        raise AblationError(f"arms must be distinct, got {names}")
    if len(names) < 2:
        raise AblationError(f"an ablation compares at least two arms, got {names}")
    return names


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = copy.deepcopy(value)
    return base


def arm_config(config: Mapping[str, Any], arm: str, replicate: int) -> dict[str, Any]:
    """The run config of (``arm``, replicate ``replicate``): the user's config, the arm's overrides, and
    every training seed shifted by ``replicate`` (see the module docstring). ``config`` is not changed."""
    if arm not in ARMS:
        raise AblationError(f"unknown arm '{arm}'; the arms are {sorted(ARMS)}")
    if replicate < 0:
        raise AblationError(f"replicate must be >= 0, got {replicate}")
    out = _merge(copy.deepcopy(dict(config)), ARMS[arm])
    for section, key in SEED_KEYS:
        part = out.setdefault(section, {})
        part[key] = int(part.get(key, 0)) + replicate
    loop = out.setdefault("loop", {})
    loop["name"] = f"{loop.get('name', 'demo')}-{arm}-s{replicate}"
    return out


def check_seeds(seeds: int) -> int:
    """The number of replicates per arm, checked: a whole number >= 1 (``--seeds 0`` would run nothing
    and then fail in the comparison, after Prefect had started)."""
    if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
        raise AblationError(f"--seeds must be a whole number >= 1 (replicates per arm), got {seeds!r}")
    return seeds


def ablation_id(config: Mapping[str, Any], arms: Sequence[str], seeds: int) -> str:
    """``abl-<hash>``: the same config, arms and seed count are the same ablation (so a re-run resumes).

    Checks ``seeds`` first: the CLI computes the id before it starts Prefect, so a bad count fails there."""
    check_seeds(seeds)
    return f"abl-{config_hash({'config': dict(config), 'arms': list(arms), 'seeds': seeds})[:10]}"


# ---- statistics ----------------------------------------------------------------------------------
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


def mean_items(per_seed: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Each item's accuracy averaged over an arm's seeds (all seeds must hold the same items)."""
    if not per_seed:
        raise AblationError("no per-item results")
    ids = set(per_seed[0])
    for other in per_seed[1:]:
        if set(other) != ids:
            raise AblationError("the seeds of one arm were evaluated on different items")
    return {i: sum(float(s[i]) for s in per_seed) / len(per_seed) for i in ids}


# ---- curves --------------------------------------------------------------------------------------
def step_values(history: Sequence[Mapping[str, Any]], candidates: Sequence[str]) -> dict[int, float]:
    """step -> value of the first key of ``candidates`` present (finite values only).

    A trainer metric (``train_*``) of a step that trained no token is left out: the trainer records
    null there (older records: a placeholder 0 beside ``train_tokens_trained == 0``), since entropy or
    mismatch of nothing is undefined, and a 0 would drag an arm's early entropy down."""
    for key in candidates:
        points = {
            int(e.get("step", i)): float(e[key])
            for i, e in enumerate(history)
            if isinstance(e.get(key), int | float)
            and math.isfinite(float(e[key]))
            and not (key.startswith("train_") and e.get("train_tokens_trained") == 0)
        }
        if points:
            return points
    return {}


def arm_curve(histories: Sequence[Sequence[Mapping[str, Any]]], candidates: Sequence[str]) -> list[tuple]:
    """(step, mean, min, max) over an arm's seeds for every step some seed has."""
    per_seed = [step_values(h, candidates) for h in histories]
    steps = sorted({s for p in per_seed for s in p})
    out = []
    for step in steps:
        vals = [p[step] for p in per_seed if step in p]
        out.append((step, sum(vals) / len(vals), min(vals), max(vals)))
    return out


def early_values(history: Sequence[Mapping[str, Any]], candidates: Sequence[str], steps: int) -> list[float]:
    """The values of a metric at steps ``0..steps-1`` of one run, only the steps that have one."""
    return [v for s, v in sorted(step_values(history, candidates).items()) if s < steps]


def early_mean(history: Sequence[Mapping[str, Any]], candidates: Sequence[str], steps: int) -> float:
    """The mean of a metric over steps ``0..steps-1`` of one run (NaN when none of them has it)."""
    first = early_values(history, candidates, steps)
    return sum(first) / len(first) if first else math.nan


def write_curve_plots(arms: Mapping[str, Sequence[Sequence[Mapping[str, Any]]]], out_dir: Path) -> list[Path]:
    """One PNG per curve in ``CURVES``: a line per arm (mean over seeds) with its min-max band."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    # Figure + Agg canvas, not pyplot: no global state (as qerl.pipeline.registry.tracking.write_plots)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, candidates in CURVES.items():
        lines = {arm: arm_curve(h, candidates) for arm, h in arms.items()}
        if not any(lines.values()):
            continue
        fig = Figure(figsize=(6.5, 3.8), dpi=100)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        for arm, points in lines.items():
            if not points:
                continue
            steps = [p[0] for p in points]
            ax.plot(steps, [p[1] for p in points], marker="o" if len(points) < 30 else None, label=arm)
            ax.fill_between(steps, [p[2] for p in points], [p[3] for p in points], alpha=0.2)
        ax.set_xlabel("step")
        ax.set_ylabel(candidates[0])
        ax.set_title(f"{name} per arm (mean over seeds, band: min-max)")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = out_dir / f"{name}.png"
        tmp = path.with_name(f".{path.name}.tmp")  # a re-run's report replaces the plot whole or not at all
        fig.savefig(tmp, format="png")
        os.replace(tmp, path)
        written.append(path)
    return written


# ---- the comparison ------------------------------------------------------------------------------
@dataclass
class ArmRuns:
    """One arm's finished runs: per seed its run id, final accuracy, per-item rates and step history,
    and the accuracy of the arm's base without an adapter where the runs evaluated it (the arms start
    from different bases: NVFP4 rounding costs the base accuracy before any training)."""

    arm: str
    run_ids: list[str]
    final_accuracy: list[float]
    items: list[dict[str, float]]
    histories: list[list[dict[str, Any]]]
    base_accuracy: list[float] = field(default_factory=list)


def compare(arms: Sequence[ArmRuns], n_boot: int = 10_000, seed: int = 0) -> dict[str, Any]:
    """The comparison as plain data: per-arm intervals, early entropy, and every pair's paired test.

    Pairs are (later arm, earlier arm) in the order given, e.g. nvfp4-lora - bf16-lora."""
    if len(arms) < 2:
        raise AblationError(f"a comparison needs at least two arms, got {[a.arm for a in arms]}")
    early = {a.arm: [early_values(h, CURVES["entropy"], EARLY_STEPS) for h in a.histories] for a in arms}
    means = {arm: [sum(v) / len(v) if v else math.nan for v in runs] for arm, runs in early.items()}
    per_arm = {
        a.arm: {
            "runs": a.run_ids,
            "final_accuracy": a.final_accuracy,
            "accuracy_ci": t_interval(a.final_accuracy),
            "base_accuracy": a.base_accuracy,
            "early_entropy": means[a.arm],  # per run: NaN when none of its first steps trained a token
            "early_entropy_steps": [len(v) for v in early[a.arm]],  # how many of them had a value
            "early_entropy_ci": _finite_interval(means[a.arm]),
        }
        for a in arms
    }
    items = {a.arm: mean_items(a.items) for a in arms}
    pairs = [
        paired_bootstrap(items[arms[j].arm], items[arms[i].arm], (arms[j].arm, arms[i].arm), n_boot, seed)
        for i in range(len(arms))
        for j in range(i + 1, len(arms))
    ]
    return {"arms": per_arm, "pairs": pairs, "early_steps": EARLY_STEPS, "n_boot": n_boot, "seed": seed}


def _finite_interval(values: Sequence[float]) -> Interval | None:
    """The t interval over the finite values (the runs that have any); None when there are none."""
    finite = [v for v in values if math.isfinite(v)]
    return t_interval(finite) if finite else None


def report_markdown(ablation: str, result: Mapping[str, Any], plots: Sequence[str]) -> str:
    """The human report: verdicts first, then the tables, then the plots (relative paths)."""
    lines = [f"# qerl ablation `{ablation}`", "", "## Verdict", ""]
    lines += [f"- {p.verdict()}" for p in result["pairs"]]
    lines += ["", "## Final held-out accuracy (95% t-interval across seeds)", ""]
    lines += ["| arm | base, no adapter | accuracy | per seed | runs |", "|---|---|---|---|---|"]
    for arm, r in result["arms"].items():
        seeds = ", ".join(f"{v:.3f}" for v in r["final_accuracy"])
        base = ", ".join(sorted({f"{v:.3f}" for v in r.get("base_accuracy", [])})) or "not evaluated"
        lines.append(f"| {arm} | {base} | {r['accuracy_ci'].text()} | {seeds} | {', '.join(r['runs'])} |")
    lines += ["", "## Paired comparison on the same items (bootstrap over items)", ""]
    lines += ["| a - b | mean diff | 95% CI | items | significant |", "|---|---|---|---|---|"]
    for p in result["pairs"]:
        lines.append(
            f"| {p.a} - {p.b} | {p.diff:+.4f} | [{p.lo:+.4f}, {p.hi:+.4f}] | {p.n_items} | "
            f"{'yes' if p.significant else 'no'} |"
        )
    k = result["early_steps"]
    lines += ["", f"## Policy entropy over the first {k} steps (mean per run; 95% t-interval)", ""]
    lines += [
        "Steps that trained no token (every completion empty, or truncated and masked) have no entropy: "
        f"a run's value is the mean over those of its first {k} steps that have one (last column: how "
        "many), and a run with none is left out of its arm's interval.",
        "",
    ]
    lines += ["| arm | early entropy | per seed | steps with a value, per seed |", "|---|---|---|---|"]
    for arm, r in result["arms"].items():
        ci = r["early_entropy_ci"].text(4) if r["early_entropy_ci"] else "n/a (no step trained a token)"
        seeds = ", ".join(f"{v:.4f}" if math.isfinite(v) else "n/a" for v in r["early_entropy"])
        counts = ", ".join(f"{n}/{k}" for n in r["early_entropy_steps"])
        lines.append(f"| {arm} | {ci} | {seeds} | {counts} |")
    lines += ["", "## Curves", ""]
    lines += [f"![{Path(p).stem}]({p})" for p in plots] or ["(no per-step metrics recorded)"]
    lines += [
        "",
        f"Bootstrap: {result['n_boot']} resamples of the items, seed {result['seed']}; an item's accuracy in "
        "an arm is its avg@k averaged over the arm's seeds.",
    ]
    return "\n".join(lines) + "\n"


def table_rows(result: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per arm, for a Prefect table artifact."""
    return [
        {
            "arm": arm,
            "accuracy": round(r["accuracy_ci"].mean, 4),
            "ci_lo": None if math.isnan(r["accuracy_ci"].lo) else round(r["accuracy_ci"].lo, 4),
            "ci_hi": None if math.isnan(r["accuracy_ci"].hi) else round(r["accuracy_ci"].hi, 4),
            "seeds": r["accuracy_ci"].n,
            "early_entropy": round(r["early_entropy_ci"].mean, 5) if r["early_entropy_ci"] else None,
        }
        for arm, r in result["arms"].items()
    ]


def write_report(
    ablation: str, arms: Sequence[ArmRuns], out_dir: Path, n_boot: int = 10_000, seed: int = 0
) -> tuple[dict[str, Any], Path]:
    """Compare, draw the curves into ``out_dir/plots`` and write ``out_dir/report.md``."""
    result = compare(arms, n_boot, seed)
    plots = write_curve_plots({a.arm: a.histories for a in arms}, out_dir / "plots")
    text = report_markdown(ablation, result, [str(p.relative_to(out_dir)) for p in plots])
    path = out_dir / "report.md"
    atomic_write_text(path, text)
    return result, path
