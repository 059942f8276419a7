"""The comparison of an ablation's arms and its report: per-step curves, plots, markdown, table.

- **Comparison** (``compare``): per arm the final held-out accuracy with its t interval across seeds
  and the policy entropy of the first ``EARLY_STEPS`` steps; per pair of arms the paired bootstrap
  over items (``qerl.pipeline.evaluation.statistics``).
- **Curves**: reward, rollout accuracy, policy entropy and the rollout/trainer mismatch
  (``train_mismatch_kl``) per step and arm (mean over seeds, min-max band) as PNGs, and the entropy
  of the first steps compared explicitly. A step that trained no token (every completion empty or
  truncated-and-masked) has no entropy or mismatch: the trainer records null there
  (``qerl.pipeline.rl.step``; a record may instead hold a placeholder 0 beside
  ``train_tokens_trained == 0``, which counts as null). Such points are left out of the curves, and the early-entropy
  comparison averages the steps that have a value and says how many that was per run.
- **Report** (``write_report``): ``report.md`` (verdicts first, then the tables, then the plots) and
  ``plots/*.png`` in the ablation's folder; ``table_rows`` is one row per arm for a Prefect table.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qerl.pipeline.evaluation.arms import AblationError
from qerl.pipeline.evaluation.statistics import Interval, mean_items, paired_bootstrap, t_interval
from qerl.pipeline.store.files import atomic_write_text

# per-step curves: title -> history key candidates (first present wins); the mismatch is the train stage's
CURVES: dict[str, tuple[str, ...]] = {
    "reward": ("reward_mean",),
    "accuracy": ("accuracy",),
    "entropy": ("train_entropy", "entropy"),
    "mismatch_kl": ("train_mismatch_kl",),
}


EARLY_STEPS = 3  # "higher policy entropy early": the first steps compared explicitly


# ---- curves --------------------------------------------------------------------------------------
def step_values(history: Sequence[Mapping[str, Any]], candidates: Sequence[str]) -> dict[int, float]:
    """step -> value of the first key of ``candidates`` present (finite values only).

    A trainer metric (``train_*``) of a step that trained no token is left out: the trainer records
    null there (or a placeholder 0 beside ``train_tokens_trained == 0``), since entropy or
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
    # per seed, the run record's ``quantize`` entry: method, mode and the quality metrics
    # (quantize_kl, quantize_top1, quantize_ppl_base, quantize_ppl_quant) of the arm's quantized base
    quantize: list[dict[str, Any]] = field(default_factory=list)


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
            "quantize": next((q for q in a.quantize if q), {}),  # one base per arm: every seed's is the same
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


# ---- the report ----------------------------------------------------------------------------------
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
    lines += _base_table(result["arms"])
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


def _base_table(arms: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Each arm's starting point: how its base was quantized and what that cost before any training
    (``quantize.quality``: KL(base||quantized), top-1 agreement, perplexities on held-out text)."""
    if not any(r.get("quantize") for r in arms.values()):
        return []
    lines = ["", "## The arms' bases before training (quantize.quality, held-out text)", ""]
    lines += ["| arm | quantizer | KL nats/token | top-1 agreement | perplexity base -> quantized |"]
    lines += ["|---|---|---|---|---|"]
    for arm, r in arms.items():
        q = r.get("quantize") or {}
        if not q:
            lines.append(f"| {arm} | not recorded | | | |")
            continue
        if q.get("method") is None:  # the unquantized base: the reference itself
            lines.append(f"| {arm} | none (the base itself) | 0 | 1 | |")
            continue
        kl, top1 = (f"{q[k]:.3f}" if k in q else "not measured" for k in ("quantize_kl", "quantize_top1"))
        ppl = (
            f"{q['quantize_ppl_base']:.2f} -> {q['quantize_ppl_quant']:.2f}"
            if "quantize_ppl_quant" in q
            else ""
        )
        lines.append(f"| {arm} | {q['method']} | {kl} | {top1} | {ppl} |")
    return lines


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
