"""MLflow tracking: the connection, and each run's metrics, params, plots and artifacts.

What: every run logs its per-step metrics, PNG curves and artifacts (adapter, its manifest, the
evaluation table) into an MLflow run; ``qerl.pipeline.registry.promotion`` turns the adapter into a
registered model version and moves the aliases.

Backend: a database or a tracking server, never the plain ``mlruns`` folder. ``tracking_uri=None``
is the embedded default, a sqlite file ``<work>/mlflow.db`` with artifacts under ``<work>/mlartifacts``;
any ``postgresql+psycopg://`` URI works the same (the experiment's artifact location is still set
explicitly, so artifacts never land in the caller's working directory). An MLflow tracking server
(``http[s]://host:port``, the usual team setup) is used through its REST API only; a new
experiment takes the server's artifact root (``mlflow-artifacts:/`` under ``--serve-artifacts``,
MLflow 3's default), so the adapter is uploaded through the server, not written to a local path.

State: ``connect`` (resolve the URIs, then ``open_tracking``) sets MLflow's process-wide tracking and
registry URIs (as ``mlflow`` itself does); every other function here and in ``promotion`` uses them,
so a caller connects first. Departure from the paper: none (the paper has no tracking); this is the
product's MLOps layer.
"""

from __future__ import annotations

import logging
import math
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import mlflow
from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from pydantic import Field
from qerl.pipeline.config import StrictModel, resource_field
from qerl.pipeline.registry import health
from qerl.pipeline.registry.lock import RegistryError, backend_kind, registry_lock
from qerl.pipeline.store.layout import MLFLOW_ARTIFACTS_DIR, MLFLOW_DB

log = logging.getLogger("qerl.registry")

# history key candidates per plotted curve, first match wins (train metrics use the first names)
PLOTS: dict[str, tuple[str, ...]] = {
    "reward": ("reward_mean", "reward/mean", "reward"),
    "accuracy": ("accuracy", "eval_accuracy", "train_accuracy"),
    "entropy": ("entropy", "entropy_mean", "train_entropy"),
    "sigma": ("sigma", "aqn_sigma"),
}


class RegistryConfig(StrictModel):
    tracking_uri: str | None = Field(
        default=None, description="MLflow backend URI; None = sqlite file <work>/mlflow.db"
    )
    artifact_location: str | None = Field(
        default=None, description="experiment artifact root; None = <work>/mlartifacts"
    )
    experiment: str = "qerl"
    model_name: str = "qerl-adapter"
    promote_margin: float = Field(
        default=0.0,
        ge=0.0,
        description="absolute accuracy the champion must be beaten by: a new registered model's policy (qerl policy changes it)",
    )
    promote_margin_se: float = Field(
        default=2.0,
        ge=0.0,
        description="standard errors of the paired per-item difference the champion must be beaten by: a new registered model's policy (qerl policy changes it)",
    )
    champion_alias: str = "champion"
    challenger_alias: str = "challenger"
    lock_timeout_s: float = resource_field(default=120.0, gt=0, description="wait for the registry lock")


# ---- connection ----------------------------------------------------------------------------------
def resolve_uris(cfg: RegistryConfig, work_dir: str | Path) -> tuple[str, str | None]:
    """(tracking URI, artifact location) for ``cfg`` with the work-dir defaults filled in.

    With a tracking server the artifact location defaults to None: the server picks its own
    (``mlflow-artifacts:/...`` with ``--serve-artifacts``, MLflow 3's default), so uploads go
    through the server instead of to a path on this machine."""
    work = Path(work_dir).resolve()
    uri = cfg.tracking_uri or f"sqlite:///{work / MLFLOW_DB}"
    if backend_kind(uri) == "server":
        return uri, cfg.artifact_location
    artifacts = cfg.artifact_location or (work / MLFLOW_ARTIFACTS_DIR).as_uri()
    return uri, artifacts


def _is_local(location: str) -> bool:
    return location.startswith(("file:", "/")) or ":" not in location


def open_tracking(cfg: RegistryConfig, work_dir: str | Path) -> MlflowClient:
    """Point MLflow at the configured database, create schema/experiment/model once, return a client.

    Schema creation runs under the registry lock: two processes opening a fresh sqlite file at the
    same time would otherwise both run MLflow's migrations and one would fail.
    """
    uri, artifacts = resolve_uris(cfg, work_dir)
    kind = backend_kind(uri)
    health.bound_http_retries()  # a dead server costs seconds, not MLflow's 4 minutes of retries
    if kind == "sqlite":
        from sqlalchemy.engine import make_url

        Path(make_url(uri).database or ".").parent.mkdir(parents=True, exist_ok=True)
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    with registry_lock(uri, cfg.model_name, cfg.lock_timeout_s):
        experiment = client.get_experiment_by_name(cfg.experiment)
        if experiment is None:
            client.create_experiment(cfg.experiment, artifact_location=artifacts)
        elif kind == "server" and _is_local(experiment.artifact_location):
            log.warning(
                "experiment '%s' on %s stores artifacts at %s, a path this client writes directly, not "
                "through the server; set registry.artifact_location or use a new experiment to upload "
                "through the server",
                cfg.experiment,
                uri,
                experiment.artifact_location,
            )
        try:
            client.get_registered_model(cfg.model_name)
        except MlflowException:
            client.create_registered_model(cfg.model_name, description="QeRL LoRA adapters (NVFP4 base)")
    log.info("MLflow tracking at %s (%s backend), experiment '%s'", uri, kind, cfg.experiment)
    return client


def check_reachable(cfg: RegistryConfig, work_dir: str | Path, timeout_s: float = 10.0) -> None:
    """Before a run's first stage: the registry answers, in one bounded attempt, else a
    ``RegistryError`` naming the URI (``qerl.pipeline.registry.health``)."""
    health.check_reachable(resolve_uris(cfg, work_dir)[0], timeout_s)


def resolve_config(cfg: RegistryConfig, work_dir: str | Path) -> RegistryConfig:
    """``cfg`` with the tracking URI and artifact location of ``resolve_uris`` filled in: what a
    caller passes on, and what the register stage's cache key covers."""
    uri, artifacts = resolve_uris(cfg, work_dir)
    return cfg.model_copy(update={"tracking_uri": uri, "artifact_location": artifacts})


def connect(cfg: RegistryConfig, work_dir: str | Path) -> RegistryConfig:
    """The MLflow setup every caller needs: ``resolve_config`` then ``open_tracking``; returns the
    resolved config (the functions here and in ``promotion`` then use MLflow's process-wide URIs)."""
    resolved = resolve_config(cfg, work_dir)
    open_tracking(resolved, work_dir)
    return resolved


# ---- runs, metrics, plots ------------------------------------------------------------------------
def start_run(cfg: RegistryConfig, run_name: str | None = None, tags: Mapping[str, Any] | None = None) -> str:
    """Create an MLflow run in the configured experiment; returns its id (no global active run)."""
    client = MlflowClient()
    experiment = client.get_experiment_by_name(cfg.experiment)
    if experiment is None:
        raise RegistryError(f"experiment '{cfg.experiment}' does not exist: call open_tracking first")
    run = client.create_run(
        experiment.experiment_id, run_name=run_name, tags={k: tag_value(v) for k, v in (tags or {}).items()}
    )
    return run.info.run_id


def tag_value(value: Any) -> str:
    return "none" if value is None else str(value)


def _numeric(metrics: Mapping[str, Any]) -> dict[str, float]:
    out = {}
    for key, value in metrics.items():
        if isinstance(value, bool):
            out[key] = float(value)
        elif isinstance(value, int | float):
            out[key] = float(value)
        # strings (modes, paths) and nested values are not metrics; they belong in tags/artifacts
    return out


def log_step_metrics(run_id: str, step: int, metrics: Mapping[str, Any]) -> int:
    """Log the numeric entries of ``metrics`` at ``step``; returns how many were logged."""
    now = int(time.time() * 1000)
    batch = [Metric(key, value, now, int(step)) for key, value in _numeric(metrics).items()]
    for start in range(0, len(batch), 1000):  # MLflow's per-call metric limit
        MlflowClient().log_batch(run_id, metrics=batch[start : start + 1000])
    return len(batch)


def log_history(run_id: str, history: Sequence[Mapping[str, Any]]) -> int:
    """Log a whole per-step history (each entry's ``step``, else its index); returns metric count."""
    return sum(log_step_metrics(run_id, int(e.get("step", i)), e) for i, e in enumerate(history))


def curve(
    history: Sequence[Mapping[str, Any]], candidates: Sequence[str]
) -> tuple[str, list[tuple[int, float]]]:
    """The first key of ``candidates`` present in ``history`` and its finite (step, value) points."""
    for key in candidates:
        points = [
            (int(e.get("step", i)), float(e[key]))
            for i, e in enumerate(history)
            if isinstance(e.get(key), int | float) and math.isfinite(float(e[key]))
        ]
        if points:
            return key, points
    return "", []


def write_plots(history: Sequence[Mapping[str, Any]], out_dir: str | Path) -> list[Path]:
    """PNG curves (reward, accuracy, entropy, sigma) for the metrics present; returns the files."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    # Figure + Agg canvas directly, not pyplot: no global state, safe in Prefect's worker threads.
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, candidates in PLOTS.items():
        key, points = curve(history, candidates)
        if not points:
            log.info("no '%s' values in the history (looked for %s): no %s plot", name, candidates, name)
            continue
        fig = Figure(figsize=(6, 3.5), dpi=100)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o" if len(points) < 30 else None)
        if name == "sigma":  # what the rollout engine realised, beside the schedule's sigma
            _, realised = curve(history, ("aqn_sigma_realised",))
            if realised:
                ax.plot([p[0] for p in realised], [p[1] for p in realised], "x--")
                ax.legend([key, "realised"])
        ax.set_xlabel("step")
        ax.set_ylabel(key)
        ax.set_title(name)
        ax.grid(alpha=0.3)
        if name == "sigma" and any(p[1] > 0 for p in points):
            ax.set_yscale("symlog", linthresh=1e-5)  # the AQN schedule decays geometrically
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path)
        written.append(path)
    return written


def log_plots(run_id: str, history: Sequence[Mapping[str, Any]]) -> list[str]:
    """Write the curves as PNGs and log them under ``plots/``; returns the plot names."""
    with tempfile.TemporaryDirectory(prefix="qerl-plots-") as tmp:
        files = write_plots(history, tmp)
        if files:
            MlflowClient().log_artifacts(run_id, tmp, artifact_path="plots")
    return [f.stem for f in files]


def log_params(run_id: str, params: Mapping[str, Any]) -> None:
    """Log flat params (values truncated to MLflow's 6000-char limit), in batches of 100."""
    items = [Param(str(k), str(v)[:6000]) for k, v in params.items()]
    for start in range(0, len(items), 100):
        MlflowClient().log_batch(run_id, params=items[start : start + 100])


def set_run_tags(run_id: str, tags: Mapping[str, Any]) -> None:
    MlflowClient().log_batch(run_id, tags=[RunTag(k, tag_value(v)) for k, v in tags.items()])
