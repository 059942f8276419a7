"""Math problems for training and evaluation: hub datasets, local files, and a procedural default.

What: ``load_problems(cfg, split)`` returns ``Problem`` records (id, question, answer, source, level)
from one of

* ``arithmetic`` - the embedded default: seeded procedural word problems at five difficulty levels
  with exact integer or fraction answers (``arithmetic_problems``). Level 1 is single-digit addition
  so that the demo's tiny model (hidden 128, 2 layers) can learn it in minutes of CPU training.
* ``gsm8k`` (openai/gsm8k, config ``main``: question / answer with the gold after ``####``),
  ``math500`` (HuggingFaceH4/MATH-500: problem / answer / level), ``bigmath``
  (open-r1/Big-Math-RL-Verified-Processed: prompt / solution, the level is the config name, levels
  3-5 by default as in the QeRL recipe), ``aime`` (HuggingFaceH4/aime_2024) and ``amc``
  (AI-MO/aimo-validation-amc), both problem / answer - loaded with ``datasets.load_dataset``;
* a local ``.parquet`` or ``.jsonl`` file with the same columns as one of those hub datasets
  (detected from the columns, or named with ``local_format``).

How it departs from the recipes: the train/test split of the arithmetic set is a function of the
problem text (sha256 of the question decides the split), so the two splits are disjoint by
construction whatever the seed or size, not by bookkeeping. A row without a question or gold answer
is an error naming its index and source, or with ``on_bad_row="skip"`` is skipped, counted in the
report and logged - never dropped silently.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
from fractions import Fraction
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from pipeline.artifacts import sha256_json
from pipeline.config import StrictModel
from pipeline.prompts import TEMPLATES, Problem

log = logging.getLogger("qerl.data")

HUB: dict[str, tuple[str, str | None]] = {
    "gsm8k": ("openai/gsm8k", "main"),
    "math500": ("HuggingFaceH4/MATH-500", None),
    "bigmath": ("open-r1/Big-Math-RL-Verified-Processed", None),  # config chosen from the levels
    "aime": ("HuggingFaceH4/aime_2024", None),
    "amc": ("AI-MO/aimo-validation-amc", None),
}
# (question column, answer column) per dataset layout
COLUMNS: dict[str, tuple[str, str]] = {
    "gsm8k": ("question", "answer"),
    "math500": ("problem", "answer"),
    "bigmath": ("prompt", "solution"),
    "aime": ("problem", "answer"),
    "amc": ("problem", "answer"),
}
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
ARITHMETIC_LEVELS = (1, 2, 3, 4, 5)
TEST_PERCENT = 20  # share of the arithmetic problem space that hashes into the test split


class DataConfig(StrictModel):
    """Which problems a run trains or evaluates on."""

    dataset: str = Field(
        "arithmetic", description="arithmetic|gsm8k|math500|bigmath|aime|amc or a .parquet/.jsonl path"
    )
    split: str = "train"
    limit: int | None = Field(None, ge=1)
    shuffle: bool = False
    seed: int = 0
    levels: list[int] | None = Field(None, description="difficulty levels to keep (None: dataset default)")
    template: str = "terse"
    on_bad_row: Literal["error", "skip"] = "error"
    local_format: Literal["auto", "gsm8k", "math500", "bigmath", "aime", "amc"] = "auto"
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
        if value != "arithmetic" and value not in HUB and not value.endswith((".parquet", ".jsonl")):
            raise ValueError(
                f"unknown dataset '{value}'; use arithmetic, {', '.join(HUB)} or a .parquet/.jsonl file path"
            )
        return value


# --------------------------------------------------------------------------------------------------
# the procedural arithmetic set

_NAMES = ("Tom", "Ana", "Li", "Sam", "Mia", "Ben")
_ITEMS = ("apples", "books", "coins", "pens", "cards")
_LEVEL1 = (
    "{a} + {b} = ?",
    "What is {a} + {b}?",
    "Add {a} and {b}.",
    "{a} plus {b}?",
    "Sum of {a} and {b}?",
    "{a} and {b} make?",
)


def _fmt(value: Fraction) -> str:
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


def _make(level: int, rng: random.Random) -> tuple[str, Fraction]:
    """One question of ``level`` and its exact answer."""
    r = rng.randint
    if level == 1:  # single-digit addition, one of a few short phrasings
        a, b = r(0, 9), r(0, 9)
        phrase = rng.choice(_LEVEL1)
        return phrase.format(a=a, b=b), Fraction(a + b)
    if level == 2:  # one-digit and two-digit addition / subtraction
        a, b = r(10, 49), r(0, 9)
        if rng.random() < 0.5:
            return f"What is {a} + {b}?", Fraction(a + b)
        return f"What is {a} - {b}?", Fraction(a - b)
    if level == 3:  # two-digit +/-, one-digit products
        if rng.random() < 0.5:
            a, b = r(2, 9), r(2, 9)
            return f"What is {a} * {b}?", Fraction(a * b)
        a, b = r(10, 99), r(10, 99)
        op = rng.choice("+-")
        return f"What is {a} {op} {b}?", Fraction(a + b if op == "+" else a - b)
    if level == 4:  # a two-step word problem
        name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
        a, b, c = r(5, 40), r(2, 20), r(1, 9)
        q = f"{name} has {a} {item}, buys {b} more and gives away {c}. How many {item} now?"
        return q, Fraction(a + b - c)
    if level == 5:  # fractions, answer in lowest terms
        a, b, c, d = r(1, 9), r(2, 9), r(1, 9), r(2, 9)
        x, y = Fraction(a, b), Fraction(c, d)
        op = rng.choice("+-*")
        value = x + y if op == "+" else x - y if op == "-" else x * y
        return f"What is {a}/{b} {op} {c}/{d}?", value
    raise ValueError(f"unknown arithmetic level {level}; valid: {list(ARITHMETIC_LEVELS)}")


def split_of(question: str) -> str:
    """'test' or 'train', a fixed function of the question text: the splits cannot overlap."""
    bucket = int(hashlib.sha256(question.encode()).hexdigest()[:8], 16) % 100
    return "test" if bucket < TEST_PERCENT else "train"


def arithmetic_problems(
    n: int, seed: int = 0, split: str = "train", levels: list[int] | None = None
) -> list[Problem]:
    """``n`` distinct procedural problems of ``split`` at ``levels`` (default [1]), reproducible by seed."""
    if split not in ("train", "test"):
        raise ValueError(f"arithmetic split must be 'train' or 'test', not '{split}'")
    levels = sorted(set(levels or [1]))
    for level in levels:
        if level not in ARITHMETIC_LEVELS:
            raise ValueError(f"unknown arithmetic level {level}; valid: {list(ARITHMETIC_LEVELS)}")
    rng = random.Random(f"qerl-arithmetic-{seed}")
    seen: set[str] = set()
    out: list[Problem] = []
    misses = 0
    while len(out) < n:
        level = levels[len(out) % len(levels)]  # balanced across levels
        question, value = _make(level, rng)
        if question in seen or split_of(question) != split:
            misses += 1
            if misses > 200 * n + 10_000:
                raise ValueError(
                    f"only {len(out)} distinct {split} problems found at levels {levels} (asked for {n}); "
                    "add levels or ask for fewer"
                )
            continue
        seen.add(question)
        pid = hashlib.sha256(question.encode()).hexdigest()[:12]
        out.append(
            Problem(
                id=f"arith-{pid}", question=question, answer=_fmt(value), source="arithmetic", level=level
            )
        )
    return out


# --------------------------------------------------------------------------------------------------
# hub datasets and local files


def _read_local(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise FileNotFoundError(f"dataset file not found: {path}")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    rows = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({err.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            rows.append(row)
    return rows


def _detect_layout(columns: set[str], source: str) -> str:
    if {"question", "answer"} <= columns:
        return "gsm8k"
    if {"prompt", "solution"} <= columns:
        return "bigmath"
    if {"problem", "answer"} <= columns:
        return "math500"
    raise ValueError(
        f"{source}: cannot tell the dataset layout from columns {sorted(columns)}; expected question/answer "
        "(gsm8k), problem/answer (math500, aime, amc) or prompt/solution (bigmath)"
    )


def _bigmath_config(levels: list[int]) -> str:
    name = "level_" + "_".join(str(v) for v in sorted(set(levels)))
    if name not in BIGMATH_CONFIGS:
        raise ValueError(f"Big-Math has no config for levels {levels}; published: {sorted(BIGMATH_CONFIGS)}")
    return name


def _load_hub(name: str, split: str, levels: list[int] | None) -> tuple[list[dict[str, Any]], str]:
    repo, config = HUB[name]
    if name == "bigmath":
        config = _bigmath_config(levels or [3, 4, 5])
    try:
        import datasets

        ds = datasets.load_dataset(repo, config, split=split)
    except Exception as err:
        raise RuntimeError(
            f"could not load {repo}{f' ({config})' if config else ''} split '{split}' from the Hugging Face hub "
            f"({type(err).__name__}: {str(err)[:200]}). Offline? Download it elsewhere and pass a local "
            f"file instead: --set data.dataset=/path/{name}.parquet (or .jsonl) with columns "
            f"{'/'.join(COLUMNS[name])}"
        ) from err
    rows = [dict(r) for r in ds]
    if name == "bigmath":
        level = config.removeprefix("level_")
        for row in rows:  # the hub's level is the config, not a column
            row.setdefault("level", int(level) if level.isdigit() else None)
    return rows, f"{repo}:{config or 'default'}:{split}"


def _gold(layout: str, raw: Any) -> str | None:
    if raw is None:
        return None
    if isinstance(raw, float) and raw.is_integer():
        raw = int(raw)  # AMC stores answers as floats: 142.0 -> "142"
    text = str(raw).strip()
    if layout == "gsm8k":
        if "####" not in text:
            return None
        text = text.rsplit("####", 1)[1].strip().replace(",", "")
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
) -> list[Problem]:
    """Turn raw dataset rows into Problems; a bad row is an error (or skipped and counted)."""
    qcol, acol = COLUMNS[layout]
    problems: list[Problem] = []
    skipped: list[str] = []
    for i, row in enumerate(rows):
        question = row.get(qcol)
        gold = _gold(layout, row.get(acol))
        reason = None
        if not isinstance(question, str) or not question.strip():
            reason = f"no '{qcol}'"
        elif gold is None:
            reason = f"no gold answer in '{acol}'" + (" (no '####')" if layout == "gsm8k" else "")
        if reason:
            if on_bad_row == "error":
                raise ValueError(f"{source}: row {i}: {reason} (set data.on_bad_row=skip to skip such rows)")
            skipped.append(f"row {i}: {reason}")
            continue
        pid = row.get("unique_id") or row.get("id") or f"{i}"
        problems.append(
            Problem(
                id=f"{layout}-{pid}",
                question=question.strip(),
                answer=gold,
                source=source,
                level=_level(row.get("level")),
            )
        )
    if skipped:
        log.warning("%s: skipped %d of %d rows (first: %s)", source, len(skipped), len(rows), skipped[0])
    if report is not None:
        report.update(rows=len(rows), kept=len(problems), skipped=len(skipped), skipped_rows=skipped[:20])
    return problems


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
        if cfg.dataset in HUB:
            rows, source = _load_hub(cfg.dataset, split, cfg.levels)
            layout = (
                "gsm8k" if cfg.dataset == "gsm8k" else "bigmath" if cfg.dataset == "bigmath" else "math500"
            )
        else:
            path = Path(cfg.dataset).expanduser()
            rows, source = _read_local(path), str(path)
            columns = set().union(*(r.keys() for r in rows)) if rows else set()
            layout = cfg.local_format if cfg.local_format != "auto" else _detect_layout(columns, source)
            if layout in ("aime", "amc"):
                layout = "math500"
            if cfg.levels and rows and "level" not in columns:
                raise ValueError(f"{source}: data.levels={cfg.levels} but the file has no 'level' column")
        problems = rows_to_problems(rows, layout, source, cfg.on_bad_row, report)
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


def problems_digest(problems: list[Problem]) -> str:
    """Content digest of a problem list (order matters): what a stage puts in its cache key."""
    return sha256_json([dict(p) for p in problems])
