"""Which prompts each step uses: a seeded stream of slots, and the nightly cursor over it.

- **Which prompts a step uses** (``step_prompts``): a seeded pass over shuffled epochs; the position
  in that stream is a *slot* (one step's worth of prompts). A plain run uses slots 0..steps-1.
- **Nightly runs**: each scheduled night is a new run (the id carries the night's date) that takes
  the next slice of slots from a persistent cursor (``DataCursor``: ``<work>/cursors/<loop.name>.json``,
  flock + atomic writes), so no night replays what an earlier completed night used. The cursor moves
  only when a night completes; the slice is recorded in the night's run record, so resuming that night
  uses the same slice. When the slots run past the end of the data a new epoch begins with a fresh
  shuffle (problems repeat; the record and the log say so). The cursor is per stream (dataset digest,
  loop seed, prompts per step): changing the data starts a new stream at slot 0.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import fcntl
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qerl.pipeline.planning.errors import RunPlanError
from qerl.pipeline.store.files import atomic_write_json, read_json, sha256_json
from qerl.pipeline.store.layout import CURSOR_DIR


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
    """The next unused slot of each stream of one nightly line (``loop.name``), persistent in the work dir;
    on a fleet (``QERL_FLEET_DB`` set) a row per stream in the coordination database, shared by every
    machine (``qerl.pipeline.fleet.coordination.cursor_position``/``cursor_advance``, same answers)."""

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
                data = read_json(self.path) if self.path.is_file() else {}
                data.setdefault("streams", {})
                yield data
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    @staticmethod
    def _fleet() -> bool:
        from qerl.pipeline.fleet.settings import database_url

        return database_url() is not None

    def position(self, stream: str) -> int:
        if self._fleet():
            from qerl.pipeline.fleet.coordination import cursor_position

            return cursor_position(self.name, stream)
        with self._locked() as data:
            return int(data["streams"].get(stream, {}).get("next_slot", 0))

    def advance(self, stream: str, end_slot: int, run_id: str) -> int:
        """Move the stream's cursor to ``end_slot`` (never back: re-completing a night is a no-op)."""
        if self._fleet():
            from qerl.pipeline.fleet.coordination import cursor_advance

            return cursor_advance(self.name, stream, end_slot, run_id)
        with self._locked() as data:
            entry = data["streams"].setdefault(stream, {"next_slot": 0, "runs": []})
            if end_slot > int(entry["next_slot"]):
                entry["next_slot"] = end_slot
                entry["runs"] = [*entry.get("runs", []), run_id][-50:]
                entry["updated_at"] = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
                atomic_write_json(self.path, data)
            return int(entry["next_slot"])
