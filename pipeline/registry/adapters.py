"""Registered adapters read back: a version or an alias of a registered model, fetched into the store.

The nightly warm start (the champion, or the version a resumed night started from) and ``qerl eval
--adapter models:/NAME@ALIAS`` read an adapter the registry holds. Both go through MLflow's artifact
layer (a local file store, ``mlflow-artifacts:`` behind a tracking server, cloud stores) into one store
stage keyed by (model name, version, source), so a version is downloaded once per work directory,
whoever asks first.

A registered version carries the lineage digest of the base it was trained on (tag ``base_digest``).
A caller that would serve it on another base gets an error naming both digests, not an adapter whose
shapes happen to fit a different model.

``qerl eval`` names versions with MLflow's model URIs, ``models:/NAME/VERSION`` and
``models:/NAME@ALIAS``. Reading creates nothing: a work directory without a registry is an error,
where the writers' ``tracking.open_tracking`` would create the database, experiment and model.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

import mlflow
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from qerl.pipeline.config import config_hash
from qerl.pipeline.registry import health
from qerl.pipeline.registry.lock import LOCK_SUFFIX, RegistryError, backend_kind
from qerl.pipeline.registry.tracking import RegistryConfig, resolve_uris
from qerl.pipeline.schemes import mode_scheme
from qerl.pipeline.store.artifact_store import ArtifactStore
from qerl.pipeline.store.code_version import code_version
from qerl.pipeline.store.layout import WARM_START_STAGE
from qerl.pipeline.store.manifest import BuildResult, Manifest

MODEL_URI_FORMS = "models:/NAME/VERSION or models:/NAME@ALIAS"
_MODEL_URI = re.compile(r"models:/(?P<name>[^/@]+)(?:/(?P<version>\d+)|@(?P<alias>[\w-]+))")


def parse_model_uri(uri: str) -> tuple[str, str | None, str | None]:
    """``(name, version, alias)`` of a model URI, exactly one of version and alias set; anything else
    (MLflow's deprecated stages, a run URI) is a ``ValueError`` naming the forms that are read."""
    match = _MODEL_URI.fullmatch(uri.strip())
    if match is None:
        raise ValueError(f"model URI {uri!r}: expected {MODEL_URI_FORMS}")
    return match["name"], match["version"], match["alias"]


def open_registry(cfg: RegistryConfig, work_dir: str | Path) -> str:
    """Point MLflow's process-wide URIs at the configured registry to read from it; returns the URI.
    A sqlite registry that does not exist yet, or a server that does not answer, is a
    ``RegistryError`` naming it: nothing is created."""
    uri, _ = resolve_uris(cfg, work_dir)
    if backend_kind(uri) == "sqlite":
        from sqlalchemy.engine import make_url

        if not Path(make_url(uri).database or "").is_file():
            raise RegistryError(
                f"no registry at {uri}: nothing has been registered in this work directory "
                "(--work-dir, or --set registry.tracking_uri=... for another registry)"
            )
    else:
        health.check_reachable(uri)
    health.bound_http_retries()
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    return uri


def registered_version(
    name: str, version: str | None = None, alias: str | None = None
) -> ModelVersion | None:
    """Version ``version`` of ``name``, or the one ``alias`` points at; None when there is no such
    version or alias (a registry that cannot be read raises)."""
    client = MlflowClient()
    try:
        if alias is not None:
            return client.get_model_version_by_alias(name, alias)
        return client.get_model_version(name, str(version))
    except MlflowException as err:
        if err.error_code == "RESOURCE_DOES_NOT_EXIST" or "not found" in str(err).lower():
            return None
        raise


def require_registered_model(name: str, registry: str) -> None:
    """A ``RegistryError`` naming ``registry`` and the models it holds unless ``name`` is one of them:
    a mistyped name would otherwise read as a model with no versions."""
    client = MlflowClient()
    try:
        client.get_registered_model(name)
        return
    except MlflowException as err:
        if err.error_code != "RESOURCE_DOES_NOT_EXIST" and "not found" not in str(err).lower():
            raise
    known = sorted(m.name for m in client.search_registered_models() if not m.name.endswith(LOCK_SUFFIX))
    raise RegistryError(
        f"no registered model {name!r} in {health.shown_uri(registry)} "
        f"(registered there: {', '.join(known) or 'none'})"
    )


def base_lineage_digest(quantized: Manifest) -> str:
    """The lineage digest of the model a quantize manifest was made from (the source's digest, which
    a run registers as ``base_digest``): one model quantized by two recipes has one lineage."""
    return str(quantized.extra.get("base_digest", quantized.inputs.get("base")))


def base_recipe(quantized: Manifest) -> str:
    """What the quantize stage computed a base with, as the lineage's ``quant_recipe`` names it:
    ``<scheme>[-<method>]-<hash>``, the hash over the stage's key config (targets, keep, dtype, the
    method's settings and, for GPTQ, the calibration source, settings and token digest). Library
    versions are not in it, and neither is qerl's code: the same recipe keeps its name across
    upgrades, and an RTN, MSE and GPTQ base of one model have three (``nvfp4-rtn-...``)."""
    scheme = mode_scheme(quantized.mode)
    label = f"nvfp4-{quantized.extra.get('method', 'rtn')}" if scheme == "nvfp4" else scheme
    return f"{label}-{config_hash(quantized.config)[:12]}"


def is_legacy_recipe(recipe: str) -> bool:
    """Whether ``recipe`` is an older qerl's ``quant_recipe``: a bare hash of the checkpoint's
    ``quantization_config``, which one NVFP4 method shares with every other."""
    return "-" not in recipe


def resolve_model_uri(uri: str, cfg: RegistryConfig, work_dir: str | Path) -> ModelVersion:
    """The version a model URI names in the configured registry (``open_registry``); a
    ``RegistryError`` naming the URI and the registry when there is none."""
    name, version, alias = parse_model_uri(uri)
    registry = open_registry(cfg, work_dir)
    try:
        require_registered_model(name, registry)
    except RegistryError as err:
        raise RegistryError(f"{uri}: {err}") from None
    found = registered_version(name, version, alias)
    if found is None:
        raise RegistryError(f"{uri}: no such registered version in {health.shown_uri(registry)}")
    return found


def check_base(version: ModelVersion, base_digest: str, this_base: str, hint: str) -> None:
    """A ``RegistryError`` unless ``version`` was trained on the base with lineage digest
    ``base_digest``; ``this_base`` names that base for people, ``hint`` says what to do instead."""
    trained_on = version.tags.get("base_digest")
    if trained_on != base_digest:
        raise RegistryError(
            f"{version.name} v{version.version} was trained on base {trained_on}, {this_base} is "
            f"{base_digest}: {hint}"
        )


def fetch_adapter(version: ModelVersion, store: ArtifactStore) -> tuple[Manifest, bool]:
    """``version``'s adapter as a store artifact whose folder ``adapter/`` holds it, and whether it was
    cached (the warm start's stage: one download per version and work directory)."""
    config = {"model_name": version.name, "version": str(version.version), "source": version.source}
    inputs = {"registered_adapter": str(version.tags.get("adapter_digest", "unknown"))}

    def build(tmp: Path) -> BuildResult:
        download_adapter(version, tmp / "adapter")
        return BuildResult(
            mode="mlflow-download", extra={"version": str(version.version), "adapter": "adapter"}
        )

    return store.produce(WARM_START_STAGE, config, inputs, code_version(sys.modules[__name__]), build)


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
