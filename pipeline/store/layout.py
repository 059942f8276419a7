"""Names on disk: every folder, file and stage name that more than one module reads or writes.

The work directory (``default_work_dir``)::

    store/                      the artifact store (``ArtifactStore``), laid out as below
    runs/<id>/run.json          a run's record: written by the flow, read by ``qerl gc`` and resume
    ablations/<id>/             an ablation's record ablation.json, its report.md and plots/
    cursors/<name>.json         the data cursor of a nightly prompt stream
    mlflow.db, mlartifacts/     the embedded MLflow backend (the registry's default)

The store root::

    objects/<stage>/<key>/      finished outputs, manifest.json inside (the completion marker)
    tmp/<stage>-<key>-<nonce>/  work in progress; renamed into objects/ when complete
    locks/<stage>-<key>.lock    flock held while a key is being produced (or pruned)
    trash/                      corrupt artifacts moved aside, files on their way to deletion
    builds.jsonl, gc.jsonl      audit logs: one line per build; one per retention prune or heal
    digests.json                memo of source-directory digests keyed by (path, size, mtime)

Stage names are here when a module other than the stage reads that stage's artifacts (retention
reads train and register outputs). This module imports nothing of the project.
"""

from __future__ import annotations

import os
from pathlib import Path

# ---- the work directory --------------------------------------------------------------------------
STORE_DIR = "store"
RUNS_DIR = "runs"
RUN_RECORD = "run.json"
ABLATION_DIR = "ablations"
ABLATION_RECORD = "ablation.json"
CURSOR_DIR = "cursors"
MLFLOW_DB = "mlflow.db"
MLFLOW_ARTIFACTS_DIR = "mlartifacts"

# ---- the store root ------------------------------------------------------------------------------
OBJECTS_DIR = "objects"
TMP_DIR = "tmp"
LOCKS_DIR = "locks"
TRASH_DIR = "trash"
MANIFEST = "manifest.json"
BUILDS_LOG = "builds.jsonl"
GC_LOG = "gc.jsonl"
DIGESTS_MEMO = "digests.json"

# ---- stages and files read across modules ---------------------------------------------------------
QUANTIZE_STAGE = "quantize"
TRAIN_STAGE = "train"
REGISTER_STAGE = "register"
WARM_START_STAGE = "warm-start"
OPTIMIZER_FILE = "optimizer.safetensors"  # a train step's AdamW state (qerl.pipeline.rl.checkpoint)


def recorded_run(work: Path, run_id: str) -> Path:
    """The ``run.json`` of run ``run_id`` under ``work``; a ``FileNotFoundError`` naming the runs
    there are when it has none (checked before anything is created under ``work``)."""
    path = work / RUNS_DIR / run_id / RUN_RECORD
    if not path.is_file():
        runs = work / RUNS_DIR
        known = sorted(p.name for p in runs.glob("*")) if runs.is_dir() else []
        raise FileNotFoundError(f"no run '{run_id}' under {runs} (known runs: {known or 'none'})")
    return path


def default_work_dir(work_dir: str | Path | None = None) -> Path:
    """The one work directory (store, run records, MLflow db): argument, $QERL_WORK_DIR, ./qerl-work;
    a ``ValueError`` when that path is a file."""
    path = Path(work_dir or os.environ.get("QERL_WORK_DIR") or "qerl-work").resolve()
    if path.exists() and not path.is_dir():
        raise ValueError(f"work directory {path} is not a directory (--work-dir or $QERL_WORK_DIR)")
    return path
