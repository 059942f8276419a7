"""Final answers in model output: extraction, normalisation, and the verdicts decidable without math-verify.

What: ``extract_answer`` pulls the final answer out of a completion (``<answer>`` tags, the last
``\\boxed{}``, GSM8K's ``#### n``, or the last number; ``auto`` tries them in that order; an answer in
tags that holds a ``\\boxed{}`` gives the boxed content), and ``extract_with_format`` also says which
format it was found in. ``normalize_answer`` applies the textual normalisations shared by prediction
and gold, only rewrites that never change a value. All of it is cheap string work that runs in the
calling process; ``qerl.pipeline.data.rewards`` sends what is left to math-verify.

Fast path (``fast_verdict``): when both normalised strings are canonical integers (no sign but ``-``,
no leading zeros) the verdict is ``pred == gold`` without math-verify. This is provably what
math-verify returns: it parses such a string to a sympy ``Integer``, and for two ``Integer`` s
``sympy_expr_eq`` answers by string equality, then exact ``Integer`` equality, then
``simplify(a - b) == 0``, all of which reduce to integer equality. ``tests/pipeline/test_rewards.py`` checks the
claim against the verifier pool on random and edge-case integers.

Model output is never evaluated as Python.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Literal

__all__ = [
    "AnswerFormat",
    "extract_answer",
    "extract_with_format",
    "fast_verdict",
    "is_canonical_int",
    "normalize_answer",
]

AnswerFormat = Literal["boxed", "answer_tags", "gsm8k", "last_number", "auto"]

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*(\{)?")
_GSM8K = re.compile(r"####[ \t]*([^\n]*)")
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?")
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_CANONICAL_INT = re.compile(r"0|-?[1-9]\d{0,99}")


def _balanced(text: str, open_idx: int) -> str | None:
    """Content of the brace group whose ``{`` is at ``open_idx``; None when it never closes."""
    depth = 0
    for i in range(open_idx, len(text)):
        ch = text[i]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[open_idx + 1 : i]
    return None


def _last_boxed(text: str) -> str | None:
    matches = list(_BOXED.finditer(text))
    for match in reversed(matches):
        if match.group(1):
            content = _balanced(text, match.end() - 1)
            if content is not None:
                return content
        else:  # "\boxed 5": a single token follows
            token = re.match(r"\s*([^\s$]+)", text[match.end() :])
            if token:
                return token.group(1)
    return None


def _from_tags(text: str) -> str | None:
    found = _ANSWER_TAG.findall(text)
    return found[-1] if found else None


def _from_gsm8k(text: str) -> str | None:
    """The last ``####`` line: its leading number ("#### 72 apples" -> 72), else the whole line."""
    found = _GSM8K.findall(text)
    if not found:
        return None
    line = found[-1].strip()
    lead = re.match(r"\$?\s*(" + _NUMBER.pattern + r")(?![\d^_{\\])", line)
    return lead.group(1) if lead else line


def _last_number(text: str) -> str | None:
    found = _NUMBER.findall(text)
    return found[-1] if found else None


_EXTRACTORS: dict[str, Callable[[str], str | None]] = {
    "answer_tags": _from_tags,
    "boxed": _last_boxed,
    "gsm8k": _from_gsm8k,
    "last_number": _last_number,
}
_AUTO_ORDER = ("answer_tags", "boxed", "gsm8k", "last_number")


def extract_with_format(text: str, fmt: AnswerFormat) -> tuple[str | None, str | None]:
    """(answer, the format it was found in); (None, None) when there is none."""
    if fmt not in _EXTRACTORS and fmt != "auto":
        raise ValueError(f"unknown answer format '{fmt}'; valid: {', '.join([*_EXTRACTORS, 'auto'])}")
    for name in _AUTO_ORDER if fmt == "auto" else (fmt,):
        raw = _EXTRACTORS[name](text)
        if raw is None:
            continue
        if name == "answer_tags" and (inner := _last_boxed(raw)) is not None:
            raw = inner  # "<answer>\boxed{3}</answer>"
        answer = normalize_answer(raw)
        if answer:
            return answer, name
    return None, None


def extract_answer(text: str, fmt: AnswerFormat = "auto") -> str | None:
    """The final answer in ``text`` (normalised), or None when it has none in format ``fmt``."""
    return extract_with_format(text, fmt)[0]


def normalize_answer(text: str) -> str:
    """Textual normalisation applied to predictions and gold answers alike.

    Only rewrites that never change a value: surrounding space, ``$`` and a trailing full stop; a whole
    answer wrapped in ``\\boxed{}``; ``\\dfrac``/``\\tfrac`` to ``\\frac``; LaTeX spacing commands;
    thousands separators in a plain number (``1,234`` -> ``1234``); a leading ``+``.
    """
    s = text.strip()
    for _ in range(3):
        before = s
        s = s.strip().strip("$").strip()
        if s.endswith(".") and not s.endswith(".."):
            s = s[:-1].rstrip()
        if s.startswith(("\\boxed{", "\\fbox{")):
            inner = _balanced(s, s.index("{"))
            if inner is not None and len(inner) + s.index("{") + 2 == len(s):
                s = inner
        if s == before:
            break
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = re.sub(r"\\[,!;: ]", "", s)
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    if s.startswith("+") and len(s) > 1 and s[1].isdigit():
        s = s[1:]
    return s.strip()


def is_canonical_int(s: str) -> bool:
    return _CANONICAL_INT.fullmatch(s) is not None


def fast_verdict(pred: str, gold: str) -> bool | None:
    """math-verify's verdict without running it, when provably the same (see module doc); else None."""
    if is_canonical_int(pred) and is_canonical_int(gold):
        return pred == gold
    return None
