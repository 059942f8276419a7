"""A run's results for people and for Prefect: record entries made from manifests, their one-line
forms, the result ``qerl run`` prints, and the Prefect artifacts.

Each evaluation names its benchmark (``gsm8k/test@<digest>``: name, split and the digest of the exact
items), its accuracy (avg@k) with the standard error over items, the item count and k, and the same
for each ``eval.also`` benchmark (``also``), so two runs' numbers can be compared knowing what they
measured and how precisely. The lift is the final adapter against the base on the same items,
paired.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qerl.pipeline.evaluation import statistics
from qerl.pipeline.evaluation.items import ITEMS_FILE, item_rates
from qerl.pipeline.store.layout import MLFLOW_DB, RUN_RECORD
from qerl.pipeline.store.manifest import Manifest
from qerl.pipeline.store.run_record import (
    Evaluation,
    Lift,
    Registration,
    RunRecord,
    StepEntry,
    ValidationResult,
    run_dir,
)
from qerl.stages import evaluate

log = logging.getLogger("qerl.flow")


def step_entry(step: int, sigma: float, r: Manifest, s: Manifest, t: Manifest) -> StepEntry:
    """One step's entry: the numeric metrics of its rollout (``rollout_*``), score (the headline
    names, else ``score_*``) and train (``train_*``) manifests and their keys, with the AQN sigma the
    engine realised (measured from its norm weights) beside the requested ``sigma``."""
    metrics: dict[str, Any] = {"aqn_sigma_realised": r.metrics.get("aqn_sigma_realised")}
    metrics.update(
        {
            f"rollout_{k}": v
            for k, v in r.metrics.items()
            if isinstance(v, int | float) and not k.startswith("aqn_")
        }
    )
    keep = ("reward_mean", "reward_std", "accuracy")
    metrics.update(
        {k if k in keep else f"score_{k}": v for k, v in s.metrics.items() if isinstance(v, int | float)}
    )
    # a per-token mean of a step that trained no token is None: kept as null, a point the curves skip
    metrics.update(
        {f"train_{k}": v for k, v in t.metrics.items() if v is None or isinstance(v, int | float | bool)}
    )
    manifests = {"rollout": r.key, "score": s.key, "train": t.key}  # read by qerl gc
    return StepEntry.model_validate({"step": step, "sigma": sigma, **metrics, "manifests": manifests})


def evaluation_entry(step: int, adapter: Manifest | None, ev: Manifest) -> Evaluation:
    """The record's entry for one evaluation (module docstring)."""
    summary = evaluate.load_summary(ev) if "summary.json" in ev.files else {}
    stderr = ev.metrics.get("stderr", summary.get("stderr"))
    also = [
        {
            "benchmark": o.get("benchmark"),
            "name": f"{o.get('benchmark_name')}_{o.get('split')}",
            "accuracy": float(o["accuracy"]),
            "stderr": o.get("stderr"),
            "n_items": o.get("n_items"),
        }
        for o in summary.get("also") or []
    ]
    entry = Evaluation(
        step=step,
        adapter=adapter.key if adapter else None,
        benchmark=ev.extra.get("benchmark", summary.get("benchmark")),
        accuracy=float(ev.metrics.get("accuracy", float("nan"))),
        stderr=None if stderr is None else float(stderr),
        n_items=ev.metrics.get("n_items", summary.get("n_items")),
        k=ev.metrics.get("k", summary.get("k")),
        dropped_too_long=(summary.get("prompts") or {}).get("dropped_too_long", 0),
        also=also,
        manifest=str(ev.dir),
    )
    if "accuracy_validation" in ev.metrics:
        entry.validation = ValidationResult(
            benchmark=ev.extra.get("validation"),
            accuracy=ev.metrics["accuracy_validation"],
            stderr=ev.metrics.get("stderr_validation"),
        )
    return entry


def lift_of(final: Manifest, base: Manifest) -> Lift | None:
    """The final adapter against the base on the test items, paired; None when not the same items."""
    if ITEMS_FILE not in final.files or ITEMS_FILE not in base.files:
        return None
    try:
        paired = statistics.paired_difference(item_rates(final), item_rates(base))
    except ValueError:
        return None
    return Lift(
        base=float(base.metrics.get("accuracy", float("nan"))),
        final=float(final.metrics.get("accuracy", float("nan"))),
        diff=paired.diff,
        se=paired.se,
        n_items=paired.n_items,
    )


def _pm(accuracy: float, stderr: float | None) -> str:
    return f"{accuracy:.3f}" if stderr is None else f"{accuracy:.3f} ± {stderr:.3f}"


def eval_text(entry: Evaluation) -> str:
    """``accuracy 0.302 ± 0.041 (arithmetic/test@..., 100 items); gsm8k_test 0.040 ± 0.028``."""
    text = f"accuracy {_pm(entry.accuracy, entry.stderr)}"
    if entry.benchmark:
        dropped = f", {entry.dropped_too_long} dropped: prompt too long" if entry.dropped_too_long else ""
        text += f" ({entry.benchmark}, {entry.n_items} items{dropped})"
    return "; ".join([text, *(f"{o.name} {_pm(o.accuracy, o.stderr)}" for o in entry.also)])


def lift_line(lift: Lift) -> str:
    """``lift: base 0.171 -> 0.204, +0.033 (1.6 se, paired over 200 items)``."""
    ratio = f"{lift.diff / lift.se:.1f} se" if lift.se > 0 else "se 0"
    return (
        f"lift: base {lift.base:.3f} -> {lift.final:.3f}, {lift.diff:+.3f} "
        f"({ratio}, paired over {lift.n_items} items)"
    )


def registered_line(reg: Registration, by: str | None, name: str = "{}") -> str:
    """The registration in one line; ``by``: the other run whose version it reused (whose decision
    the champion alias reflects, not this run's)."""
    model = name.format(reg.model_name)
    if by is None:
        return (
            f"registered {model} v{reg.version}, {'promoted to champion' if reg.promoted else 'not promoted'}"
        )
    return f"already registered: {model} v{reg.version}, by run {by} (the same adapter), {'champion' if reg.promoted else 'not champion'}"


def result_lines(record: RunRecord, work: Path) -> list[str]:
    """What ``qerl run`` and ``qerl resume`` print last: the outcome, evaluations, lift, registration
    and where the record, log, adapter and MLflow UI are."""
    reg, night = record.registration, f", night {record.night}" if record.night else ""
    lines = [f"run {record.run_id}: {record.status} (engine mode {record.engine_mode}{night})"]
    if record.data is not None and record.data.dropped_too_long:
        lines.append(
            f"  data: {record.data.kept} problems, {record.data.dropped_too_long} dropped (prompt > {record.data.prompt_token_limit} tokens)"
        )
    if record.warm_start_version:
        lines.append(
            f"  warm start: {(reg.model_name if reg else None) or 'adapter'} v{record.warm_start_version}"
        )
    for e in record.evaluations:
        lines.append(
            f"  {eval_text(e)}  {'base (no adapter)' if e.adapter is None else f'adapter after step {e.step}'}"
        )
    if record.lift is not None:
        lines.append(f"  {lift_line(record.lift)}")
    if reg is not None:
        by = record.earlier_registration()
        lines.append(f"  {registered_line(reg, by)}")
        if reg.promotion:
            lines.append(f"  promotion{'' if by is None else f' (run {by})'}: {reg.promotion}")
    folder = run_dir(work, record.run_id)
    lines += [
        f"  run record: {folder / RUN_RECORD}",
        f"  log:        {folder / 'run.log'}",
        f"  adapter:    {record.final_adapter}",
    ]
    uri = (record.config.get("registry") or {}).get("tracking_uri") or ""
    if uri.startswith(("http://", "https://")):  # a tracking server serves its own UI
        lines.append(f"  MLflow UI:  {uri}")
    else:  # a database URI may hold a password: name the setting, not its value
        lines.append(
            f"  MLflow UI:  mlflow ui --backend-store-uri {'<registry.tracking_uri>' if uri else f'sqlite:///{work / MLFLOW_DB}'}"
        )
    return lines


def summary_markdown(record: RunRecord) -> str:
    """The run as markdown: status, a table of its evaluations, its registration."""
    lines = [f"# qerl run `{record.run_id}`", "", f"status: **{record.status}**", ""]
    if record.evaluations:
        lines += [
            "| after step | adapter | benchmark | accuracy ± stderr | items | also |",
            "|---|---|---|---|---|---|",
        ]
        for e in record.evaluations:
            also = "; ".join(f"{o.name} {_pm(o.accuracy, o.stderr)}" for o in e.also)
            lines.append(
                f"| {e.step} | {e.adapter or 'none (base)'} | {e.benchmark or ''} | "
                f"{_pm(e.accuracy, e.stderr)} | {e.n_items or ''} | {also} |"
            )
    if record.registration is not None:
        lines += ["", registered_line(record.registration, record.earlier_registration(), "`{}`")]
    return "\n".join(lines)


def table_row(entry: Evaluation) -> dict[str, Any]:
    """An evaluation as one flat table row: each ``eval.also`` benchmark becomes its own columns."""
    row = entry.model_dump(exclude={"manifest", "also", "validation"})
    for o in entry.also:
        row.update({f"{o.name}_accuracy": o.accuracy, f"{o.name}_stderr": o.stderr})
    return row


def publish(record: RunRecord, answers: Callable[[], bool]) -> None:
    """Prefect artifacts: a markdown summary and the evaluation table. Called from the flow's
    ``finally``, so a failure is a warning (the record on disk holds the same facts); a Prefect API
    that does not answer (``answers``) is not asked, since each call would retry against it."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    if not answers():
        log.warning("Prefect artifacts for %s not published: the server does not answer", record.run_id)
        return
    try:
        key = record.run_id.lower().replace("_", "-").replace(".", "-")
        create_markdown_artifact(summary_markdown(record), key=f"{key}-summary", description="qerl run")
        if record.evaluations:
            rows = [table_row(e) for e in record.evaluations]
            create_table_artifact(rows, key=f"{key}-evaluation", description="evaluations")
    except Exception as err:  # noqa: BLE001
        log.warning("could not publish Prefect artifacts for %s: %s", record.run_id, err)
