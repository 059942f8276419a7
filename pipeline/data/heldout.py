"""Held-out prompt + completion texts: what the quantization quality report scores a model on.

What: ``held_out_texts(source, count, root)`` returns ``count`` items, each a chat ``messages`` list
(the user's question) and the ``completion`` a good answer gives, plus a label and a digest of the
items. Two sources:

* ``gsm8k``: the first ``count`` problems of GSM8K's **test** split with their published reference
  solutions (the worked answer, calculator annotations and ``#### N`` line included, as shipped),
  read from ``<root>/gsm8k/test.jsonl`` (``root``: the data directory, else ``$QERL_DATA_DIR``).
* ``arithmetic``: the procedural set's **test** split (``qerl.pipeline.data.arithmetic``; disjoint from
  its train split by construction), all five levels, seed 0, each answered ``<answer>N</answer>``
  (the demo's answer format). Always available, so the demo and the tests always get a report.

``auto`` takes gsm8k when a data directory holds ``gsm8k/test.jsonl``, else arithmetic.

In a run, ``quality_texts`` prefers the run's validation split (``validation_texts``: its first
``count`` problems with their reference completions, where the data has them): held out of training
and of GPTQ's calibration, and not the test split, so choosing a quantization recipe by its quality
report never selects on the test set the run reports.

Why held-out splits only: calibration (GPTQ) and training use the training problems, so a quality
number measured here is never flattered by the data the weights were fitted on. The items are in
file order (no shuffle), so the same count always gives the same texts and digest.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from qerl.pipeline.data.arithmetic import ARITHMETIC_LEVELS, arithmetic_problems
from qerl.pipeline.data.calibration_text import reference_pairs
from qerl.pipeline.data.datasets import DATA_DIR_ENV, DataConfig, dataset_name, local_copy, read_rows
from qerl.pipeline.store.files import sha256_json

__all__ = ["HELD_OUT_SOURCES", "held_out_texts", "quality_texts", "validation_texts"]

HELD_OUT_SOURCES = ("auto", "gsm8k", "arithmetic")
Texts = tuple[str, list[dict[str, Any]], str]  # (label, items, digest)


def _gsm8k_file(root: str | None) -> Path | None:
    """``<root>/gsm8k/test.jsonl`` or ``.parquet`` (as ``load_problems`` reads them), else None."""
    base = root or os.environ.get(DATA_DIR_ENV) or None
    if base is None:
        return None
    try:
        return local_copy(Path(base).expanduser(), "gsm8k", "test")
    except FileNotFoundError:
        return None


def _gsm8k_items(path: Path, count: int) -> list[dict[str, Any]]:
    items = []
    for i, row in enumerate(read_rows(path)):
        question, answer = row.get("question"), row.get("answer")
        if not (isinstance(question, str) and isinstance(answer, str) and "####" in answer):
            raise ValueError(f"{path}: row {i} has no question or no worked answer ending in '#### N'")
        items.append({"id": f"gsm8k-{i}", "messages": [{"role": "user", "content": question.strip()}],
                      "completion": answer.strip()})  # fmt: skip
        if len(items) == count:
            break
    return items


def _arithmetic_items(count: int) -> list[dict[str, Any]]:
    problems = arithmetic_problems(count, seed=0, split="test", levels=list(ARITHMETIC_LEVELS))
    return [
        {
            "id": p["id"],
            "messages": [{"role": "user", "content": p["question"]}],
            "completion": f"<answer>{p['answer']}</answer>",
        }  # fmt: skip
        for p in problems
    ]


def held_out_texts(source: str, count: int, root: str | None = None) -> tuple[str, list[dict[str, Any]], str]:
    """(label, items, digest): ``count`` held-out items from ``source`` (see the module docstring).

    ``label`` names the source and split ("gsm8k/test", "arithmetic/test"); ``digest`` is the sha256
    of the items, what a cache key holds. gsm8k without its file is an error naming where it looked."""
    if source not in HELD_OUT_SOURCES:
        raise ValueError(f"unknown held-out text source '{source}'; valid: {', '.join(HELD_OUT_SOURCES)}")
    if count < 1:
        raise ValueError(f"held-out text count must be at least 1, got {count}")
    path = _gsm8k_file(root) if source in ("auto", "gsm8k") else None
    if source == "gsm8k" and path is None:
        where = (
            root or os.environ.get(DATA_DIR_ENV) or f"(no data directory: root unset, ${DATA_DIR_ENV} unset)"
        )
        raise FileNotFoundError(
            f"held-out source gsm8k needs gsm8k/test.jsonl under the data directory {where}; set "
            f"quantize.quality.data_root or ${DATA_DIR_ENV}, or use source arithmetic"
        )
    if path is not None:
        label, items = "gsm8k/test", _gsm8k_items(path, count)
    else:
        label, items = "arithmetic/test", _arithmetic_items(count)
    return label, items, sha256_json(items)


def validation_texts(problems: list[Any], data: DataConfig, count: int) -> Texts | None:
    """(label, items, digest) of the first ``count`` of a run's validation ``problems`` with their
    reference completions (label ``validation:<dataset>``); None when the data has none."""
    pairs = reference_pairs(list(problems[:count]), data)
    if not pairs:
        return None
    items = [
        {"id": p["id"], "messages": [{"role": "user", "content": q}], "completion": c}
        for p, (q, c) in zip(problems[:count], pairs, strict=True)
    ]
    return f"validation:{dataset_name(data)[0]}", items, sha256_json(items)


def quality_texts(
    source: str,
    count: int,
    root: str | None,
    data: DataConfig | None = None,
    validation: list[Any] | None = None,
) -> Texts | None:
    """The texts the quality stage measures on (``quantize.quality.source``): the run's validation
    split (``validation``, with ``data`` its data config) for ``validation``, and for ``auto`` where it
    has reference completions; else ``held_out_texts``. None when ``count`` is 0 (weight errors only)."""
    if count == 0:
        return None
    if source in ("auto", "validation"):
        texts = validation_texts(validation, data, count) if validation and data is not None else None
        if texts is not None:
            return texts
        if source == "validation":
            raise ValueError(
                "quantize.quality.source validation: this run has no validation split with reference "
                "completions (eval.validation.size 0, or data without worked answers); use auto, gsm8k "
                "or arithmetic"
            )
    return held_out_texts(source, count, root)
