"""What a run trains on and starts from: prompts, the nightly data cursor, the warm start, retries.

The flow (``flows/rl.py``) only sequences tasks; the decisions it needs live here, importable and
testable without Prefect:

- **Which base the engine serves** (``needs_twin``): the dequantized twin is built when the rollout
  engine cannot serve NVFP4 itself: every CPU engine, and the transformers engine anywhere. An
  unquantized base (``quantize.scheme: none``) is served as is and has no twin.
- **Which prompts fit** (``fit_prompts``): a prompt whose rendered token count (the model's
  tokenizer, the rollout template) exceeds ``rollout.max_model_len - rollout.max_new_tokens`` is
  dropped when the data is loaded, and counted in the run record. Departure from "truncate": a cut
  math question is a different question with the same gold answer, so dropping is the honest choice.
  Before, one such prompt failed a whole step mid-run (then its retries, then the run).
- **Which prompts a step uses** (``step_prompts``): a seeded pass over shuffled epochs; the position
  in that stream is a *slot* (one step's worth of prompts). A plain run uses slots 0..steps-1.
- **Nightly runs**: each scheduled night is a new run (the id carries the night's date) that takes
  the next slice of slots from a persistent cursor (``DataCursor``: ``<work>/cursors/<loop.name>.json``,
  flock + atomic writes), so no night replays what an earlier completed night used. The cursor moves
  only when a night completes; the slice is recorded in the night's run record, so resuming that night
  uses the same slice. When the slots run past the end of the data a new epoch begins with a fresh
  shuffle (problems repeat; the record and the log say so). The cursor is per stream (dataset digest,
  loop seed, prompts per step): changing the data starts a new stream at slot 0.
- **Warm start** (``warm_start_adapter``): a night's step 0 starts from the registered champion's
  adapter weights (fresh optimizer), fetched through MLflow into the store (stage ``warm-start``),
  whose digest enters every downstream cache key. A champion trained on another base model or with
  another LoRA shape is an error, not a silent start from scratch.
- **What is worth retrying** (``is_transient``): a dead engine, a refused or dropped connection, a
  locked database. Config errors, engine misconfiguration and bad data fail at once.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import fcntl
import json
import logging
import random
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qerl.pipeline.data.prompts import render_prompt
from qerl.pipeline.rollout.engine import RolloutConfig, encode_prompt, engine_died
from qerl.pipeline.store.artifacts import (
    ArtifactStore,
    BuildResult,
    Manifest,
    atomic_write_json,
    code_version,
    sha256_json,
)

log = logging.getLogger("qerl.runplan")

WARM_START_STAGE = "warm-start"
CURSOR_DIR = "cursors"


class RunPlanError(ValueError):
    """A run cannot be planned as configured (no prompt fits, an unusable champion, a bad night)."""


# ---- engine base ---------------------------------------------------------------------------------
def needs_twin(rollout: RolloutConfig, scheme: str = "nvfp4") -> bool:
    """Whether the rollout engine serves the dequantized twin (see the module docstring)."""
    from qerl.pipeline.runtime import device

    if scheme == "none":
        return False
    return rollout.engine == "hf" or not device.cuda_available()


# ---- prompts -------------------------------------------------------------------------------------
@dataclass
class PromptFit:
    """The problems whose prompts fit the engine, and the ones dropped (id, prompt tokens)."""

    kept: list[Any]
    dropped: list[tuple[str, int]]
    limit: int

    def report(self) -> dict[str, Any]:
        return {
            "loaded": len(self.kept) + len(self.dropped),
            "kept": len(self.kept),
            "dropped_too_long": len(self.dropped),
            "prompt_token_limit": self.limit,
            "dropped_examples": [{"id": i, "tokens": n} for i, n in self.dropped[:5]],
        }


def prompt_token_limit(rollout: RolloutConfig) -> int:
    return rollout.max_model_len - rollout.max_new_tokens


def fit_prompts(problems: Sequence[Any], tokenizer: Any, template: str, limit: int) -> PromptFit:
    """Split ``problems`` by whether their rendered prompt has at most ``limit`` tokens."""
    kept, dropped = [], []
    for problem in problems:
        n = len(encode_prompt(tokenizer, render_prompt(tokenizer, problem["question"], template)))
        if n <= limit:
            kept.append(problem)
        else:
            dropped.append((str(problem["id"]), n))
    if dropped:
        log.warning(
            "%d of %d prompts are longer than %d tokens (rollout.max_model_len - rollout.max_new_tokens) "
            "and were dropped, e.g. %s",
            len(dropped), len(problems), limit, ", ".join(f"{i} ({n})" for i, n in dropped[:3]),
        )  # fmt: skip
    if not kept:
        raise RunPlanError(
            f"no prompt fits: all {len(problems)} rendered prompts are longer than {limit} tokens "
            "(rollout.max_model_len - rollout.max_new_tokens); raise rollout.max_model_len"
        )
    return PromptFit(kept, dropped, limit)


def load_tokenizer(model_dir: str | Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def slots_per_epoch(n_problems: int, per_step: int) -> int:
    return max(1, n_problems // per_step)


def step_prompts(problems: Sequence[Any], slot: int, n: int, seed: int) -> list[Any]:
    """The prompts of stream position ``slot``: a seeded pass over shuffled epochs, every problem in turn.

    An epoch holds ``len // n`` whole slots (the remainder sits out that epoch: a step never holds a
    problem twice), and each epoch is its own shuffle."""
    epoch, within = divmod(slot, slots_per_epoch(len(problems), n))
    order = list(range(len(problems)))
    random.Random(f"qerl-prompts-{seed}-{epoch}").shuffle(order)
    return [problems[i] for i in order[within * n : within * n + n]]


# ---- nightly runs --------------------------------------------------------------------------------
def parse_night(value: str | _dt.date | _dt.datetime) -> _dt.date:
    """The night a scheduled run belongs to: a date, a datetime (its UTC date) or ``YYYY-MM-DD``/``today``."""
    if isinstance(value, _dt.datetime):
        return (value.astimezone(_dt.UTC) if value.tzinfo else value).date()
    if isinstance(value, _dt.date):
        return value
    text = str(value).strip()
    if text == "today":
        return _dt.datetime.now(_dt.UTC).date()
    try:
        return parse_night(_dt.datetime.fromisoformat(text))
    except ValueError:
        raise RunPlanError(f"night {value!r} is not a date (YYYY-MM-DD) or 'today'") from None


def night_label(night: _dt.date) -> str:
    return night.strftime("%Y%m%d")


def stream_key(dataset_digest: str, seed: int, per_step: int) -> str:
    """Identity of a slot stream: the same data, shuffle seed and step size mean the same slots."""
    return sha256_json({"data": dataset_digest, "seed": seed, "per_step": per_step})[:16]


def data_slice(start: int, steps: int, n_problems: int, per_step: int) -> dict[str, Any]:
    """The slots ``start .. start+steps-1`` and the epochs they fall in (epoch > 0: problems repeat)."""
    per_epoch = slots_per_epoch(n_problems, per_step)
    epochs = sorted({slot // per_epoch for slot in range(start, start + steps)})
    return {"start_slot": start, "end_slot": start + steps, "slots_per_epoch": per_epoch, "epochs": epochs}


@dataclass
class DataCursor:
    """The next unused slot of each stream of one nightly line (``loop.name``), persistent in the work dir."""

    work: Path
    name: str
    path: Path = field(init=False)

    def __post_init__(self) -> None:
        self.path = Path(self.work) / CURSOR_DIR / f"{self.name}.json"

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict[str, Any]]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_suffix(".lock"), "a") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                data = json.loads(self.path.read_text()) if self.path.is_file() else {}
                data.setdefault("streams", {})
                yield data
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def position(self, stream: str) -> int:
        with self._locked() as data:
            return int(data["streams"].get(stream, {}).get("next_slot", 0))

    def advance(self, stream: str, end_slot: int, run_id: str) -> int:
        """Move the stream's cursor to ``end_slot`` (never back: re-completing a night is a no-op)."""
        with self._locked() as data:
            entry = data["streams"].setdefault(stream, {"next_slot": 0, "runs": []})
            if end_slot > int(entry["next_slot"]):
                entry["next_slot"] = end_slot
                entry["runs"] = [*entry.get("runs", []), run_id][-50:]
                entry["updated_at"] = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
                atomic_write_json(self.path, data)
            return int(entry["next_slot"])


# ---- warm start ----------------------------------------------------------------------------------
def warm_start_adapter(
    cfg: Any, work: Path, store: ArtifactStore, base_digest: str, version: str | None = None
) -> Manifest | None:
    """The champion's adapter (or registered ``version``'s: a resumed night keeps its own) as a store
    artifact whose folder ``adapter/`` holds it; None when there is no champion yet.

    ``cfg`` is the RunConfig; ``base_digest`` the lineage digest of this run's base model, which the
    adapter must have been trained on."""
    from qerl.pipeline.registry import tracking as registry

    uri, artifacts = registry.resolve_uris(cfg.registry, work)
    reg = cfg.registry.model_copy(update={"tracking_uri": uri, "artifact_location": artifacts})
    registry.open_tracking(reg, work)
    if version is None:
        champion = registry.alias_version(reg, reg.champion_alias)
        if champion is None:
            log.info(
                "warm start: %s has no @%s yet; starting from the base", reg.model_name, reg.champion_alias
            )
            return None
    else:
        champion = registry.MlflowClient().get_model_version(reg.model_name, str(version))
    what = f"{reg.model_name} v{champion.version}"
    if champion.tags.get("base_digest") != base_digest:
        raise RunPlanError(
            f"{what} was trained on base {champion.tags.get('base_digest')}, this run's base is {base_digest}: "
            "it cannot warm-start this run (set loop.warm_start: base, or promote a matching version)"
        )
    config = {"model_name": reg.model_name, "version": str(champion.version), "source": champion.source}
    inputs = {"registered_adapter": str(champion.tags.get("adapter_digest", "unknown"))}

    def build(tmp: Path) -> BuildResult:
        registry.download_adapter(champion, tmp / "adapter")
        return BuildResult(
            mode="mlflow-download", extra={"version": str(champion.version), "adapter": "adapter"}
        )

    manifest, cached = store.produce(
        WARM_START_STAGE, config, inputs, code_version(sys.modules[__name__]), build
    )
    from qerl.pipeline.rl.training import check_adapter_shape

    try:
        check_adapter_shape(manifest.dir / "adapter", cfg.train)
    except ValueError as err:
        raise RunPlanError(
            f"{what} cannot warm-start this run ({err}); set loop.warm_start: base, or match "
            "train.lora_r/lora_alpha/target_modules"
        ) from None
    log.info("warm start from %s (%s)%s", what, manifest.dir, " [cached]" if cached else "")
    return manifest


# ---- retries -------------------------------------------------------------------------------------
_TRANSIENT_ERRNOS = {errno.EAGAIN, errno.EBUSY, errno.EINTR, errno.ETIMEDOUT, errno.ECONNRESET, errno.EPIPE}
# httpx's (Prefect's and MLflow's client) network failures, matched by name: no import needed
_TRANSIENT_NAMES = {"TransportError", "TimeoutException"}


def _chain(err: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def is_transient(err: BaseException) -> bool:
    """Whether retrying the same task could succeed (see the module docstring); the cause chain counts."""
    if engine_died(err):  # LazyEngine has dropped it: the retry builds a fresh engine
        return True
    for exc in _chain(err):
        names = {cls.__name__ for cls in type(exc).__mro__}
        if names & _TRANSIENT_NAMES or isinstance(exc, ConnectionError | TimeoutError):
            return True
        if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
            return True
        if "database is locked" in str(exc).lower():  # sqlite under MLflow/Prefect: another writer
            return True
    return False
