"""A run's record, ``<work>/runs/<run_id>/run.json``: one typed model, read and written only here.

The flow writes it (after each phase and step, atomically); ``qerl runs``, ``qerl resume``,
retention (``qerl gc``), live metrics, ``qerl eval`` of a registered version and the ablation report
read it. ``RunRecord`` holds everything a run decides and measures: its config and night, the data
it kept and held out, the plan (data slice and warm start), the quantized base, each step's metrics
and artifact keys, each evaluation, the lift, the registration, and how the attempt ended.

Versions. ``record_version`` is written with every record (``RECORD_VERSION``). A record without one
was written by a qerl before the typed record (version 0); it loads through ``_migrate``, which is
also where a later format change maps an older record forward, so every record a qerl ever wrote
loads. A record of a newer format than this qerl knows is refused with a clear error rather than
half-read, and so is one whose content does not fit the model (the error names the file and field).

Metrics stay flat where other tools read them flat: a step entry carries its rollout, score and
train metrics as extra fields (``rollout_tokens_per_s``, ``reward_mean``, ``train_loss`` ...), as
MLflow logs them, and the quantize section its quality metrics (``quantize_kl`` ...). Every other
field is declared.
"""

from __future__ import annotations

import datetime as _dt
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from qerl.pipeline.store.files import atomic_write_json, read_json
from qerl.pipeline.store.layout import RUN_RECORD, RUNS_DIR, TRAIN_STAGE, recorded_run

RECORD_VERSION = 1


class RecordError(ValueError):
    """A run record that cannot be read: damaged, of a newer qerl, or not a run record."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class _Metrics(BaseModel):
    """A section whose declared fields come with flat metrics beside them (module docstring)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    @property
    def metrics(self) -> dict[str, Any]:
        return dict(self.__pydantic_extra__ or {})


class WarmStart(_Model):
    """Where a night's adapter started: the champion's version (and its adapter digest) or the base."""

    source: Literal["champion", "base"] = Field(alias="from")
    version: str | None = None
    digest: str | None = None


class Plan(_Model):
    """The data slice (slots of the prompt stream) and the warm start, decided once per run."""

    stream: str
    start_slot: int
    end_slot: int
    epochs: list[int]
    slots_per_epoch: int | None = None
    warm_start: WarmStart | None = None
    cursor_after: int | None = None  # the data cursor once the night completed


class HeldOut(_Model):
    n_items: int
    digest: str


class DataSection(_Model):
    """The training data as the prompt fit kept it, and the validation split held out of it."""

    loaded: int
    kept: int
    dropped_too_long: int = 0
    prompt_token_limit: int | None = None
    dropped_examples: list[dict[str, Any]] = Field(default_factory=list)
    dataset_digest: str
    validation: HeldOut | None = None


class QuantizeSection(_Metrics):
    """The quantized base: its manifest folder, mode and method, and what quantizing cost."""

    manifest: str
    mode: str | None = None
    method: str | None = None


class StepManifests(_Model):
    rollout: str | None = None
    score: str | None = None
    train: str = Field(alias=TRAIN_STAGE)


class Rekey(_Model):
    """A checkpoint rebuilt with other bytes (a GPU) replaced the recorded one."""

    source: str = Field(alias="from")
    to: str
    why: str


class StepEntry(_Metrics):
    """One RL step: sigma asked and realised, the flat metrics, the keys of its three artifacts."""

    step: int
    sigma: float | None = None
    aqn_sigma_realised: float | None = None
    manifests: StepManifests | None = None
    rekeyed: Rekey | None = None


class AlsoEntry(_Model):
    benchmark: str | None = None
    name: str
    accuracy: float
    stderr: float | None = None
    n_items: int | None = None


class ValidationResult(_Model):
    benchmark: str | None = None
    accuracy: float
    stderr: float | None = None


class Evaluation(_Model):
    """One evaluation: after which step, of which adapter (None: the base alone), on what, how well."""

    step: int
    adapter: str | None = None
    benchmark: str | None = None
    accuracy: float
    stderr: float | None = None
    n_items: int | None = None
    k: int | None = None
    dropped_too_long: int = 0
    also: list[AlsoEntry] = Field(default_factory=list)
    manifest: str | None = None
    validation: ValidationResult | None = None


class Lift(_Model):
    """The final adapter against the base on the test items, paired."""

    base: float
    final: float
    diff: float
    se: float
    n_items: int


class Registration(_Model):
    """The registered version, whether this run created it, and the promotion decision."""

    model_name: str | None = None
    version: str | int | None = None
    run_id: str | None = None  # the MLflow run
    registered_by: str | None = None  # the qerl run whose version it is (another's: the same adapter)
    created: bool | None = None
    promoted: bool | None = None
    promotion: str | None = None
    decided_on: str | None = None


class Ablation(_Model):
    """The ablation a run belongs to (never promoted)."""

    id: str
    arm: str
    replicate: int | None = None
    parent_run_id: str | None = None


class RunRecord(_Model):
    """``run.json`` (module docstring)."""

    record_version: int = RECORD_VERSION
    run_id: str
    status: Literal["running", "completed", "failed"] = "running"
    config: dict[str, Any] = Field(default_factory=dict)  # the RunConfig as JSON (planning.runs reads it)
    night: _dt.date | None = None
    ablation: Ablation | None = None
    flow_run_id: str | None = None
    code_version: str | None = None
    versions: dict[str, str] = Field(default_factory=dict)
    started_at: str | None = None
    updated_at: str | None = None
    error: str | None = None
    mlflow_run_id: str | None = None
    disk_estimate: dict[str, int] | None = None
    engine_mode: str | None = None
    data: DataSection | None = None
    plan: Plan | None = None
    quantize: QuantizeSection | None = None
    steps: list[StepEntry] = Field(default_factory=list)
    evaluations: list[Evaluation] = Field(default_factory=list)
    final_adapter: str | None = None
    final_accuracy: float | None = None
    baseline_accuracy: float | None = None
    lift: Lift | None = None
    registration: Registration | None = None

    # -- views -------------------------------------------------------------------------------------
    @property
    def loop(self) -> dict[str, Any]:
        """The config's ``loop`` section (empty for a record without one)."""
        return dict(self.config.get("loop") or {})

    @property
    def warm_start_version(self) -> str | None:
        warm = self.plan.warm_start if self.plan else None
        return warm.version if warm else None

    def train_keys(self, stage: str = TRAIN_STAGE) -> list[tuple[int, str]]:
        """(step, key of ``stage``) of every recorded step, in step order."""
        out = []
        for entry in self.steps:
            key = getattr(entry.manifests, "train" if stage == TRAIN_STAGE else stage, None)
            if key:
                out.append((entry.step, key))
        return sorted(out)

    def earlier_registration(self) -> str | None:
        """The run whose version this run's registration reused, when that is another run (this run's
        adapter is byte-identical to that version's), else None."""
        reg = self.registration
        if reg is None or reg.created is not False or not reg.registered_by:
            return None
        return reg.registered_by if reg.registered_by != self.run_id else None

    def history(self) -> list[dict[str, Any]]:
        """The steps as the registry logs them: each entry as recorded, less its artifact keys."""
        return [{k: v for k, v in _dump(e).items() if k != "manifests"} for e in self.steps]

    def to_json(self) -> dict[str, Any]:
        """The record as ``run.json`` holds it: what was set, by its on-disk names."""
        return {**_dump(self), "record_version": RECORD_VERSION}


def _dump(model: BaseModel) -> dict[str, Any]:
    """``model`` as JSON with what was set only, so an entry read from disk is written back as it
    was (the register stage's key hashes the step history)."""
    return model.model_dump(mode="json", by_alias=True, exclude_unset=True)


def run_dir(work: Path, run_id: str) -> Path:
    """``<work>/runs/<run_id>``: the run's record, lock and console log."""
    return work / RUNS_DIR / run_id


def _migrate(data: dict[str, Any], path: Path) -> dict[str, Any]:
    """A record of an older format in today's (module docstring): version 0 is the untyped dict
    every qerl before the typed record wrote, whose content this model declares as it was, less
    keys that were written empty."""
    version = data.get("record_version", 0)
    if not isinstance(version, int) or version > RECORD_VERSION:
        raise RecordError(
            f"{path}: record_version {version!r} is newer than this qerl reads ({RECORD_VERSION}): "
            "upgrade qerl to read it"
        )
    if version == 0:
        data = {k: v for k, v in data.items() if v is not None or k in ("night", "ablation")}
        data.setdefault("run_id", path.parent.name)
        data["record_version"] = RECORD_VERSION
    return data


def parse_record(data: Any, path: Path) -> RunRecord:
    """``data`` (a run.json's JSON) as a record; a RecordError naming ``path`` and the field."""
    if not isinstance(data, dict):
        raise RecordError(f"{path}: not a run record (a JSON object is expected)")
    try:
        return RunRecord.model_validate(_migrate(dict(data), path))
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "record"
        raise RecordError(f"{path}: not a valid run record ({where}: {first['msg']})") from None


def read_record(path: Path) -> RunRecord:
    """The record at ``path``; a RecordError when it cannot be read as one."""
    try:
        data = read_json(path)
    except ValueError as err:
        raise RecordError(str(err)) from None
    return parse_record(data, path)


def load_record(work: Path, run_id: str) -> RunRecord:
    """Run ``run_id``'s record; a missing run names the runs there are (``layout.recorded_run``)."""
    return read_record(recorded_run(work, run_id))


def previous_record(work: Path, run_id: str) -> RunRecord | None:
    """The record an earlier attempt at ``run_id`` left, if any."""
    path = run_dir(work, run_id) / RUN_RECORD
    return read_record(path) if path.is_file() else None


def save_record(work: Path, record: RunRecord) -> None:
    """Write ``run.json`` atomically, stamped with ``updated_at``."""
    record.updated_at = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    atomic_write_json(run_dir(work, record.run_id) / RUN_RECORD, record.to_json())


def read_records(work: Path) -> tuple[list[RunRecord], list[tuple[Path, str]]]:
    """Every run record under ``work``, and (path, why) for each that cannot be read."""
    records, unreadable = [], []
    for path in sorted((work / RUNS_DIR).glob(f"*/{RUN_RECORD}")):
        try:
            records.append(read_record(path))
        except RecordError as err:
            unreadable.append((path, str(err)))
    return records, unreadable
