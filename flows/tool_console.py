"""The console of ``qerl eval``: its stage lines and a progress bar for people, the rest in a log file.

``qerl eval`` starts a rollout engine, and vLLM's engine-core and worker processes write dozens of
lines of their own (configuration, compilation, memory) straight to the file descriptors they
inherit. ``session`` points descriptors 1 and 2 at ``<work>/logs/eval-<UTC time>-<pid>.log`` for the
command's work, with the root logger at INFO into the same file, and gives the command a
``TerminalConsole`` on a duplicate of the terminal's stderr: its stage lines, the evaluation's
progress bar, qerl's warnings and any library's errors (one line each, as ``qerl run`` shows them).

Python's ``sys.stdout`` and ``sys.stderr`` write to the log file too (libraries' tqdm bars). Unlike a
run's console (``qerl.flows.console.session``), which keeps the descriptors on ``run.log`` until the
process exits, this one gives descriptors and streams back when the work ends (the engine is closed
by then): the command prints its result after the session, and in-process callers (tests) get their
own streams back. ``-v`` skips the redirection: everything goes to the terminal.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from qerl.flows.console import FORMAT, TerminalConsole, console_handler

LOGS_DIR = "logs"


def log_path(work: str | Path, command: str) -> Path:
    """``<work>/logs/<command>-<UTC time>-<pid>.log``: a file per invocation (invocations in one process
    within one second share theirs, appended)."""
    stamp = _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    return Path(work) / LOGS_DIR / f"{command}-{stamp}-{os.getpid()}.log"


@contextlib.contextmanager
def session(path: Path, verbose: bool = False) -> Iterator[TerminalConsole]:
    """Open the command's console (module docstring); yields it for the stage lines."""
    if verbose:
        yield TerminalConsole(sys.stderr)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    root, qerl = logging.getLogger(), logging.getLogger("qerl")
    level, qerl_level, handler_levels = root.level, qerl.level, [(h, h.level) for h in root.handlers]
    with open(path, "a", buffering=1, encoding="utf-8") as logfile:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)  # taken once the log is open: nothing to give back if it fails
        console = TerminalConsole(os.fdopen(os.dup(2), "w", buffering=1, encoding="utf-8"))
        file_handler = logging.StreamHandler(logfile)
        file_handler.setFormatter(logging.Formatter(FORMAT))
        shown = console_handler(console, path.name)
        for handler, _ in handler_levels:  # basicConfig's: the console handler shows what matters
            handler.setLevel(logging.CRITICAL + 1)
        root.addHandler(file_handler)
        root.addHandler(shown)
        root.setLevel(logging.INFO)
        qerl.setLevel(logging.INFO)  # qerl's progress lines are the log's record, whatever the command set
        os.dup2(logfile.fileno(), 1)
        os.dup2(logfile.fileno(), 2)
        streams = sys.stdout, sys.stderr
        sys.stdout = sys.stderr = logfile  # Python-level writes too (tqdm bars of libraries)
        try:
            yield console
        finally:
            console.end_progress()
            logfile.flush()
            sys.stdout, sys.stderr = streams
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            root.removeHandler(file_handler)
            root.removeHandler(shown)
            root.setLevel(level)
            qerl.setLevel(qerl_level)
            for handler, was in handler_levels:
                handler.setLevel(was)
            console.stream.close()
