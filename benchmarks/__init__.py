"""Benchmarks: each ``bench_<name>.py`` writes its section of BENCHMARKS.md to ``results/<name>.md``
with ``write_section``, which stamps the code it measured (the git commit, and whether the tree had
uncommitted changes), so a figure can be traced to the code that produced it."""

from __future__ import annotations

import datetime
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUTPUTS = ("benchmarks/results", "BENCHMARKS.md")  # what the benchmarks write: not code they measured


def provenance() -> str:
    """``commit 1a2b3c4, 2026-11-23`` (``+ uncommitted changes`` when a tracked file other than the
    benchmarks' own outputs differs from it: a run of several benchmarks rewrites those), or
    ``commit unknown`` outside a git checkout."""
    day = datetime.date.today().isoformat()
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", *[f":!{p}" for p in OUTPUTS]],
            cwd=ROOT,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return f"commit unknown (not a git checkout), {day}"
    return f"commit {commit}{' + uncommitted changes' if dirty else ''}, {day}"


def write_section(path: Path | str, text: str) -> None:
    """Write a results section atomically, ending with the line naming the code it measured."""
    from qerl.pipeline.store.files import atomic_write_text

    atomic_write_text(Path(path), f"{text.rstrip()}\n\nMeasured at {provenance()}.\n")
