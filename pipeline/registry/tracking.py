"""The model registry: MLflow tracking (metrics, plots, artifacts) and adapter versions with aliases.

What: every run logs its per-step metrics, PNG curves and artifacts (adapter, its manifest, the
evaluation table) into an MLflow run; the adapter becomes a registered model version carrying its
lineage as tags (base model digest, quantization recipe, dataset digest, code version, Prefect flow
run id, the adapter's own digest and its evaluation). Aliases, not the deprecated stages, name the
roles: ``challenger`` is the newest complete version, ``champion`` the one serving.

Backend: a database or a tracking server, never the plain ``mlruns`` folder. ``tracking_uri=None``
is the embedded default, a sqlite file ``<work>/mlflow.db`` with artifacts under ``<work>/mlartifacts``;
any ``postgresql+psycopg://`` URI works the same (the experiment's artifact location is still set
explicitly, so artifacts never land in the caller's working directory). An MLflow tracking server
(``http[s]://host:port``, the usual team setup) is used through its REST API only; a new
experiment takes the server's artifact root (``mlflow-artifacts:/`` under ``--serve-artifacts``,
MLflow 3's default), so the adapter is uploaded through the server, not written to a local path.

Promotion rule: a version becomes champion only when its run is complete and its accuracy beats the
current champion's *on the same benchmark* by more than ``promote_margin`` (absolute). A champion
evaluated on another benchmark is not comparable, so the candidate is not promoted (``qerl promote``
is the way to change benchmarks). The decision and its reason are written as a version tag.

Race safety, and why a lock rather than compare-and-set: "read the champion, compare, set the
alias" is a read-modify-write; two runs finishing together could both read the old champion and
the loser could write last. MLflow has no conditional alias update, so a compare-and-set loop
(set, re-read, retry) can only detect a lost update after the fact and cannot order two writers
correctly by accuracy. We therefore serialise the whole decision (and version creation, so the
"same adapter digest already registered?" check is atomic too) under a lock that lives with the
database: an ``flock`` on ``<db>.lock`` next to a sqlite file, a session-level
``pg_advisory_lock`` on the same PostgreSQL database. Both are released by the kernel/server when
the holder dies, so a crashed run never wedges the registry. After setting an alias it is re-read
as a sanity check. Any other backend is refused with a clear error rather than run unprotected.

Through a tracking server there is no such lock; ``qerl.pipeline.registry.lock`` explains the ticket lock
used instead (a version-numbered lease on the server).

Departure from the paper: none (the paper has no registry); this is the product's MLOps layer.
State: ``open_tracking`` sets MLflow's process-wide tracking and registry URIs (as ``mlflow``
itself does); the other functions use them, so call it first.
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
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from pydantic import Field
from qerl.pipeline.config import StrictModel
from qerl.pipeline.registry.lock import (
    RegistryError,
    backend_kind,
    registry_lock,
)

log = logging.getLogger("qerl.registry")

LINEAGE_KEYS = ("base_digest", "quant_recipe", "dataset_digest", "code_version", "flow_run_id")
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
        default=0.0, ge=0.0, description="absolute accuracy the champion must be beaten by"
    )
    champion_alias: str = "champion"
    challenger_alias: str = "challenger"
    lock_timeout_s: float = Field(default=120.0, gt=0)


# ---- connection ----------------------------------------------------------------------------------
def resolve_uris(cfg: RegistryConfig, work_dir: str | Path) -> tuple[str, str | None]:
    """(tracking URI, artifact location) for ``cfg`` with the work-dir defaults filled in.

    With a tracking server the artifact location defaults to None: the server picks its own
    (``mlflow-artifacts:/...`` with ``--serve-artifacts``, MLflow 3's default), so uploads go
    through the server instead of to a path on this machine."""
    work = Path(work_dir).resolve()
    uri = cfg.tracking_uri or f"sqlite:///{work / 'mlflow.db'}"
    if backend_kind(uri) == "server":
        return uri, cfg.artifact_location
    artifacts = cfg.artifact_location or (work / "mlartifacts").as_uri()
    return uri, artifacts


def _is_local(location: str) -> bool:
    return location.startswith(("file:", "/")) or ":" not in location


def _uri() -> str:
    return mlflow.get_tracking_uri()


def open_tracking(cfg: RegistryConfig, work_dir: str | Path) -> MlflowClient:
    """Point MLflow at the configured database, create schema/experiment/model once, return a client.

    Schema creation runs under the registry lock: two processes opening a fresh sqlite file at the
    same time would otherwise both run MLflow's migrations and one would fail.
    """
    uri, artifacts = resolve_uris(cfg, work_dir)
    kind = backend_kind(uri)
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


# ---- runs, metrics, plots ------------------------------------------------------------------------
def start_run(cfg: RegistryConfig, run_name: str | None = None, tags: Mapping[str, Any] | None = None) -> str:
    """Create an MLflow run in the configured experiment; returns its id (no global active run)."""
    client = MlflowClient()
    experiment = client.get_experiment_by_name(cfg.experiment)
    if experiment is None:
        raise RegistryError(f"experiment '{cfg.experiment}' does not exist: call open_tracking first")
    run = client.create_run(
        experiment.experiment_id, run_name=run_name, tags={k: _tag(v) for k, v in (tags or {}).items()}
    )
    return run.info.run_id


def _tag(value: Any) -> str:
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
    MlflowClient().log_batch(run_id, tags=[RunTag(k, _tag(v)) for k, v in tags.items()])


# ---- model versions ------------------------------------------------------------------------------
def find_version(cfg: RegistryConfig, adapter_digest: str) -> ModelVersion | None:
    """The existing version of ``cfg.model_name`` registered for ``adapter_digest``, if any."""
    if not all(c.isalnum() or c in "-_:" for c in adapter_digest):
        raise RegistryError(f"adapter digest '{adapter_digest}' has characters a registry filter cannot hold")
    found = MlflowClient().search_model_versions(
        f"name = '{cfg.model_name}' and tags.adapter_digest = '{adapter_digest}'"
    )
    return min(found, key=lambda v: int(v.version)) if found else None


def register_adapter(
    cfg: RegistryConfig,
    run_id: str,
    adapter_dir: str | Path,
    manifest_path: str | Path | None,
    eval_summary: Mapping[str, Any],
    lineage: Mapping[str, Any],
    complete: bool = True,
) -> tuple[str, bool]:
    """Log the adapter (and its manifest) to ``run_id`` and register it; returns (version, created).

    Idempotent: a version already carrying ``lineage['adapter_digest']`` is returned as is
    (created=False) and nothing is logged again.
    """
    missing = [k for k in (*LINEAGE_KEYS, "adapter_digest") if k not in lineage]
    if missing:
        raise RegistryError(f"lineage for {cfg.model_name} lacks {missing} (has {sorted(lineage)})")
    adapter_dir = Path(adapter_dir)
    if not (adapter_dir / "adapter_config.json").is_file():
        raise RegistryError(f"{adapter_dir} is not a peft adapter folder (no adapter_config.json)")
    client = MlflowClient()
    with registry_lock(_uri(), cfg.model_name, cfg.lock_timeout_s):
        existing = find_version(cfg, str(lineage["adapter_digest"]))
        if existing is not None:
            log.info(
                "adapter %s is already %s v%s", lineage["adapter_digest"], cfg.model_name, existing.version
            )
            return str(existing.version), False
        client.log_artifacts(run_id, str(adapter_dir), artifact_path="adapter")
        if manifest_path is not None:
            client.log_artifact(run_id, str(manifest_path), artifact_path="adapter_manifest")
        tags = {k: _tag(v) for k, v in lineage.items() if not isinstance(v, dict | list)}
        tags.update(
            eval_benchmark=_tag(eval_summary.get("benchmark")),
            eval_accuracy=_tag(eval_summary.get("accuracy")),
            eval_k=_tag(eval_summary.get("k")),
            eval_n_items=_tag(eval_summary.get("n_items")),
            complete=str(bool(complete)).lower(),
        )
        source = f"{client.get_run(run_id).info.artifact_uri}/adapter"
        version = client.create_model_version(cfg.model_name, source=source, run_id=run_id, tags=tags)
    log.info("registered %s v%s from run %s", cfg.model_name, version.version, run_id)
    return str(version.version), True


def alias_version(cfg: RegistryConfig, alias: str) -> ModelVersion | None:
    try:
        return MlflowClient().get_model_version_by_alias(cfg.model_name, alias)
    except MlflowException as err:
        if err.error_code == "RESOURCE_DOES_NOT_EXIST" or "not found" in str(err).lower():
            return None
        raise


def _set_alias(cfg: RegistryConfig, alias: str, version: str) -> None:
    client = MlflowClient()
    client.set_registered_model_alias(cfg.model_name, alias, str(version))
    now = alias_version(cfg, alias)  # sanity re-read: we hold the lock, so this must be ours
    if now is None or str(now.version) != str(version):
        raise RegistryError(
            f"alias {cfg.model_name}@{alias} reads back {now and now.version}, expected {version}"
        )


def set_challenger(cfg: RegistryConfig, version: str) -> bool:
    """Point ``challenger`` at ``version`` unless a newer version already holds it."""
    with registry_lock(_uri(), cfg.model_name, cfg.lock_timeout_s):
        current = alias_version(cfg, cfg.challenger_alias)
        if current is not None and int(current.version) > int(version):
            return False
        _set_alias(cfg, cfg.challenger_alias, version)
    return True


def _accuracy(version: ModelVersion) -> float | None:
    try:
        value = float(version.tags.get("eval_accuracy", "nan"))
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def promotion_decision(
    cfg: RegistryConfig,
    champion: ModelVersion | None,
    version: str,
    benchmark: str,
    accuracy: float | None,
    complete: bool,
) -> tuple[bool, str]:
    """(promote?, reason) — the pure rule, given the current champion (None if there is none)."""
    if not complete:
        return False, "run incomplete or failed: never promoted"
    if accuracy is None or not math.isfinite(accuracy):
        return False, f"no finite accuracy on {benchmark}"
    if champion is None:
        return True, f"no champion yet; accuracy {accuracy:.4f} on {benchmark}"
    if str(champion.version) == str(version):
        return True, "already champion"
    champ_bench = champion.tags.get("eval_benchmark")
    champ_acc = _accuracy(champion)
    if champ_bench != benchmark:
        return (
            False,
            f"champion v{champion.version} was evaluated on {champ_bench}, not {benchmark}: not comparable",
        )
    if champ_acc is None:
        return True, f"champion v{champion.version} has no recorded accuracy"
    if accuracy > champ_acc + cfg.promote_margin:
        return (
            True,
            f"{accuracy:.4f} beats champion v{champion.version} {champ_acc:.4f} + margin {cfg.promote_margin}",
        )
    return (
        False,
        f"{accuracy:.4f} does not beat champion v{champion.version} {champ_acc:.4f} + margin {cfg.promote_margin}",
    )


def maybe_promote(
    cfg: RegistryConfig, version: str, benchmark: str, accuracy: float | None, complete: bool
) -> bool:
    """Make ``version`` champion if the rule says so (see the module docstring); race-safe."""
    client = MlflowClient()
    with registry_lock(_uri(), cfg.model_name, cfg.lock_timeout_s):
        champion = alias_version(cfg, cfg.champion_alias)
        promote_it, reason = promotion_decision(cfg, champion, version, benchmark, accuracy, complete)
        if promote_it and (champion is None or str(champion.version) != str(version)):
            _set_alias(cfg, cfg.champion_alias, version)
        client.set_model_version_tag(cfg.model_name, str(version), "promotion", reason[:5000])
    log.info("%s v%s: %s (%s)", cfg.model_name, version, "promoted" if promote_it else "not promoted", reason)
    return promote_it


def promote(cfg: RegistryConfig, name: str, version: str) -> None:
    """Manual promotion (``qerl promote NAME VERSION``): ``name`` v``version`` becomes champion."""
    cfg = cfg.model_copy(update={"model_name": name})
    client = MlflowClient()
    with registry_lock(_uri(), name, cfg.lock_timeout_s):
        try:
            client.get_model_version(name, str(version))
        except MlflowException:
            raise RegistryError(f"model version {name} v{version} does not exist") from None
        _set_alias(cfg, cfg.champion_alias, str(version))
        client.set_model_version_tag(name, str(version), "promotion", "manual promotion")
    log.info("%s v%s promoted to %s manually", name, version, cfg.champion_alias)


def version_info(cfg: RegistryConfig, version: str) -> dict[str, Any]:
    """A JSON-able view of a version: number, source, run, tags, aliases."""
    mv = MlflowClient().get_model_version(cfg.model_name, str(version))
    return {
        "name": mv.name,
        "version": str(mv.version),
        "source": mv.source,
        "run_id": mv.run_id,
        "tags": dict(mv.tags),
        "aliases": sorted(mv.aliases),
    }


def download_adapter(version: ModelVersion, dest: str | Path) -> Path:
    """Copy a registered version's adapter folder (its ``source``) to ``dest``; returns ``dest``.

    Goes through MLflow's artifact layer, so a local file store, ``mlflow-artifacts:`` behind a
    tracking server and cloud stores all work; the nightly warm start reads the champion this way."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        got = Path(mlflow.artifacts.download_artifacts(artifact_uri=version.source, dst_path=tmp))
        if not (got / "adapter_config.json").is_file():
            raise RegistryError(
                f"{version.name} v{version.version}: source {version.source} holds no peft adapter"
            )
        got.rename(dest)  # same filesystem: an atomic rename, dest appears complete or not at all
    return dest
