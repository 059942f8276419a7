"""The protocol a registered adapter was evaluated under, kept with its MLflow run.

``qerl eval --adapter models:/...`` evaluates a version under the eval, reward and quantize sections
of the run that registered it, so that its figure compares with the registered one. The run's record
(``<work>/runs/<run_id>/run.json``) holds them, but only in the work dir that ran it: a registry read
from another machine (a shared tracking server, a copied ``mlflow.db``) has no record to follow. So
the registration also logs those three sections, with the data and rollout sections a GPTQ base was
calibrated from, as ``protocol.json`` on the version's MLflow run, where every reader of the
registry finds them (``qerl.pipeline.planning.registered`` reads them back). Versions registered before this file existed have
none; ``qerl eval`` then says that the defaults apply.

The file is JSON, parsed and validated by the caller against the installed config models: nothing
in it is executed.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mlflow.tracking import MlflowClient

PROTOCOL_FILE = "protocol.json"
# eval, reward and quantize: the protocol; data and rollout (its template): what GPTQ calibrated on
SECTIONS = ("eval", "reward", "quantize", "data", "rollout")


def protocol_of(config: Mapping[str, Any], run_id: str) -> dict[str, Any]:
    """The protocol record of a run: its id and its ``SECTIONS`` (JSON-ready; those it has)."""
    return {"run_id": run_id, **{name: config[name] for name in SECTIONS if name in config}}


def log_protocol(mlflow_run_id: str, protocol: Mapping[str, Any]) -> None:
    """Log ``protocol`` as ``protocol.json`` at the root of the MLflow run's artifacts."""
    with tempfile.TemporaryDirectory(prefix="qerl-protocol-") as tmp:
        path = Path(tmp) / PROTOCOL_FILE
        path.write_text(json.dumps(protocol, indent=1, sort_keys=True) + "\n")
        MlflowClient().log_artifact(mlflow_run_id, str(path))


def read_protocol(version: Any) -> dict[str, Any] | None:
    """The ``protocol.json`` of the MLflow run that registered ``version``; None when that run has
    none (registered by an older qerl, or by hand). A file that is not a JSON object raises
    ``ValueError`` naming the run."""
    run_id = getattr(version, "run_id", None)
    if not run_id:
        return None
    client = MlflowClient()
    if PROTOCOL_FILE not in {f.path for f in client.list_artifacts(run_id) if not f.is_dir}:
        return None
    with tempfile.TemporaryDirectory(prefix="qerl-protocol-") as tmp:
        text = Path(client.download_artifacts(run_id, PROTOCOL_FILE, tmp)).read_text()
    try:
        data = json.loads(text)
    except ValueError as err:
        raise ValueError(f"MLflow run {run_id}'s {PROTOCOL_FILE} is not JSON ({err})") from err
    if not isinstance(data, dict):
        raise ValueError(f"MLflow run {run_id}'s {PROTOCOL_FILE} is not a JSON object")
    return data
