"""The console of qerl's commands: a few lines for people, everything else in a log file.

What the terminal shows: one line per stage outside the step loop (base, quantize, twin, data,
warm start, each evaluation, registration), one progress bar over the RL steps whose postfix holds
the last step's rollout tokens/s, reward, accuracy and step time plus an ETA for the whole run, then
the summary, last. Warnings of qerl's own modules and errors of any library are shown as well, one
line each (another library's message by its first line, a traceback as a pointer to ``run.log``).
Without a terminal (a pipe, CI, a test) the bar becomes a line every tenth of the run. A long stage
that reports items done (an evaluation: ``progress``) gets a bar of its own, or without a terminal a
line at each further quarter, with its own ETA.

The run's ETA counts what is left at the rate of the steps and evaluations built so far, each with
its one-time start-up taken out (``startup``: the rollout engine's start, the trainer's first load
of the policy), and leaves out the first built step of the process, whose time also holds the
first calls' compilation: so no estimate spreads one-time costs over every step. After the first
built step it shows ``?``.

Where the rest goes: a run's ``<work>/runs/<run-id>/run.log``, or a one-shot command's
``<work>/logs/<command>-<time>-<pid>.log`` (``qerl eval``, ``qerl quantize``). ``session`` points file
descriptors 1 and 2 at that file, so vLLM's engine-core and worker processes (which inherit them), C
extensions, tqdm bars of libraries, Python warnings and the run's Prefect server all write there, and
the console keeps its own duplicate of the original stderr. The root logger gets the file's handler
before Prefect is imported: Prefect then keeps it (it installs its own console handler only on a bare
root logger), and its loggers, httpx's request lines and MLflow's propagate into the file. A run keeps
the descriptors on its log until the process exits; a one-shot command gets them back when its work
ends and prints its result. ``-v`` shows every log line on the terminal, and writes the log too.

The flow reports through ``current()``; when no session is open (a deployment run under
``qerl schedule``) the same lines go to the ``qerl.console`` logger instead, and ``attach_run_log``
(called by the flow) gives that run its ``run.log`` all the same: a root handler on the file for the
flow's duration, with qerl's loggers at INFO, so the console's lines, qerl's and Prefect's flow-run
logs and the error that ends a night are there as after ``qerl run``.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

LOG_NAME = "run.log"
LOGS_DIR = "logs"
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
log = logging.getLogger("qerl.console")


def fmt_duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def step_text(metrics: dict[str, Any], seconds: float | None, cached: bool, startup: float = 0.0) -> str:
    """``reward 0.234  acc 0.250  412 tok/s  4.1 s`` for one step's record; a step that started the
    rollout engine or loaded the policy says how much of its time that took (a GPU engine compiles
    and captures its graphs first), so that a slow first step is not read as a slow step."""
    parts = [
        f"reward {metrics.get('reward_mean', float('nan')):.3f}",
        f"acc {metrics.get('accuracy', float('nan')):.3f}",
    ]
    rate = metrics.get("rollout_tokens_per_s")
    if isinstance(rate, int | float):
        parts.append(f"{rate:.0f} tok/s")
    parts.append(
        "cached" if cached else f"{seconds:.1f} s{_startup_text(startup)}" if seconds is not None else ""
    )
    return "  ".join(p for p in parts if p)


def _startup_text(startup: float) -> str:
    """`` (start-up 70.2 s)`` when a second or more went to one-time start-up (the engine, the policy), else nothing."""
    return f" (start-up {startup:.1f} s)" if startup >= 1.0 else ""


class RunConsole:
    """What the flow reports; this base class logs the lines (no terminal is watching)."""

    def __init__(self) -> None:
        self.steps_total = 0
        self.steps_done = 0
        self.evals_left = 0
        self._step_times: list[float] = []
        self._eval_times: list[float] = []
        self._progress: _Progress | None = None

    # -- the flow's hooks -----------------------------------------------------------------------
    def stage(
        self, name: str, detail: str, seconds: float | None = None, cached: bool = False, startup: float = 0.0
    ) -> None:
        """A stage's line; ``startup``: seconds of ``seconds`` that were one-time start-up (not its work)."""
        self.end_progress()
        if name == "evaluate" and seconds is not None and not cached:
            self._eval_times.append(max(0.0, seconds - startup))
        if name == "evaluate":
            self.evals_left = max(0, self.evals_left - 1)
        when = "cached" if cached else fmt_duration(seconds) if seconds is not None else ""
        if when and not cached and startup >= 1.0:
            when += f", start-up {fmt_duration(startup)}"
        self.line(f"{name:<11} {detail}" + (f"  ({when})" if when else ""))

    def steps_start(self, total: int, evals: int) -> None:
        self.steps_total, self.steps_done, self.evals_left = total, 0, evals

    def step(
        self, step: int, metrics: dict[str, Any], seconds: float, cached: bool, startup: float = 0.0
    ) -> None:
        """Step ``step`` done in ``seconds`` (shown), ``startup`` of them one-time start-up (not in the ETA)."""
        self._account(step, seconds, cached, startup)
        self.line(self._step_line(step, metrics, seconds, cached, startup))

    def _account(self, step: int, seconds: float, cached: bool, startup: float = 0.0) -> None:
        self.steps_done = step + 1
        if not cached:
            self._step_times.append(max(0.0, seconds - startup))

    def progress(self, name: str, done: int, total: int, unit: str = "items") -> None:
        """``done`` of ``total`` items (or another ``unit``) of the running stage ``name`` (its own line
        ends it): a line at each further quarter."""
        state = self._progress_state(name, total, unit)
        quarter = 4 * done // max(total, 1)
        if done < total and quarter > state.shown:
            state.shown = quarter
            self.line(state.text(done))

    def _progress_state(self, name: str, total: int, unit: str) -> _Progress:
        if self._progress is None or self._progress.name != name or self._progress.total != total:
            self.end_progress()
            self._progress = _Progress(name, total, time.perf_counter(), unit)
        return self._progress

    def end_progress(self) -> None:
        """The running stage's progress is over (its bar, if any, goes)."""
        self._progress = None

    def _step_line(
        self, step: int, metrics: dict[str, Any], seconds: float, cached: bool, startup: float = 0.0
    ) -> str:
        width = len(str(self.steps_total))
        text = step_text(metrics, seconds, cached, startup)
        return f"step {step + 1:>{width}}/{self.steps_total}  {text}  ETA {fmt_duration(self.eta())}"

    def steps_end(self) -> None:
        pass

    def line(self, text: str) -> None:
        log.info(text)

    # -- estimates ------------------------------------------------------------------------------
    def eta(self) -> float | None:
        """Seconds left in the run: steps at the mean time of those built after the process's first,
        evaluations at theirs (or a step's), start-up left out of both. None (shown as ``?``) until a
        second step is built: the first also compiles (vLLM's graphs, numba's and torch's kernels on
        their first call), which no later step repeats."""
        warm = self._step_times[1:]
        if not warm:
            return None
        per_step = sum(warm) / len(warm)
        per_eval = sum(self._eval_times) / len(self._eval_times) if self._eval_times else per_step
        return (self.steps_total - self.steps_done) * per_step + self.evals_left * per_eval


class _Progress:
    """One stage's progress over its items: where it started, the last quarter shown, a bar."""

    def __init__(self, name: str, total: int, started: float, unit: str = "items"):
        self.name, self.total, self.started, self.shown, self.unit = name, total, started, 0, unit
        self.bar: Any = None

    def text(self, done: int) -> str:
        elapsed = time.perf_counter() - self.started
        eta = elapsed * (self.total - done) / done if done else None
        return f"{self.name:<11} {done}/{self.total} {self.unit}  {fmt_duration(elapsed)}  ETA {fmt_duration(eta)}"

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class TerminalConsole(RunConsole):
    """Lines and a tqdm bar on ``stream`` (the terminal); a line every tenth of the run without a TTY."""

    def __init__(self, stream: IO[str]):
        super().__init__()
        self.stream = stream
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self._bar: Any = None

    def line(self, text: str) -> None:
        if self._bar is not None or (self._progress is not None and self._progress.bar is not None):
            from tqdm import tqdm

            tqdm.write(text, file=self.stream)  # above the open bars, which are redrawn below it
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

    def step(
        self, step: int, metrics: dict[str, Any], seconds: float, cached: bool, startup: float = 0.0
    ) -> None:
        self._account(step, seconds, cached, startup)
        if self._bar is None:  # no terminal: the first, every tenth of the run, and the last step
            every = max(1, math.ceil(self.steps_total / 10))
            if step == 0 or (step + 1) % every == 0 or step + 1 == self.steps_total:
                self.line(self._step_line(step, metrics, seconds, cached, startup))
            return
        self._bar.set_postfix_str(
            f"{step_text(metrics, seconds, cached, startup)}  ETA {fmt_duration(self.eta())}"
        )
        self._bar.update(step + 1 - self._bar.n)

    def steps_end(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def progress(self, name: str, done: int, total: int, unit: str = "items") -> None:
        if not self.tty:
            super().progress(name, done, total, unit)
            return
        state = self._progress_state(name, total, unit)
        if state.bar is None:
            from tqdm import tqdm

            fmt = (
                "{desc} {percentage:3.0f}%|{bar:20}| {n_fmt}/{total_fmt} " + unit + " [{elapsed}<{remaining}]"
            )
            state.bar = tqdm(total=total, file=self.stream, desc=name, bar_format=fmt, leave=False)
        state.bar.update(done - state.bar.n)

    def end_progress(self) -> None:
        if self._progress is not None:
            self._progress.close()
        super().end_progress()


def quantize_progress(ui: RunConsole) -> Callable[[int, int], None]:
    """The quantize stage's ``progress(done, total)`` on ``ui``: the tensors written."""

    def progress(done: int, total: int) -> None:
        ui.progress("quantize", done, total, "tensors")

    return progress


_ACTIVE: RunConsole | None = None


def current() -> RunConsole:
    """The console the flow reports to: the session's, else a logging one."""
    return _ACTIVE if _ACTIVE is not None else RunConsole()


def attach_run_log(run_dir: Path) -> Callable[[BaseException | None], None]:
    """Without a session (module docstring), log to ``<run_dir>/run.log`` until the returned function
    is called, with the error that ended the run if one did (Prefect logs it only after the flow
    function has returned); within a session, nothing (the session writes that file already)."""
    if _ACTIVE is not None:
        return lambda error=None: None
    run_dir.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(run_dir / LOG_NAME, encoding="utf-8")
    handler.setFormatter(logging.Formatter(FORMAT))
    handler.setLevel(logging.INFO)
    root, own = logging.getLogger(), logging.getLogger("qerl")
    level = own.level
    if own.getEffectiveLevel() > logging.INFO:
        own.setLevel(logging.INFO)
    root.addHandler(handler)

    def detach(error: BaseException | None = None) -> None:
        if error is not None:  # to the file alone: the process's other handlers get Prefect's report
            exc_info = (type(error), error, error.__traceback__)
            handler.handle(
                logging.LogRecord("qerl.flow", logging.ERROR, __file__, 0, "run failed", (), exc_info)
            )
        root.removeHandler(handler)
        handler.close()
        own.setLevel(level)

    return detach


class _ConsoleFilter(logging.Filter):
    """Our own warnings, and errors of anyone: the rest is in run.log."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == log.name:  # the console's own lines are printed directly
            return False
        if record.name in ("prefect.flow_runs", "prefect.task_runs") and record.getMessage().startswith(
            ("Encountered exception", "Finished in state Failed", "Task run failed with ")
        ):
            # a task's failure is healed or retried (the run goes on), or it ends the run, whose
            # command names the error in its own last line: a copy per Prefect layer is noise
            return False
        own = record.name.split(".", 1)[0] == "qerl"
        return record.levelno >= (logging.WARNING if own else logging.ERROR)


class _ConsoleHandler(logging.Handler):
    def __init__(self, console: TerminalConsole, log_name: str = LOG_NAME):
        super().__init__(logging.WARNING)
        self.console = console
        self.log_name = log_name
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        self.addFilter(_ConsoleFilter())

    def format(self, record: logging.LogRecord) -> str:
        """One record for people: qerl's message in full, another library's first line; a traceback
        never (it is in run.log), only a pointer to it."""
        text = f"{record.levelname} {record.name}: {record.getMessage()}"
        if record.name.split(".", 1)[0] != "qerl":
            text = text.split("\n", 1)[0]
        return text + (f"  (traceback in {self.log_name})" if record.exc_info or record.stack_info else "")

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.console.line(self.format(record))
        except Exception:  # noqa: BLE001 - logging must not raise into the run
            self.handleError(record)


def log_path(work: str | Path, command: str) -> Path:
    """``<work>/logs/<command>-<UTC time>-<pid>.log``: a one-shot command's log (``qerl eval``,
    ``qerl quantize``); invocations in one process within one second share theirs, appended."""
    stamp = _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    return Path(work) / LOGS_DIR / f"{command}-{stamp}-{os.getpid()}.log"


@contextlib.contextmanager
def session(path: Path, verbose: bool = False, keep_fds: bool = False) -> Iterator[TerminalConsole]:
    """The console of one command (module docstring): lines for people, the rest in ``path``.

    ``keep_fds``: file descriptors 1 and 2 stay on ``path`` until the process exits (a run: the
    engine's workers and Prefect's clients write there up to the end); else they, and logging, are
    given back when the session ends (a one-shot command prints its result after it, and an
    in-process caller gets its streams back)."""
    global _ACTIVE
    path.parent.mkdir(parents=True, exist_ok=True)
    root, own = logging.getLogger(), logging.getLogger("qerl")
    levels = root.level, own.level, [(h, h.level) for h in root.handlers]
    logfile = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - closed below, or at exit
    file_handler = logging.StreamHandler(logfile)
    file_handler.setFormatter(logging.Formatter(FORMAT))
    root.addHandler(file_handler)
    logging.captureWarnings(True)
    own.setLevel(logging.INFO)  # qerl's progress lines are the log's record, whatever the command set
    for handler, _ in levels[2]:  # basicConfig's, bound to the terminal: this session's handlers show it
        handler.setLevel(logging.CRITICAL + 1)
    saved = None
    if verbose:  # every line on the terminal too
        console, shown = TerminalConsole(sys.stderr), logging.StreamHandler(sys.stderr)
        shown.setFormatter(logging.Formatter(FORMAT))
        root.setLevel(logging.DEBUG)
    else:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        console = TerminalConsole(os.fdopen(os.dup(2), "w", buffering=1, encoding="utf-8"))
        shown = _ConsoleHandler(console, path.name)
        root.setLevel(logging.INFO)
        os.dup2(logfile.fileno(), 1)
        os.dup2(logfile.fileno(), 2)
        streams = sys.stdout, sys.stderr
        sys.stdout = sys.stderr = logfile  # Python-level writes too (tqdm bars of libraries)
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # \r-redrawn bars would bloat the log
    root.addHandler(shown)
    _ACTIVE = console
    started = time.perf_counter()
    try:
        yield console
    finally:
        console.end_progress()
        console.steps_end()
        _ACTIVE = None
        log.info("console session closed after %s", fmt_duration(time.perf_counter() - started))
        logfile.flush()
        if saved is not None and keep_fds:
            # Python-level output (the summary, an error message) is for people again; the descriptors
            # stay on the log for what libraries and child processes write until exit
            sys.stdout, sys.stderr = os.fdopen(saved[0], "w", buffering=1, encoding="utf-8"), console.stream
        elif saved is not None:
            sys.stdout, sys.stderr = streams
            for fd, target in zip(saved, (1, 2), strict=True):
                os.dup2(fd, target)
                os.close(fd)
            console.stream.close()
        if not keep_fds:
            for handler in (shown, file_handler):
                root.removeHandler(handler)
            logfile.close()
            logging.captureWarnings(False)
            root.setLevel(levels[0])
            own.setLevel(levels[1])
            for handler, was in levels[2]:
                handler.setLevel(was)
