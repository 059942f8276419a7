"""``qerl runs``: the work dir's runs, newest first, and what to do about the unfinished ones.

An operator's first question after a night is which runs finished, which failed and why, and which
died mid-step, and so which one to ``qerl resume``. The run records answer most of it; the run lock
(``qerl.pipeline.store.run_lock``) answers the rest: a record still saying ``running`` is a live
attempt when a process holds the lock, and an *interrupted* one (killed, the machine lost) when none
does. An attempt on another machine sharing the work dir is shown as such: its lock cannot be seen
from here. It reads the records and the locks, and writes nothing.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from qerl.flows.tool_commands import work_dir


def run_state(work: Path, record: dict[str, Any]) -> str:
    """``completed``, ``failed``, ``running (pid N on HOST, since T)``, ``running on HOST?`` (another
    machine's attempt, unseen) or ``interrupted`` (a running record with no attempt alive)."""
    from qerl.pipeline.store import run_lock
    from qerl.pipeline.store.layout import RUNS_DIR

    status = str(record.get("status") or "unknown")
    if status != "running":
        return status
    folder = work / RUNS_DIR / str(record["run_id"])
    held = run_lock.holder(folder)
    if held is not None:
        return f"running ({run_lock.describe(held)})"
    host = run_lock.other_host(folder)
    return f"running on {host}?" if host else "interrupted"


def _row(work: Path, record: dict[str, Any]) -> tuple[str, list[str]]:
    """The run's line and the lines under it (the error, the command that resumes it)."""
    steps = ((record.get("config") or {}).get("loop") or {}).get("steps", "?")
    state = run_state(work, record)
    accuracy = record.get("final_accuracy")
    reg = record.get("registration") or {}
    registered = (
        f"v{reg['version']}" + (" champion" if reg.get("promoted") else "") if reg.get("version") else "-"
    )
    updated = str(record.get("updated_at") or record.get("started_at") or "-")[:19]
    line = (
        f"  {record['run_id']:<34} {state:<12} night {record.get('night') or '-':<10}  "
        f"step {len(record.get('steps') or [])}/{steps}  "
        f"accuracy {'-' if accuracy is None else f'{accuracy:.3f}'}  {registered}  updated {updated}"
    )
    below = []
    if record.get("error") and state == "failed":
        below.append(f"      error: {str(record['error']).splitlines()[0][:300]}")
    if state in ("failed", "interrupted"):
        below.append(f"      resume: qerl resume {record['run_id']}")
    return line, below


def read_records(work: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """The work dir's run records, and a line for each one that cannot be read."""
    from qerl.pipeline.store.layout import RUN_RECORD, RUNS_DIR

    records, unreadable = [], []
    for path in (work / RUNS_DIR).glob(f"*/{RUN_RECORD}"):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            unreadable.append(f"  {path.parent.name:<34} unreadable record ({err})")
            continue
        if isinstance(record, dict):
            record.setdefault("run_id", path.parent.name)
            records.append(record)
    return records, unreadable


def longest_attempt(work: Path, loop_name: str) -> tuple[float, str] | None:
    """(hours, run id) of the longest completed attempt of ``loop_name``'s runs in ``work``, from
    its record's start and last update (what ``loop.deadline_h`` bounds: one attempt); None when no
    such run completed here."""
    import datetime as dt

    longest = None
    for record in read_records(work)[0]:
        loop = (record.get("config") or {}).get("loop") or {}
        if record.get("status") != "completed" or loop.get("name") != loop_name:
            continue
        try:
            start = dt.datetime.fromisoformat(str(record["started_at"]))
            end = dt.datetime.fromisoformat(str(record["updated_at"]))
        except (KeyError, ValueError):
            continue
        hours = (end - start).total_seconds() / 3600.0
        if longest is None or hours > longest[0]:
            longest = (hours, str(record["run_id"]))
    return longest


def cmd_runs(args: argparse.Namespace) -> int:
    if args.limit < 1:
        raise ValueError(f"--limit {args.limit}: must be at least 1 (--all shows every run)")
    work = Path(work_dir(args)).resolve()
    records, unreadable = read_records(work)
    if not records and not unreadable:
        print(f"{work}: no runs")
        return 0
    records.sort(key=lambda r: str(r.get("started_at") or ""), reverse=True)
    shown = records if args.all else records[: args.limit]
    more = f", the newest {len(shown)} shown (--all for every one)" if len(shown) < len(records) else ""
    bad = (
        f" and {len(unreadable)} unreadable record{'' if len(unreadable) == 1 else 's'}" if unreadable else ""
    )
    print(f"{work}: {len(records)} run{'' if len(records) == 1 else 's'}{bad}, newest first{more}")
    for record in shown:
        line, below = _row(work, record)
        print(line, *below, sep="\n")
    for line in unreadable:
        print(line)
    return 0
