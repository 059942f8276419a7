"""``qerl eval``'s console (``qerl.flows.console.session``): stage lines for people, the rest in a log
file, and the descriptors and logging given back when the command's work ends."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
from qerl.flows import console


def test_session_sends_what_child_processes_and_libraries_write_to_the_log(tmp_path, capfd):
    path = console.log_path(tmp_path, "eval")
    assert path.parent == tmp_path / "logs" and path.name.startswith("eval-")
    root = logging.getLogger()
    logging.getLogger("qerl").setLevel(logging.WARNING)  # as the CLI leaves it for most commands
    before = (root.level, list(root.handlers), [h.level for h in root.handlers])
    with console.session(path) as ui:
        ui.stage("base", "a checkpoint", 1.0)
        os.write(1, b"engine chatter on fd 1\n")
        subprocess.run(
            [sys.executable, "-c", "import sys; print('worker says hi', file=sys.stderr)"], check=True
        )
        logging.getLogger("qerl.stages.evaluate").info("evaluating 3 items")
        logging.getLogger("some.library").info("library detail")
        logging.getLogger("qerl.engines").warning("engine mode shown to people")
        logging.getLogger("some.library").error("a library's error\nwith a second line")
    os.write(2, b"after the session\n")  # the descriptors are the terminal's again
    out, err = capfd.readouterr()
    assert out == ""
    assert err.splitlines() == [
        "base        a checkpoint  (1s)",
        "WARNING qerl.engines: engine mode shown to people",
        "ERROR some.library: a library's error",
        "after the session",
    ]
    log = path.read_text()
    for line in ("engine chatter on fd 1", "worker says hi", "INFO qerl.stages.evaluate: evaluating 3 items",
                 "INFO some.library: library detail", "with a second line"):  # fmt: skip
        assert line in log, (line, log)
    assert (root.level, list(root.handlers), [h.level for h in root.handlers]) == before  # logging as it was
    assert logging.getLogger("qerl").level == logging.WARNING
    logging.getLogger("qerl").setLevel(logging.NOTSET)


def test_session_gives_the_descriptors_back_after_an_error(tmp_path, capfd):
    path = console.log_path(tmp_path, "eval")
    with pytest.raises(RuntimeError, match="boom"), console.session(path):
        os.write(2, b"inside\n")
        raise RuntimeError("boom")
    os.write(2, b"outside\n")
    assert capfd.readouterr().err == "outside\n"
    assert path.read_text().splitlines()[0] == "inside"


@pytest.mark.slow
def test_cli_eval_console_is_its_stage_lines_and_the_result(tiny_model_dir, tmp_path, capfd):
    """``qerl eval`` on the transformers engine: the terminal has its stage lines (with the quantize's
    progress, for a plain base), the log's path and the result; qerl's INFO lines are in the
    log file it names."""
    from qerl.flows.cli import main

    work = tmp_path / "work"
    argv = ["eval", "--base", str(tiny_model_dir), "--adapter", "none", "--benchmark", "arithmetic",
            "--engine", "hf", "--work-dir", str(work), "--set", "greedy=true", "--set", "benchmark.limit=2",
            "--set", "max_new_tokens=4"]  # fmt: skip
    assert main(argv) == 0
    out, err = capfd.readouterr()
    assert json.loads(out.strip().splitlines()[-1])["n_items"] == 2
    lines = [line for line in err.splitlines() if line.strip()]
    # the plain base is quantized: its progress is a line a quarter without a terminal
    progress = [line for line in lines if line.startswith("quantize") and " tensors" in line]
    assert progress and all("/27 tensors" in line for line in progress), err
    names = [line.split()[0] for line in lines if line not in progress]
    expected = ["base", "quantize", "adapter", "WARNING", "evaluate", "log:"]  # WARNING: the engine's mode
    assert names == expected, err
    assert "nats/token" not in err, err  # an evaluation runs no quality report: it needs none
    assert "WARNING qerl.engines: rollout engine mode hf-nvfp4-emulated" in err
    (log_file,) = (work / "logs").glob("eval-*.log")
    assert err.splitlines()[-1] == f"log: {log_file}"
    assert "INFO qerl.stages.evaluate: evaluating arithmetic/test@" in log_file.read_text()
    assert main(argv) == 0  # again: the checkpoint is a cache hit, with no progress
    again = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert [line.split()[0] for line in again] == expected
    assert again[1].startswith("quantize") and again[1].endswith("(cached)"), again
