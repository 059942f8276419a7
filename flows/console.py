"""The console of ``qerl run``/``qerl resume``: a few lines for people, everything else in ``run.log``.

What the terminal shows: one line per stage outside the step loop (base, quantize, twin, data,
warm start, each evaluation, registration), one progress bar over the RL steps whose postfix holds
the last step's rollout tokens/s, reward, accuracy and step time plus an ETA for the whole run, then
the summary, last. Warnings of qerl's own modules and errors of any library (tracebacks in full) are
shown as well. Without a terminal (a pipe, CI, a test) the bar becomes a line every tenth of the run.

Where the rest goes: ``<work>/runs/<run-id>/run.log``. ``session`` points file descriptors 1 and 2
at that file, so vLLM's engine-core and worker processes (which inherit them), C extensions, tqdm bars
of libraries, Python warnings and Prefect's temporary server all write there, and the console keeps
its own duplicate of the original stderr. The root logger gets two handlers before Prefect is
imported: Prefect then keeps them (it installs its own console handler only on a bare root logger),
and its loggers, httpx's request lines and MLflow's propagate into the file. ``-v`` skips all of this:
every log line goes to the terminal, and to ``run.log`` too.

The flow reports through ``current()``; when no session is open (a deployment run under
``qerl schedule``) the same lines go to the ``qerl.console`` logger instead.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

LOG_NAME = "run.log"
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
log = logging.getLogger("qerl.console")


def fmt_duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def step_text(metrics: dict[str, Any], seconds: float | None, cached: bool) -> str:
    """``reward 0.234  acc 0.250  412 tok/s  4.1 s`` for one step's record."""
    parts = [f"reward {metrics.get('reward_mean', float('nan')):.3f}", f"acc {metrics.get('accuracy', float('nan')):.3f}"]  # fmt: skip
    rate = metrics.get("rollout_tokens_per_s")
    if isinstance(rate, int | float):
        parts.append(f"{rate:.0f} tok/s")
    parts.append("cached" if cached else f"{seconds:.1f} s" if seconds is not None else "")
    return "  ".join(p for p in parts if p)


class RunConsole:
    """What the flow reports; this base class logs the lines (no terminal is watching)."""

    def __init__(self) -> None:
        self.steps_total = 0
        self.steps_done = 0
        self.evals_left = 0
        self._step_times: list[float] = []
        self._eval_times: list[float] = []

    # -- the flow's hooks -----------------------------------------------------------------------
    def stage(self, name: str, detail: str, seconds: float | None = None, cached: bool = False) -> None:
        if name == "evaluate" and seconds is not None and not cached:
            self._eval_times.append(seconds)
        if name == "evaluate":
            self.evals_left = max(0, self.evals_left - 1)
        when = "cached" if cached else fmt_duration(seconds) if seconds is not None else ""
        self.line(f"{name:<11} {detail}" + (f"  ({when})" if when else ""))

    def steps_start(self, total: int, evals: int) -> None:
        self.steps_total, self.steps_done, self.evals_left = total, 0, evals

    def step(self, step: int, metrics: dict[str, Any], seconds: float, cached: bool) -> None:
        self._account(step, seconds, cached)
        self.line(self._step_line(step, metrics, seconds, cached))

    def _account(self, step: int, seconds: float, cached: bool) -> None:
        self.steps_done = step + 1
        if not cached:
            self._step_times.append(seconds)

    def _step_line(self, step: int, metrics: dict[str, Any], seconds: float, cached: bool) -> str:
        width = len(str(self.steps_total))
        eta = fmt_duration(self.eta())
        return (
            f"step {step + 1:>{width}}/{self.steps_total}  {step_text(metrics, seconds, cached)}  ETA {eta}"
        )

    def steps_end(self) -> None:
        pass

    def line(self, text: str) -> None:
        log.info(text)

    # -- estimates ------------------------------------------------------------------------------
    def eta(self) -> float | None:
        """Seconds left in the run: steps at their mean built time (the first left out once there are
        more: it includes the engine's start-up), evaluations at theirs (or a step's)."""
        if not self._step_times:
            return None
        times = self._step_times[1:] or self._step_times  # the first built step also starts the engine
        per_step = sum(times) / len(times)
        per_eval = sum(self._eval_times) / len(self._eval_times) if self._eval_times else per_step
        return (self.steps_total - self.steps_done) * per_step + self.evals_left * per_eval


class TerminalConsole(RunConsole):
    """Lines and a tqdm bar on ``stream`` (the terminal); a line every tenth of the run without a TTY."""

    def __init__(self, stream: IO[str]):
        super().__init__()
        self.stream = stream
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self._bar: Any = None

    def line(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        else:
            self.stream.write(text + "\n")
            self.stream.flush()

    def steps_start(self, total: int, evals: int) -> None:
        super().steps_start(total, evals)
        if self.tty:
            from tqdm import tqdm

            fmt = "{desc} {percentage:3.0f}%|{bar:20}| {n_fmt}/{total_fmt} [{elapsed}]{postfix}"
            self._bar = tqdm(
                total=total, file=self.stream, desc="steps", bar_format=fmt, dynamic_ncols=True, disable=False
            )

    def step(self, step: int, metrics: dict[str, Any], seconds: float, cached: bool) -> None:
        self._account(step, seconds, cached)
        if self._bar is None:  # no terminal: the first, every tenth of the run, and the last step
            every = max(1, math.ceil(self.steps_total / 10))
            if step == 0 or (step + 1) % every == 0 or step + 1 == self.steps_total:
                self.line(self._step_line(step, metrics, seconds, cached))
            return
        self._bar.set_postfix_str(f"{step_text(metrics, seconds, cached)}  ETA {fmt_duration(self.eta())}")
        self._bar.update(step + 1 - self._bar.n)

    def steps_end(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


_ACTIVE: RunConsole | None = None


def current() -> RunConsole:
    """The console the flow reports to: the session's, else a logging one."""
    return _ACTIVE if _ACTIVE is not None else RunConsole()


class _ConsoleFilter(logging.Filter):
    """Our own warnings, and errors of anyone: the rest is in run.log."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == log.name:  # the console's own lines are printed directly
            return False
        own = record.name.split(".", 1)[0] == "qerl"
        return record.levelno >= (logging.WARNING if own else logging.ERROR)


class _ConsoleHandler(logging.Handler):
    def __init__(self, console: TerminalConsole):
        super().__init__(logging.WARNING)
        self.console = console
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        self.addFilter(_ConsoleFilter())

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.console.line(self.format(record))
        except Exception:  # noqa: BLE001 - logging must not raise into the run
            self.handleError(record)


@contextlib.contextmanager
def session(run_dir: Path, verbose: bool = False) -> Iterator[TerminalConsole]:
    """Open the console for one run (see the module docstring); yields it for the final summary."""
    global _ACTIVE
    run_dir.mkdir(parents=True, exist_ok=True)
    log_path = run_dir / LOG_NAME
    root = logging.getLogger()
    for handler in list(root.handlers):  # basicConfig's, bound to the terminal
        root.removeHandler(handler)
    logfile = open(log_path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - lives until exit
    file_handler = logging.StreamHandler(logfile)
    file_handler.setFormatter(logging.Formatter(FORMAT))
    root.addHandler(file_handler)
    logging.captureWarnings(True)
    if verbose:
        console = TerminalConsole(sys.stderr)
        terminal = logging.StreamHandler(sys.stderr)
        terminal.setFormatter(logging.Formatter(FORMAT))
        root.addHandler(terminal)
        root.setLevel(logging.DEBUG)
    else:
        sys.stdout.flush()
        sys.stderr.flush()
        term_out = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
        term_err = os.fdopen(os.dup(2), "w", buffering=1, encoding="utf-8")
        os.dup2(logfile.fileno(), 1)
        os.dup2(logfile.fileno(), 2)
        sys.stdout, sys.stderr = logfile, logfile
        console = TerminalConsole(term_err)
        root.addHandler(_ConsoleHandler(console))
        root.setLevel(logging.INFO)
        _quiet_libraries()
    _ACTIVE = console
    started = time.perf_counter()
    try:
        yield console
    finally:
        console.steps_end()
        _ACTIVE = None
        log.info("console session closed after %s", fmt_duration(time.perf_counter() - started))
        if not verbose:
            # Python-level output (the summary, an error message) is for people again; the file
            # descriptors stay on run.log for what libraries and child processes write until exit.
            sys.stdout, sys.stderr = term_out, term_err


def _quiet_libraries() -> None:
    """Settings that keep libraries' own console output out of the terminal (they go to run.log)."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # their \r-redrawn bars would bloat run.log
