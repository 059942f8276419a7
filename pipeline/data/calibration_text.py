"""Calibration text for GPTQ quantization: prompts AND their reference completions, tokenized.

What: ``calibration_pairs(source, count, seed, data)`` picks ``count`` (question, completion) pairs and
``calibration_token_ids`` renders each as the run would see it (the prompt template through the
tokenizer's chat template, generation prompt added) followed by the completion text and the end of
turn, truncated to ``max_tokens``. ``token_digest`` is the content digest of the token ids, which the
quantize stage puts in its cache key. Sources:

* ``gsm8k``: GSM8K train problems with their worked reference solutions, read from the data directory
  (``data.root`` or ``$QERL_DATA_DIR``: ``<root>/gsm8k/train.jsonl``, as ``datasets.load_problems``
  finds it); a seeded shuffle picks ``count`` of them.
* ``train``: the run's own training problems with a completion built from their answers: the
  procedural arithmetic set (the answer in the template's answer format), or GSM8K files (worked
  solutions). Other datasets have no reference completion here: an error names the alternative.
* ``auto``: ``gsm8k`` when a data directory holds GSM8K train, else ``train``.

Why prompt and completion: the quantized model is run on its own reasoning text far more than on
prompts, so activations of completion tokens are what the Hessian should see (on SmolLM2-135M a
GPTQ probe reached KL 0.135 to the base calibrated on questions alone, 0.062 with the solutions;
docs/decisions.md).

A dataset without reference solutions is an error naming the sources that work: the base model's own
sampled completions are not a source.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from qerl.pipeline.data.arithmetic import arithmetic_problems
from qerl.pipeline.data.datasets import DATA_DIR_ENV, DataConfig, _read_local, data_root, local_copy
from qerl.pipeline.data.prompts import TEMPLATES, render_prompt
from qerl.pipeline.store.files import sha256_json

__all__ = [
    "CalibrationDataError",
    "calibration_pairs",
    "calibration_token_ids",
    "resolve_source",
    "token_digest",
]

_ANSWER_FORMS = {
    "boxed": "The answer is \\boxed{{{a}}}.",
    "answer_tags": "<answer>{a}</answer>",
    "gsm8k": "#### {a}",
    "last_number": "The answer is {a}.",
}


class CalibrationDataError(ValueError):
    """Calibration text cannot be found; the message names what to set."""


def _gsm8k_file(data: DataConfig) -> Path | None:
    root = data_root(data)
    if root is None:
        return None
    path = root / "gsm8k" / "train.jsonl"
    return path if path.is_file() else None


def resolve_source(source: str, data: DataConfig) -> str:
    """``auto`` -> ``gsm8k`` when the data directory holds GSM8K train, else ``train``."""
    if source != "auto":
        return source
    return "gsm8k" if _gsm8k_file(data) is not None else "train"


def _sample(rows: list[Any], count: int, seed: int) -> list[Any]:
    rows = list(rows)
    random.Random(seed).shuffle(rows)
    return rows[:count]


def _gsm8k_pairs(rows: list[dict[str, Any]], source: str) -> list[tuple[str, str]]:
    pairs = []
    for i, row in enumerate(rows):
        q, a = row.get("question"), row.get("answer")
        if not (isinstance(q, str) and isinstance(a, str) and "####" in a):
            raise CalibrationDataError(f"{source}: row {i} is not a GSM8K question/worked answer")
        pairs.append((q.strip(), a.strip()))
    return pairs


def calibration_pairs(
    source: str, count: int, seed: int, data: DataConfig
) -> tuple[list[tuple[str, str]], str]:
    """``count`` (question, completion) pairs from ``source`` and a label saying where they came from."""
    source = resolve_source(source, data)
    if source == "gsm8k":
        path = _gsm8k_file(data)
        if path is None:
            root = data_root(data)
            if root is not None:
                local_copy(root, "gsm8k", "train")  # raises naming what the directory holds
            raise CalibrationDataError(
                "quantize.calibration.source=gsm8k needs GSM8K train: set data.root (or "
                f"${DATA_DIR_ENV}) to a directory holding gsm8k/train.jsonl, or use "
                "quantize.calibration.source=train (the run's own problems)"
            )
        return _gsm8k_pairs(_sample(_read_local(path), count, seed), str(path)), "gsm8k/train"
    if source != "train":
        raise CalibrationDataError(
            f"unknown quantize.calibration.source '{source}'; valid: auto, gsm8k, train"
        )
    if data.dataset == "arithmetic":
        size = max(count, data.arithmetic_size)
        problems = _sample(arithmetic_problems(size, data.seed, "train", data.levels), count, seed)
        form = _ANSWER_FORMS[TEMPLATES[data.template]["answer_format"]]
        return [(p["question"], form.format(a=p["answer"])) for p in problems], "arithmetic/train"
    path = None
    if data.dataset == "gsm8k":
        path = _gsm8k_file(data)
    elif data.dataset.endswith((".jsonl", ".parquet")):
        path = Path(data.dataset).expanduser()
    rows = _read_local(path) if path is not None else []
    if rows and all(isinstance(r.get("answer"), str) and "####" in r["answer"] for r in rows[:8]):
        return _gsm8k_pairs(_sample(rows, count, seed), str(path)), f"{path}"
    raise CalibrationDataError(
        f"quantize.calibration.source=train: the training data '{data.dataset}' has no reference solutions "
        "readable here (GSM8K files and the arithmetic set do; sampling the base model's completions is "
        "not implemented): set quantize.calibration.source=gsm8k with data.root (or "
        f"${DATA_DIR_ENV}) holding gsm8k/train.jsonl, or use quantize.method=rtn or mse"
    )


def calibration_token_ids(
    tokenizer: Any, pairs: list[tuple[str, str]], template: str, max_tokens: int
) -> list[list[int]]:
    """Each pair as chat-rendered prompt + completion + end of turn, tokenized and truncated."""
    end = getattr(tokenizer, "eos_token", None) or ""
    out = []
    for question, completion in pairs:
        text = render_prompt(tokenizer, question, template) + completion + end
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:max_tokens]
        if ids:
            out.append([int(t) for t in ids])
    if not out:
        raise CalibrationDataError("the calibration text tokenized to nothing")
    return out


def token_digest(token_ids: list[list[int]]) -> str:
    """Content digest of the calibration token ids (order matters)."""
    return sha256_json(token_ids)
