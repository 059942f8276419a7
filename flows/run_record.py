"""A run's record and how it is shown: ``<work>/runs/<run_id>/run.json``, the run's id, and the
one-line, markdown and table forms of its evaluations.

The record holds the config, night, data slice, warm start, status, per-step manifests, history,
evaluations and registration; the console's log is ``run.log`` beside it. Each attempt at a run
rewrites the record from its first save on, and that first save already carries what the earlier
attempts decided once for the run (``carried_over``: the plan, i.e. the data slice and the warm
start, and the id of its MLflow run, ``mlflow_run_id``), so an attempt that dies before it restores
its plan (while the base is fetched or quantized, or the data loaded) leaves the plan where the next
attempt finds it. A plain run's id is
``<loop.name>-<config hash>``, the hash of the settings that change results (resource settings, the
retention policy ``store`` among them, are not part of it: ``qerl.pipeline.config.resource_field``);
a nightly run's id adds the night (``-YYYYMMDD``). ``with_resources`` applies ``qerl resume RUN --set``:
resource settings only, since any other setting would make another run. Each evaluation names its benchmark (``gsm8k/test@<digest>``:
name, split and the digest of the exact items), its accuracy (avg@k) with the standard error over
items, the item count and k, and the same for each ``eval.also`` benchmark (``also``), so two runs'
numbers can be compared knowing what they measured and how precisely.
"""

from __future__ import annotations

import datetime as _dt
import logging
from pathlib import Path
from typing import Any

from prefect.artifacts import create_markdown_artifact, create_table_artifact
from qerl.pipeline.config import ConfigError, apply_overrides, config_hash
from qerl.pipeline.evaluation import statistics
from qerl.pipeline.evaluation.items import ITEMS_FILE, item_rates
from qerl.pipeline.planning.prompt_stream import night_label
from qerl.pipeline.planning.run_config import RunConfig
from qerl.pipeline.store.files import atomic_write_json, read_json
from qerl.pipeline.store.layout import RUN_RECORD, RUNS_DIR, TRAIN_STAGE, recorded_run
from qerl.pipeline.store.manifest import Manifest
from qerl.stages import evaluate

log = logging.getLogger("qerl.flow")


def run_id_for(cfg: RunConfig, night: _dt.date | None = None) -> str:
    """``<loop.name>-<config hash>``, plus ``-YYYYMMDD`` for a nightly run.

    The hash leaves out resource fields (``qerl.pipeline.config.resource_field``: engine sizing, reward
    workers and deadlines, the retention policy ``store``...): a run resumed with other resources is the
    same run, and its record keeps the whole config."""
    base = f"{cfg.loop.name}-{config_hash(cfg)[:10]}"
    return f"{base}-{night_label(night)}" if night else base


def with_resources(cfg: RunConfig, night: _dt.date | None, overrides: list[str]) -> RunConfig:
    """A recorded run's config with ``--set`` overrides of resource settings (``qerl resume --set``);
    an override that changes results (the run id) is a ConfigError naming it."""
    run_id = run_id_for(cfg, night)
    # validated together: settings that only fit as a pair (a smaller minibatch with a larger
    # grad_accum keeps the update size) must not be checked one at a time
    combined = apply_overrides(cfg, overrides)
    if run_id_for(combined, night) == run_id:
        return combined
    blamed = [pair for pair in overrides if _changes_run(cfg, night, pair, run_id)] or overrides
    raise ConfigError(
        f"--set {', '.join(blamed)} changes results (the setting is in cache keys and the run id): that is "
        f"another run than {run_id}; start it with qerl run. resume --set takes resource settings "
        'only ("in keys: no" in the configuration reference)'
    )


def _changes_run(cfg: RunConfig, night: _dt.date | None, pair: str, run_id: str) -> bool:
    """Whether ``--set pair`` alone gives another run id (False when it is invalid alone)."""
    try:
        return run_id_for(apply_overrides(cfg, [pair]), night) != run_id
    except ConfigError:
        return False


def run_dir(work: Path, run_id: str) -> Path:
    """``<work>/runs/<run_id>``: the run's record and its console log."""
    return work / RUNS_DIR / run_id


def load_run_record(work: Path, run_id: str) -> dict[str, Any]:
    """The run's ``run.json``; a missing run names the runs there are, a damaged record its path."""
    return read_json(recorded_run(work, run_id))


CARRIED_FIELDS = ("plan", "mlflow_run_id")  # decided by a run's first attempt; later ones keep them


def carried_over(previous: dict[str, Any]) -> dict[str, Any]:
    """What a new attempt's record starts with from the previous attempt's (``CARRIED_FIELDS``)."""
    return {k: previous[k] for k in CARRIED_FIELDS if previous.get(k)}


def save_record(work: Path, record: dict[str, Any]) -> None:
    """Write ``run.json`` atomically, stamped with ``updated_at``."""
    record["updated_at"] = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    atomic_write_json(run_dir(work, record["run_id"]) / RUN_RECORD, record)


def step_record(step: int, sigma: float, r: Manifest, s: Manifest, t: Manifest) -> dict[str, Any]:
    """One step's entry of the run record: the numeric metrics of its rollout, score and train
    manifests (``rollout_*``, the headline names or ``score_*``, ``train_*``) and their keys, with the
    AQN sigma the engine realised (``aqn_sigma_realised``, measured from its norm weights; None for a
    rollout manifest without it) beside the requested ``sigma``."""
    metrics: dict[str, Any] = {
        "step": step,
        "sigma": sigma,
        "aqn_sigma_realised": r.metrics.get("aqn_sigma_realised"),
    }
    metrics.update(
        {
            f"rollout_{k}": v
            for k, v in r.metrics.items()
            if isinstance(v, int | float) and not k.startswith("aqn_")
        }
    )
    keep = ("reward_mean", "reward_std", "accuracy")  # the headline names; the rest are score_*
    metrics.update(
        {k if k in keep else f"score_{k}": v for k, v in s.metrics.items() if isinstance(v, int | float)}
    )
    # a per-token mean of a step that trained no token is None: kept as null, a point the curves skip
    metrics.update(
        {f"train_{k}": v for k, v in t.metrics.items() if v is None or isinstance(v, int | float | bool)}
    )
    metrics["manifests"] = {"rollout": r.key, "score": s.key, TRAIN_STAGE: t.key}  # read by qerl gc
    return metrics


def eval_entry(step: int, adapter: Manifest | None, ev: Manifest) -> dict[str, Any]:
    """The run record's entry for one evaluation (module docstring): benchmark id, accuracy, its
    standard error, items and k, and the same for every ``eval.also`` benchmark."""
    summary = evaluate.load_summary(ev) if "summary.json" in ev.files else {}
    stderr = ev.metrics.get("stderr", summary.get("stderr"))
    if stderr is None and "items.parquet" in ev.files:  # a manifest without a recorded stderr
        import pyarrow.parquet as pq

        stderr = statistics.stderr(pq.read_table(ev.file("items.parquet")).column("rate").to_pylist())
    return {
        "step": step,
        "adapter": adapter.key if adapter else None,
        "benchmark": ev.extra.get("benchmark", summary.get("benchmark")),
        "accuracy": float(ev.metrics.get("accuracy", float("nan"))),
        "stderr": None if stderr is None else float(stderr),
        "n_items": ev.metrics.get("n_items", summary.get("n_items")),
        "k": ev.metrics.get("k", summary.get("k")),
        # items left out because their prompt leaves no room for eval.max_new_tokens in the context
        "dropped_too_long": (summary.get("prompts") or {}).get("dropped_too_long", 0),
        "also": [
            {
                "benchmark": o.get("benchmark"),
                "name": f"{o.get('benchmark_name')}_{o.get('split')}",  # as the manifest's accuracy_<name>
                "accuracy": float(o["accuracy"]),
                "stderr": o.get("stderr"),
                "n_items": o.get("n_items"),
            }
            for o in summary.get("also") or []
        ],
        "manifest": str(ev.dir),
    }


def _pm(accuracy: float, stderr: float | None) -> str:
    return f"{accuracy:.3f}" if stderr is None else f"{accuracy:.3f} ± {stderr:.3f}"


def eval_text(entry: dict[str, Any]) -> str:
    """An evaluation entry in one line (console, CLI summary):
    ``accuracy 0.302 ± 0.041 (arithmetic/test@..., 100 items); gsm8k_test 0.040 ± 0.028``."""
    text = f"accuracy {_pm(entry['accuracy'], entry.get('stderr'))}"
    if entry.get("benchmark"):
        dropped = (
            f", {entry['dropped_too_long']} dropped: prompt too long" if entry.get("dropped_too_long") else ""
        )
        text += f" ({entry['benchmark']}, {entry.get('n_items')} items{dropped})"
    others = [f"{o['name']} {_pm(o['accuracy'], o.get('stderr'))}" for o in entry.get("also") or []]
    return "; ".join([text, *others])


def summary_markdown(record: dict[str, Any]) -> str:
    """The run as markdown: status, a table of its evaluations, its registration."""
    lines = [f"# qerl run `{record['run_id']}`", "", f"status: **{record['status']}**", ""]
    evals = record.get("evaluations", [])
    if evals:
        lines += [
            "| after step | adapter | benchmark | accuracy ± stderr | items | also |",
            "|---|---|---|---|---|---|",
        ]
        for e in evals:
            also = "; ".join(
                f"{o['name']} {_pm(o['accuracy'], o.get('stderr'))}" for o in e.get("also") or []
            )
            lines.append(
                f"| {e['step']} | {e['adapter'] or 'none (base)'} | {e.get('benchmark') or ''} | "
                f"{_pm(e['accuracy'], e.get('stderr'))} | {e.get('n_items') or ''} | {also} |"
            )
    reg = record.get("registration") or {}
    if reg:
        lines += [
            "",
            registered_line(reg, earlier_registration(record), "`{}`"),
        ]
    return "\n".join(lines)


def lift_entry(final: Manifest, base: Manifest) -> dict[str, Any] | None:
    """The final adapter against the base model on the test benchmark's items, paired (the mean
    per-item difference and its standard error); None when the two are not the same items."""
    if ITEMS_FILE not in final.files or ITEMS_FILE not in base.files:
        return None
    try:
        paired = statistics.paired_difference(item_rates(final), item_rates(base))
    except ValueError:
        return None
    return {"base": float(base.metrics.get("accuracy", float("nan"))),
            "final": float(final.metrics.get("accuracy", float("nan"))),
            "diff": paired.diff, "se": paired.se, "n_items": paired.n_items}  # fmt: skip


def lift_line(lift: dict[str, Any]) -> str:
    """``lift: base 0.171 -> 0.204, +0.033 (1.6 se, paired over 200 items)``."""
    ratio = f"{lift['diff'] / lift['se']:.1f} se" if lift["se"] > 0 else "se 0"
    return (f"lift: base {lift['base']:.3f} -> {lift['final']:.3f}, {lift['diff']:+.3f} "
            f"({ratio}, paired over {lift['n_items']} items)")  # fmt: skip


def registered_line(reg: dict[str, Any], by: str | None, name: str = "{}") -> str:
    """The registration in one line; ``by``: the other run whose version it reused
    (``earlier_registration``), whose decision the champion alias reflects, not this run's."""
    model, version, promoted = name.format(reg.get("model_name")), reg.get("version"), reg.get("promoted")
    if by is None:
        return f"registered {model} v{version}, {'promoted to champion' if promoted else 'not promoted'}"
    return f"already registered: {model} v{version}, by run {by} (the same adapter), {'champion' if promoted else 'not champion'}"


def earlier_registration(record: dict[str, Any]) -> str | None:
    """The run that registered the version this run's registration reused, when that is another run
    (this run's adapter is byte-identical to that version's), else None: the version, its aliases and
    its promotion decision are that run's."""
    reg = record.get("registration") or {}
    by = reg.get("registered_by")
    return by if reg.get("created") is False and by and by != record.get("run_id") else None


def table_row(entry: dict[str, Any]) -> dict[str, Any]:
    """An evaluation as one flat table row: each ``eval.also`` benchmark becomes its own columns."""
    row = {k: v for k, v in entry.items() if k not in ("manifest", "also")}
    for o in entry.get("also") or []:
        row.update({f"{o['name']}_accuracy": o["accuracy"], f"{o['name']}_stderr": o.get("stderr")})
    return row


def publish(record: dict[str, Any]) -> None:
    """Prefect artifacts: a markdown summary and the evaluation table.

    Called from the flow's ``finally``: raising here would replace the run's own error, so a
    failure to publish is logged as a warning (the run record on disk holds the same facts); a lost
    Prefect server is not asked (each call would retry against it)."""
    from qerl.flows import orchestrator

    if not orchestrator.answers():
        log.warning(
            "Prefect artifacts for %s not published: the server does not answer", record.get("run_id")
        )
        return
    try:
        key = record["run_id"].lower().replace("_", "-").replace(".", "-")
        create_markdown_artifact(summary_markdown(record), key=f"{key}-summary", description="qerl run")
        if record.get("evaluations"):
            rows = [table_row(e) for e in record["evaluations"]]
            create_table_artifact(rows, key=f"{key}-evaluation", description="evaluations")
    except Exception as err:  # noqa: BLE001
        log.warning("could not publish Prefect artifacts for %s: %s", record.get("run_id"), err)
