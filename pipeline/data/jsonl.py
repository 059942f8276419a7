"""JSON Lines reading shared by dataset files and the ``qerl score`` file scorer.

What: ``read_jsonl`` yields ``(line number, object)`` for every line of a ``.jsonl`` file, in order and
as it reads, so callers can name ``path:line`` in their own row checks and the first bad line stops
the read. A line that is not valid JSON, or not a JSON object, is an error naming ``path:line``. Blank
lines are skipped (dataset files) or, with ``skip_blank=False``, rejected as invalid JSON (the
scorer's input, whose output must match its input line for line).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["read_jsonl"]


def read_jsonl(path: str | Path, *, skip_blank: bool = True) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` per line of ``path`` (1-based, counting blank lines)."""
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if skip_blank and not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({err.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            yield lineno, row
