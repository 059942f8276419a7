"""The console of ``qerl run``: lines for people on the terminal, libraries' chatter in run.log.

The end-to-end checks (a real CLI run, vLLM included) are in tests/flows/test_flow.py (``_assert_console``);
these are the fast ones: the session's routing in a child process, the filter, the step lines, the ETA.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from qerl.flows import console

SCRIPT = textwrap.dedent(
    """
    import logging, subprocess, sys
    from pathlib import Path
    from qerl.flows import console

    run_dir = Path(sys.argv[1])
    with console.session(run_dir / console.LOG_NAME, verbose=sys.argv[2] == "v", keep_fds=True) as ui:
        logging.getLogger("httpx").info("HTTP Request: GET /api/health")
        logging.getLogger("vllm.engine").info("Initializing a V1 LLM engine")
        logging.getLogger("prefect.task_runs").error("Task run failed: boom")
        logging.getLogger("qerl.runplan").warning("3 prompts dropped")
        print("a library printing to stdout")
        subprocess.run([sys.executable, "-c", "import sys; sys.stderr.write('child process chatter\\\\n')"])
        console.current().stage("quantize", "NVFP4", 1.0)
        console.current().steps_start(2, 1)
        console.current().step(0, {"reward_mean": 0.5, "accuracy": 0.25, "rollout_tokens_per_s": 100.0}, 2.0, False)
        console.current().step(1, {"reward_mean": 0.75, "accuracy": 0.5}, 2.0, False)
    print("RESULT LINE")
    """
)


def _session(tmp_path: Path, verbose: bool) -> tuple[subprocess.CompletedProcess, str]:
    run_dir = tmp_path / ("v" if verbose else "q") / "runs" / "r1"
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(run_dir), "v" if verbose else "q"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return proc, (run_dir / console.LOG_NAME).read_text()


def test_session_routes_chatter_to_run_log_and_keeps_lines_for_people(tmp_path):
    proc, log_text = _session(tmp_path, verbose=False)
    terminal = proc.stdout + proc.stderr
    for chatter in (
        "HTTP Request",
        "Initializing a V1 LLM engine",
        "a library printing",
        "child process chatter",
    ):
        assert chatter not in terminal, chatter
        assert chatter in log_text, chatter
    assert "ERROR prefect.task_runs: Task run failed: boom" in proc.stderr  # errors of anyone
    assert "WARNING qerl.runplan: 3 prompts dropped" in proc.stderr  # our own warnings
    assert "quantize" in proc.stderr and "step 2/2  reward 0.750  acc 0.500" in proc.stderr
    assert "step 1/2  reward 0.500  acc 0.250  100 tok/s  2.0 s  ETA ?" in proc.stderr  # compiled too
    assert "step 2/2  reward 0.750  acc 0.500  2.0 s  ETA 2s" in proc.stderr  # 1 eval left, at a step's 2 s
    assert proc.stdout.splitlines()[-1] == "RESULT LINE"


def test_verbose_session_brings_the_chatter_back(tmp_path):
    proc, log_text = _session(tmp_path, verbose=True)
    for chatter in (
        "HTTP Request",
        "Initializing a V1 LLM engine",
        "a library printing",
        "child process chatter",
    ):
        assert chatter in proc.stdout + proc.stderr, chatter
    assert "HTTP Request" in log_text  # and the file still has the log


def test_console_filter_passes_own_warnings_and_anyones_errors():
    keep = console._ConsoleFilter()

    def rec(name: str, level: int, msg: str = "m") -> logging.LogRecord:
        return logging.LogRecord(name, level, __file__, 1, msg, None, None)

    assert keep.filter(rec("qerl.engines", logging.WARNING))
    assert not keep.filter(rec("qerl.engines", logging.INFO))
    assert not keep.filter(rec("vllm.config", logging.WARNING))
    assert keep.filter(rec("vllm.engine", logging.ERROR))
    assert not keep.filter(rec("httpx", logging.INFO))
    # Prefect's copies of an error a task or the flow ended with: healed, retried, or named by the
    # command's own last line
    for name, msg in (
        (
            "prefect.task_runs",
            "Finished in state Failed('Task run encountered an exception DiskFullError: x')",
        ),
        ("prefect.task_runs", "Task run failed with exception: DiskFullError('x') - Retries are exhausted"),
        ("prefect.flow_runs", "Finished in state Failed('Flow run encountered an exception: x')"),
        ("prefect.flow_runs", "Encountered exception during execution: x"),
    ):
        assert not keep.filter(rec(name, logging.ERROR, msg)), msg
    assert keep.filter(rec("prefect.task_runs", logging.ERROR, "Crash detected! x"))


def test_eta_counts_built_steps_and_pending_evaluations_without_start_up():
    ui = console.RunConsole()
    ui.steps_start(10, 2)
    assert ui.eta() is None  # nothing measured yet
    ui.step(0, {}, 0.01, cached=True)  # cached steps do not count towards the rate
    ui.step(1, {}, 40.0, cached=False, startup=36.0)  # the first built step started the engine
    assert ui.eta() is None  # its 4 s of work also compiled: no rate yet
    assert "  40.0 s (start-up 36.0 s)  ETA ?" in ui._step_line(1, {}, 40.0, False, 36.0)
    assert "(start-up" not in ui._step_line(2, {}, 6.0, False, 0.2)  # a warm engine says nothing
    ui.step(2, {}, 6.0, cached=False)
    assert ui.eta() == 7 * 6.0 + 2 * 6.0  # the second built step's rate, the first left out
    ui.step(3, {}, 4.0, cached=False)
    assert ui.eta() == 6 * 5.0 + 2 * 5.0
    lines: list[str] = []
    ui.line = lines.append  # type: ignore[method-assign]
    ui.stage("evaluate", "adapter", 12.0, startup=2.0)
    assert ui.eta() == 6 * 5.0 + 1 * 10.0
    assert lines == ["evaluate    adapter  (12s, start-up 2s)"]
    assert console.fmt_duration(3725) == "1h02m" and console.fmt_duration(75) == "1m15s"


class _Lines(console.RunConsole):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def line(self, text: str) -> None:
        self.lines.append(text)


def test_evaluation_progress_is_a_line_per_quarter_or_a_bar_on_a_terminal():
    import io

    ui = _Lines()
    for done in (256, 512, 768, 1024, 1280, 1319):
        ui.progress("evaluate", done, 1319)
    assert [t.split()[:3] for t in ui.lines] == [["evaluate", "512/1319", "items"], ["evaluate", "768/1319", "items"],
                                                  ["evaluate", "1024/1319", "items"]]  # fmt: skip
    assert all("ETA" in t for t in ui.lines)
    ui.stage("evaluate", "adapter after step 3: accuracy 0.5", 60.0)  # the stage's own line ends it
    ui.progress("evaluate", 700, 1319)  # the next evaluation starts afresh
    assert ui.lines[-1].startswith("evaluate    700/1319 items")

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    term = console.TerminalConsole(Tty())
    term.progress("evaluate", 100, 400)
    term.line("WARNING qerl.x: something")  # printed above the bar
    term.stage("evaluate", "done", 3.0)
    shown = term.stream.getvalue()
    assert "100/400 items" in shown and "WARNING qerl.x: something" in shown and "evaluate    done" in shown
    assert term._progress is None
    term.progress("quantize", 30, 211, "tensors")  # another stage counts in its own unit
    assert "/211 tensors" in term.stream.getvalue()  # tqdm draws the count when it next refreshes
    ui.progress("quantize", 110, 211, "tensors")
    assert ui.lines[-1].startswith("quantize    110/211 tensors")


def test_a_run_without_a_session_logs_to_its_run_log(tmp_path):
    """What a deployment run (``qerl schedule``, no console session) gets: ``run.log`` all the same."""
    detach = console.attach_run_log(tmp_path / "runs" / "r1")
    try:
        console.current().stage("quantize", "NVFP4 checkpoint", 1.0)
        logging.getLogger("qerl.flow").info("a qerl info line")
    finally:
        detach()
    logging.getLogger("qerl.flow").info("after the run")
    text = (tmp_path / "runs" / "r1" / console.LOG_NAME).read_text()
    assert "qerl.console: quantize" in text and "a qerl info line" in text and "after the run" not in text


@pytest.mark.slow
def test_a_failed_run_shows_its_error_in_one_line_and_is_not_retried(tmp_path):
    """A deterministic failure inside a task: the console names it in a line or two and points at
    run.log, which holds the traceback (issue 21 item 16: the console used to print 90-180 lines of
    Prefect's tracebacks above the one line that mattered)."""
    from tests.flows.test_flow import _qerl

    missing = tmp_path / "no-such-model"
    proc = _qerl(["run", "--set", f"model.source={missing}"], tmp_path / "work")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "run.log" in proc.stderr.splitlines()[0], proc.stderr
    assert len(proc.stderr.strip().splitlines()) <= 4, proc.stderr  # start, the failed task, the error
    assert proc.stderr.strip().splitlines()[-1].startswith("qerl run: error: model source")
    (log_path,) = (tmp_path / "work" / "runs").glob("*/run.log")
    assert (
        "Traceback (most recent call last)" in log_path.read_text()
        and "in base_model" in log_path.read_text()
    )
    assert log_path.read_text().count("not retried") == 1
    assert "Retry 1/2" not in log_path.read_text()


def test_runs_send_no_usage_data_and_print_no_telemetry_notice(tmp_path):
    """``prepare_environment`` turns Prefect's client telemetry off (DO_NOT_TRACK) as well as the
    server's, in a process whose environment says nothing about either."""
    import os
    import subprocess
    import sys

    code = (
        "import sys; from pathlib import Path; from qerl.flows import orchestration\n"
        "orchestration.prepare_environment(Path(sys.argv[1]))\n"
        "from prefect._internal.analytics.enabled import is_telemetry_enabled\n"
        "from prefect.settings import get_current_settings\n"
        "print(is_telemetry_enabled(), get_current_settings().server.analytics_enabled)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "DO_NOT_TRACK", "CI"))}
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "False"]
