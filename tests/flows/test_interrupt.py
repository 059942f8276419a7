"""Stopping a run from outside: Ctrl-C (SIGINT to the terminal's process group) ends it promptly with
its crash reported, and the run's own Prefect server never outlives qerl, not even a SIGKILLed qerl.

A server that shared the terminal's process group would stop with qerl on Ctrl-C, and Prefect would
then retry the crash report against the dead server for about 3.5 minutes, ending in connection
tracebacks; a SIGKILLed qerl left such a server running (``qerl.flows.orchestration``)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml


def _servers(work: Path) -> list[int]:
    """Pids of live Prefect servers (a run's own, ``prefect server start``) whose PREFECT_HOME is this
    work dir's."""
    home = f"PREFECT_HOME={work / 'prefect'}".encode()
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            server = b"prefect.server.api.server:create_app" in cmdline or cmdline[1:5] == [
                b"-m",
                b"prefect",
                b"server",
                b"start",
            ]
            if server and home in (proc / "environ").read_bytes().split(b"\0"):
                state = next(
                    line for line in (proc / "status").read_text().splitlines() if line.startswith("State:")
                )
                if "zombie" not in state:
                    pids.append(int(proc.name))
        except (OSError, ValueError, StopIteration):
            continue
    return pids


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(cfg_path: Path, work: Path, fault: str | None = None) -> tuple[subprocess.Popen, Path]:
    # PREFECT_*: in-process flows of earlier tests set PREFECT_HOME here (prepare_environment)
    from prefect_home import seeded_env

    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")} | {"QERL_WORK_DIR": str(work)}
    env = seeded_env(env, work)
    for key in ("QERL_FAULT", "TRITON_INTERPRET", "VLLM_ENABLE_V1_MULTIPROCESSING"):
        env.pop(key, None)
    if fault:
        env["QERL_FAULT"] = fault
    err_path = work / f"cli-{fault or 'run'}.err"
    with open(err_path, "w") as err:  # the terminal's process group: its own session here
        cmd = [sys.executable, "-m", "qerl.flows.cli", "run", "--config", str(cfg_path)]
        # SIGINT as a terminal's foreground command has it: a runner launched in the background
        # (`make test &`) passes SIGINT on ignored, and the Ctrl-C test would then see a completed run
        proc = subprocess.Popen(
            cmd, env=env, stdout=err, stderr=err, start_new_session=True, preexec_fn=_default_sigint
        )
    return proc, err_path


def _tiny_run(tiny_model_factory, tmp_path: Path, steps: int) -> tuple[Path, Path]:  # noqa: ANN001
    """A tiny fp32 run of ``steps`` steps on the HF engine: its config file and an empty work dir."""
    from tests.flows.test_flow import tiny_run_config

    model = tiny_model_factory(arch="qwen2", dtype=torch.float32)
    cfg = tiny_run_config(model, engine="hf")
    cfg["loop"].update(steps=steps)
    cfg["train"].update(total_steps=steps)
    cfg_path = tmp_path / "run.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    work = tmp_path / "work"
    work.mkdir()
    return cfg_path, work


def _wait_for(predicate, timeout_s: float, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def test_qerl_run_sets_prefects_environment_before_prefect_reads_it(tmp_path):
    """Prefect reads its settings once, at import: ``qerl run`` once imported it before setting
    PREFECT_HOME and the 180 s server start-up budget, so the temporary server had Prefect's default
    20 s, too little on a loaded 2-core machine. The command line sets them before it imports the
    command's module."""
    probe = tmp_path / "settings.txt"
    code = (
        "import sys\n"
        "from qerl.flows import cli, orchestration\n"
        "def fake_api(*args):\n"
        "    from prefect.settings import PREFECT_HOME as H, PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS as T\n"
        "    open(sys.argv[2], 'w').write(f'{H.value()} {T.value()}')\n"
        "    raise SystemExit(0)\n"
        "orchestration.use_api = fake_api\n"
        "sys.exit(cli.main(['run', '--work-dir', sys.argv[1]]))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    work = tmp_path / "work"
    proc = subprocess.run(
        [sys.executable, "-c", code, str(work), str(probe)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert probe.read_text() == f"{work / 'prefect'} 180"


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="/proc and the parent-death signal are Linux's"
)
def test_ctrl_c_ends_a_run_promptly_and_the_temporary_server_never_outlives_qerl(
    tiny_model_factory, tmp_path
):
    from tests.flows.test_flow import _journal

    cfg_path, work = _tiny_run(tiny_model_factory, tmp_path, steps=40)

    def trained() -> int:
        return sum(e["stage"] == "train" for e in _journal(work))

    proc, err_path = _start(cfg_path, work)
    try:
        _wait_for(lambda: trained() >= 1 or proc.poll() is not None, 600, "no train step within 10 min")
        assert proc.poll() is None, err_path.read_text()[-3000:]
        assert _servers(work), "the run has no temporary server of its own"
        stopped_at = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        code = proc.wait(timeout=170)  # Prefect's retries against a dead server took about 210 s
        waited = time.monotonic() - stopped_at
        print(f"Ctrl-C to exit: {waited:.1f} s")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    (log_path,) = (work / "runs").glob("*/run.log")
    said = err_path.read_text() + log_path.read_text()
    assert code != 0 and trained() < 40, (code, said[-3000:])
    for symptom in ("Connection refused", "Error logging to API", "All connection attempts failed"):
        assert symptom not in said, (symptom, waited, said[-3000:])
    _wait_for(lambda: not _servers(work), 15, "the temporary server outlived a Ctrl-C'd qerl")
    (record_path,) = (work / "runs").glob("*/run.json")
    assert json.loads(record_path.read_text())["status"] == "failed"  # resumable like any failed run

    # qerl killed outright (SIGKILL of its own pid: no atexit runs) takes its server with it
    proc, err_path = _start(cfg_path, work, fault="train:2")
    try:
        code = proc.wait(timeout=600)
        assert code == -signal.SIGKILL, (code, err_path.read_text()[-3000:])
        _wait_for(lambda: not _servers(work), 15, "the temporary server outlived a SIGKILLed qerl")
    finally:
        with contextlib.suppress(ProcessLookupError):  # the group is empty when all went well
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux's")
def test_a_run_that_loses_its_prefect_server_ends_with_its_own_outcome_in_seconds(
    tiny_model_factory, tmp_path
):
    """The temporary Prefect server killed after the first train step: the run still trains,
    registers and records ``completed``, exits 0 within seconds of registering, and the console shows
    no traceback (Prefect's retries against the dead server, at exit too, are cut short)."""
    from tests.flows.test_flow import _journal

    cfg_path, work = _tiny_run(tiny_model_factory, tmp_path, steps=4)
    proc, err_path = _start(cfg_path, work)
    try:
        _wait_for(
            lambda: any(e["stage"] == "train" for e in _journal(work)) or proc.poll() is not None,
            600,
            "no train step within 10 min",
        )
        assert proc.poll() is None, err_path.read_text()[-3000:]
        for pid in _servers(work):
            os.kill(pid, signal.SIGKILL)
        code = proc.wait(timeout=420)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    (record_path,) = (work / "runs").glob("*/run.json")
    record = json.loads(record_path.read_text())
    said = err_path.read_text()
    assert record["status"] == "completed" and record["registration"]["version"], record
    assert code == 0, said[-3000:]
    assert "Traceback" not in said and "Error logging to API" not in said, said[-3000:]
    assert "stopped answering" in said and "Prefect's record of flow run" in said, said[-3000:]
    assert len(said.splitlines()) < 40, said
    (log_path,) = (work / "runs").glob("*/run.log")
    ended = [line for line in log_path.read_text().splitlines() if "console session closed" in line]
    registered = [
        line for line in log_path.read_text().splitlines() if "qerl.stages.register: register:" in line
    ]
    stamp = lambda line: time.mktime(time.strptime(line[:19], "%Y-%m-%d %H:%M:%S"))  # noqa: E731
    # the two state proposals Prefect makes after the flow (2 retries each) are all the loss costs
    assert stamp(ended[-1]) - stamp(registered[-1]) < 90, (registered, ended)
