"""Math problems for training and evaluation: named benchmarks, local files, and a procedural default.

What: ``load_problems(cfg, split)`` returns ``Problem`` records (id, question, answer, source, level)
from one of

* ``arithmetic`` - the embedded default: seeded procedural word problems at five difficulty levels
  with exact integer or fraction answers (``qerl.pipeline.data.arithmetic``).
* a named benchmark (``NAMED``): ``gsm8k`` (question / worked answer ending in ``#### N``),
  ``math500`` (problem / answer / level), ``aime24`` and ``amc23`` (Qwen2.5-Math's evaluation
  layout: id, problem or question, answer - AMC's answers are JSON numbers such as ``27.0``),
  ``bigmath`` (prompt / solution; the level is the hub config, levels 3-5 by default as in the
  QeRL recipe), and the hub's ``aime``/``amc`` sets. With a data directory configured
  (``data.root`` or ``$QERL_DATA_DIR``) a name reads ``<root>/<name>/<split>.jsonl`` (or
  ``.parquet``), the files as their publishers ship them; otherwise ``datasets.load_dataset``
  fetches it from the hub. A configured directory without the file is an error, not a hub fallback;
* a local ``.parquet`` or ``.jsonl`` file in one of those layouts (detected from the columns, or
  named with ``local_format``).

Gold answers are kept as published: GSM8K's text after ``####`` (``1,600`` stays ``1,600``), a
number's JSON text (``27.0``). Deciding that ``27`` matches ``27.0`` is math-verify's job in the
scorer, not a rewrite here that could drift from the source.

A row without a question or gold answer is an error naming its index and source, or with
``on_bad_row="skip"`` is skipped, counted in the report and logged - never dropped silently.
"""

from __future__ import annotations

import json
import logging
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator
from qerl.pipeline.config import StrictModel
from qerl.pipeline.data.arithmetic import arithmetic_problems
from qerl.pipeline.data.jsonl import read_jsonl
from qerl.pipeline.data.prompts import TEMPLATES, Problem
from qerl.pipeline.store.files import sha256_json

log = logging.getLogger("qerl.data")


@dataclass(frozen=True)
class Named:
    """A dataset known by name: its hub repository and the layout of its rows."""

    repo: str
    config: str | None
    layout: str
    hub_splits: dict[str, str] = field(default_factory=dict)  # our split name -> the hub's, where they differ


NAMED: dict[str, Named] = {
    "gsm8k": Named("openai/gsm8k", "main", "gsm8k"),
    "math500": Named("HuggingFaceH4/MATH-500", None, "math500"),
    # the 30 AIME 2024 problems; the hub ships them as a "train" split
    "aime24": Named("HuggingFaceH4/aime_2024", None, "qwen-eval", {"test": "train"}),
    "amc23": Named("math-ai/amc23", None, "qwen-eval"),
    "bigmath": Named("open-r1/Big-Math-RL-Verified-Processed", None, "bigmath"),  # config from the levels
    # the hub's own AIME/AMC sets, other than aime24/amc23 (AMC 22-23 has 83 problems), split as the hub's
    "aime": Named("HuggingFaceH4/aime_2024", None, "math500"),
    "amc": Named("AI-MO/aimo-validation-amc", None, "math500"),
}
HUB: dict[str, tuple[str, str | None]] = {name: (n.repo, n.config) for name, n in NAMED.items()}
# per layout: (question columns, first present wins; answer column)
COLUMNS: dict[str, tuple[tuple[str, ...], str]] = {
    "gsm8k": (("question",), "answer"),
    "math500": (("problem",), "answer"),
    "bigmath": (("prompt",), "solution"),
    "qwen-eval": (("problem", "question"), "answer"),
}
LAYOUTS = tuple(COLUMNS)
SPLIT_NAMES = ("train", "test", "validation", "valid", "dev")
DATA_DIR_ENV = "QERL_DATA_DIR"

BIGMATH_CONFIGS = {
    "level_1",
    "level_2",
    "level_3",
    "level_4",
    "level_5",
    "level_2_3_4_5",
    "level_3_4_5",
    "level_4_5",
}


class DataConfig(StrictModel):
    """Which problems a run trains or evaluates on."""

    dataset: str = Field(
        "arithmetic",
        description="arithmetic|gsm8k|math500|aime24|amc23|bigmath|aime|amc or a .parquet/.jsonl path",
    )
    split: str = "train"
    root: str | None = Field(
        None,
        description="data directory with <name>/<split>.jsonl copies of named benchmarks "
        "(None: $QERL_DATA_DIR if set, else the hub)",
    )
    limit: int | None = Field(None, ge=1)
    shuffle: bool = False
    seed: int = 0
    levels: list[int] | None = Field(None, description="difficulty levels to keep (None: dataset default)")
    template: str = "terse"
    on_bad_row: Literal["error", "skip"] = "error"
    local_format: Literal["auto", "gsm8k", "math500", "bigmath", "qwen-eval", "aime", "amc"] = "auto"
    arithmetic_size: int = Field(
        256, ge=1, description="problems generated per split (level 1 alone has ~480 train, ~120 test)"
    )

    @field_validator("template")
    @classmethod
    def _known_template(cls, value: str) -> str:
        if value not in TEMPLATES:
            raise ValueError(f"unknown prompt template '{value}'; valid: {', '.join(sorted(TEMPLATES))}")
        return value

    @field_validator("dataset")
    @classmethod
    def _known_dataset(cls, value: str) -> str:
        if value != "arithmetic" and value not in NAMED and not value.endswith((".parquet", ".jsonl")):
            raise ValueError(
                f"unknown dataset '{value}'; use arithmetic, {', '.join(NAMED)} or a .parquet/.jsonl file path"
            )
        return value


# --------------------------------------------------------------------------------------------------
# named benchmarks, hub datasets and local files


def read_rows(path: Path) -> list[dict[str, Any]]:
    """A dataset file's rows: JSON lines, or a parquet table (by its suffix)."""
    if not path.is_file():
        raise FileNotFoundError(f"dataset file not found: {path}")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    return [row for _, row in read_jsonl(path)]


def _detect_layout(rows: list[dict[str, Any]], source: str) -> str:
    """The layout of a file's rows. GSM8K and Qwen's evaluation files both have question/answer:
    a worked answer with a ``####`` line is GSM8K's, a bare final answer Qwen's."""
    columns = set().union(*(r.keys() for r in rows)) if rows else set()
    if {"prompt", "solution"} <= columns:
        return "bigmath"
    if "answer" in columns and "question" in columns:
        if any(isinstance(r.get("answer"), str) and "####" in r["answer"] for r in rows):
            return "gsm8k"
        return "qwen-eval"
    if {"problem", "answer"} <= columns:
        return "math500"
    raise ValueError(
        f"{source}: cannot tell the dataset layout from columns {sorted(columns)}; expected question/answer "
        "with '#### N' (gsm8k), problem/answer (math500), id + problem or question + final answer "
        "(qwen-eval: aime24, amc23) or prompt/solution (bigmath)"
    )


def _bigmath_config(levels: list[int]) -> str:
    name = "level_" + "_".join(str(v) for v in sorted(set(levels)))
    if name not in BIGMATH_CONFIGS:
        raise ValueError(f"Big-Math has no config for levels {levels}; published: {sorted(BIGMATH_CONFIGS)}")
    return name


def _load_hub(name: str, split: str, levels: list[int] | None) -> tuple[list[dict[str, Any]], str]:
    named = NAMED[name]
    repo, config = named.repo, named.config
    hub_split = named.hub_splits.get(split, split)
    if name == "bigmath":
        config = _bigmath_config(levels or [3, 4, 5])
    try:
        import datasets

        ds = datasets.load_dataset(repo, config, split=hub_split)
    except Exception as err:
        qcols, acol = COLUMNS[named.layout]
        raise RuntimeError(
            f"could not load {repo}{f' ({config})' if config else ''} split '{hub_split}' from the Hugging "
            f"Face hub ({type(err).__name__}: {str(err)[:200]}). Offline? Download it elsewhere and either "
            f"set ${DATA_DIR_ENV} (or this dataset's root: data.root, eval.benchmark.root, benchmark.root "
            f"in qerl eval) to a directory holding {name}/{split}.jsonl, or name a local file as the "
            f"dataset (/path/{name}.parquet or .jsonl, columns {'|'.join(qcols)}/{acol})"
        ) from err
    rows = [dict(r) for r in ds]
    if name == "bigmath":
        level = config.removeprefix("level_")
        for row in rows:  # the hub's level is the config, not a column
            row.setdefault("level", int(level) if level.isdigit() else None)
    return rows, f"{repo}:{config or 'default'}:{hub_split}"


def data_root(cfg: DataConfig) -> Path | None:
    """The configured data directory: ``cfg.root``, else ``$QERL_DATA_DIR``, else None (the hub)."""
    root = cfg.root or os.environ.get(DATA_DIR_ENV) or None
    return Path(root).expanduser() if root else None


def local_copy(root: Path, name: str, split: str) -> Path:
    """``<root>/<name>/<split>.jsonl`` (or ``.parquet``); a clear error when neither is there."""
    candidates = [root / name / f"{split}{ext}" for ext in (".jsonl", ".parquet")]
    for path in candidates:
        if path.is_file():
            return path
    have = sorted(p.name for p in (root / name).iterdir()) if (root / name).is_dir() else []
    raise FileNotFoundError(
        f"data directory {root} (data.root or ${DATA_DIR_ENV}) has no {name}/{split}.jsonl or .parquet "
        f"({f'{name}/ holds {have}' if have else f'no {name}/ folder'}); put the publisher's file there, "
        f"or unset data.root and ${DATA_DIR_ENV} to load '{name}' from the hub"
    )


def _gold(layout: str, raw: Any) -> str | None:
    """The gold answer as published (see the module docstring); None when the row has none."""
    if raw is None or isinstance(raw, bool):
        return None
    text = raw.strip() if isinstance(raw, str) else json.dumps(raw) if isinstance(raw, int | float) else None
    if text is None:
        return None
    if layout == "gsm8k":
        if "####" not in text:
            return None
        text = text.rsplit("####", 1)[1].strip()
    return text or None


def _level(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, int):
        return value
    digits = "".join(ch for ch in str(value) if ch.isdigit())  # MATH's "Level 3"
    return int(digits) if digits else None


def rows_to_problems(
    rows: list[dict[str, Any]],
    layout: str,
    source: str,
    on_bad_row: str = "error",
    report: dict[str, Any] | None = None,
    prefix: str | None = None,
    label: str | None = None,
) -> list[Problem]:
    """Turn raw dataset rows into Problems; a bad row is an error (or skipped and counted).

    Ids are ``<prefix>-<row id>`` (prefix: the benchmark name, else the layout). ``source`` names the
    rows in errors; ``label`` (default ``source``) is what each Problem records as its source."""
    qcols, acol = COLUMNS[layout]
    prefix = prefix or layout
    problems: list[Problem] = []
    skipped: list[str] = []
    for i, row in enumerate(rows):
        question = next((row[c] for c in qcols if isinstance(row.get(c), str) and row[c].strip()), None)
        gold = _gold(layout, row.get(acol))
        reason = None
        if question is None:
            reason = f"no '{'/'.join(qcols)}'"
        elif gold is None:
            reason = f"no gold answer in '{acol}'" + (" (no '####')" if layout == "gsm8k" else "")
        if reason:
            if on_bad_row == "error":
                raise ValueError(f"{source}: row {i}: {reason} (set data.on_bad_row=skip to skip such rows)")
            skipped.append(f"row {i}: {reason}")
            continue
        pid = row.get("unique_id") or row.get("id")
        problems.append(
            Problem(
                id=f"{prefix}-{pid if pid not in (None, '') else i}",
                question=question.strip(),
                answer=gold,
                source=label or source,
                level=_level(row.get("level")),
            )
        )
    if skipped:
        log.warning("%s: skipped %d of %d rows (first: %s)", source, len(skipped), len(rows), skipped[0])
    if report is not None:
        report.update(rows=len(rows), kept=len(problems), skipped=len(skipped), skipped_rows=skipped[:20])
    return problems


def _file_rows(
    cfg: DataConfig, path: Path, layout: str | None = None
) -> tuple[list[dict[str, Any]], str, str]:
    """A file's rows, its source name and layout: ``local_format``, else ``layout`` (a named
    benchmark's own), else detected from the columns."""
    rows, source = read_rows(path), str(path)
    if cfg.local_format != "auto":
        layout = cfg.local_format
    layout = layout or _detect_layout(rows, source)
    if layout in ("aime", "amc"):  # the hub sets' problem/answer columns
        layout = "math500"
    columns = set().union(*(r.keys() for r in rows)) if rows else set()
    if cfg.levels and rows and "level" not in columns:
        raise ValueError(f"{source}: data.levels={cfg.levels} but the file has no 'level' column")
    return rows, source, layout


def load_problems(
    cfg: DataConfig, split: str | None = None, report: dict[str, Any] | None = None
) -> list[Problem]:
    """The problems ``cfg`` names, for ``split`` (default ``cfg.split``), after level filter, shuffle, limit.

    ``report``, when given, receives row counts (rows, kept, skipped, skipped_rows).
    """
    split = split or cfg.split
    if cfg.dataset == "arithmetic":
        problems = arithmetic_problems(cfg.arithmetic_size, cfg.seed, split, cfg.levels)
        if report is not None:
            report.update(rows=len(problems), kept=len(problems), skipped=0, skipped_rows=[])
    else:
        prefix = label = None
        if cfg.dataset in NAMED:
            # a named benchmark's problems record its name, not where they were read from, so the
            # same published file gives the same digest (and benchmark id) on every machine
            label = f"{cfg.dataset}/{split}"
            root, prefix = data_root(cfg), cfg.dataset
            if root is not None:
                path = local_copy(root, cfg.dataset, split)
                rows, source, layout = _file_rows(cfg, path, NAMED[cfg.dataset].layout)
            else:
                rows, source = _load_hub(cfg.dataset, split, cfg.levels)
                layout = NAMED[cfg.dataset].layout
        else:
            rows, source, layout = _file_rows(cfg, Path(cfg.dataset).expanduser())
        problems = rows_to_problems(rows, layout, source, cfg.on_bad_row, report, prefix, label)
        log.info("%s: %d problems from %s", cfg.dataset, len(problems), source)
        if cfg.levels and cfg.dataset != "bigmath":
            problems = [p for p in problems if p["level"] in cfg.levels]
    if cfg.shuffle:
        random.Random(cfg.seed).shuffle(problems)
    if cfg.limit is not None:
        problems = problems[: cfg.limit]
    if not problems:
        raise ValueError(
            f"no problems left from '{cfg.dataset}' split '{split}' (levels {cfg.levels}, limit {cfg.limit})"
        )
    return problems


def dataset_name(cfg: DataConfig, split: str | None = None) -> tuple[str, str]:
    """(name, split) a report names the data by: the benchmark's name, or for a file its stem - or its
    folder when the stem is a split name (``.../gsm8k/test.jsonl`` is gsm8k, split test)."""
    split = split or cfg.split
    if not cfg.dataset.endswith((".parquet", ".jsonl")):
        return cfg.dataset, split
    path = Path(cfg.dataset)
    if path.stem in SPLIT_NAMES and path.parent.name:
        return path.parent.name, path.stem
    return path.stem, split


def problems_digest(problems: list[Problem]) -> str:
    """Content digest of a problem list (order matters): what a stage puts in its cache key."""
    return sha256_json([dict(p) for p in problems])
