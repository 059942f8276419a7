"""``qerl ablate --ray``: the rules checked before anything starts (fast), and a 2x2 ablation on a
local Ray head (slow): the runs execute in Ray worker processes, the report is written, and the same
command again rebuilds nothing.

The Ray head listens on loopback only: ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` makes Ray take
127.0.0.1 as the node address (else it replaces a loopback ``--node-ip-address`` by the machine's
address and its servers listen on every interface). It runs in its own process group, stopped by
that group at teardown (``ray stop`` would stop every Ray instance of the machine)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import pytest
from qerl.flows.ray import connection, rules


# ---- the rules -------------------------------------------------------------------------------------
def test_addresses_are_local_or_remote_by_host(monkeypatch):
    assert rules.address_is_remote("127.0.0.1:6379") is False
    assert rules.address_is_remote("ray://localhost:10001") is False
    assert rules.address_is_remote("[::1]:6379") is False
    assert rules.address_is_remote("local") is False
    assert rules.address_is_remote("auto") is None  # known after connecting
    assert rules.address_is_remote("10.1.2.3:6379") is True
    assert rules.address_is_remote("ray://head.cluster:10001") is True
    monkeypatch.setenv(rules.ADDRESS_ENV, "10.1.2.3:6379")
    assert rules.resolve_address(None) == "10.1.2.3:6379"
    assert rules.resolve_address("127.0.0.1:6379") == "127.0.0.1:6379"  # --ray wins
    monkeypatch.setenv(rules.ADDRESS_ENV, " ")
    assert rules.resolve_address(None) is None


def test_settings_a_remote_cluster_cannot_use_are_refused_with_what_to_change():
    remote, api, pg = (
        "10.1.2.3:6379",
        "http://10.1.2.4:4200/api",
        "postgresql+psycopg://u:p@10.1.2.5:5432/mlflow",
    )
    with pytest.raises(rules.FanoutError, match="not an absolute path"):
        rules.check_settings("127.0.0.1:6379", "qerl-work", "sqlite:////w/mlflow.db", None, remote=False)
    with pytest.raises(rules.FanoutError, match="sqlite file.*postgresql\\+psycopg"):
        rules.check_settings(remote, "/shared/w", "sqlite:////shared/w/mlflow.db", api, remote=True)
    with pytest.raises(rules.FanoutError, match="loopback"):
        rules.check_settings(
            remote, "/shared/w", "postgresql+psycopg://u:p@localhost/mlflow", api, remote=True
        )
    with pytest.raises(rules.FanoutError, match="loopback"):
        rules.check_settings(remote, "/shared/w", "http://127.0.0.1:5000", api, remote=True)
    with pytest.raises(rules.FanoutError, match="set PREFECT_API_URL"):
        rules.check_settings(remote, "/shared/w", pg, None, remote=True)
    with pytest.raises(rules.FanoutError, match="PREFECT_API_URL.*loopback"):
        rules.check_settings(remote, "/shared/w", pg, "http://127.0.0.1:4200/api", remote=True)
    rules.check_settings(remote, "/shared/w", pg, api, remote=True)
    rules.check_settings(remote, "/shared/w", "https://mlflow.cluster:5000", api, remote=True)
    # a local cluster: local paths and the embedded sqlite registry are fine, no Prefect server needed
    rules.check_settings("127.0.0.1:6379", "/w", "sqlite:////w/mlflow.db", None, remote=False)


def test_a_dead_ray_address_fails_at_once():
    port = _free_port()  # bound and closed: nothing listens there
    t0 = time.monotonic()
    with pytest.raises(rules.FanoutError, match=f"nothing answers at the Ray address 127.0.0.1:{port}"):
        rules.check_reachable(f"127.0.0.1:{port}")
    assert time.monotonic() - t0 < 10
    with pytest.raises(rules.FanoutError, match="not a Ray address"):
        rules.check_reachable("127.0.0.1:notaport")
    rules.check_reachable("auto")  # left to Ray


class _RefusingRay:
    """A ``ray`` module whose ``init`` is refused by the head ``refusals`` times, as a Ray Client
    server that fails to start is (``ConnectionAbortedError``), then connects."""

    def __init__(self, refusals: int):
        self.refusals, self.inits, self.shutdowns = refusals, 0, 0

    def init(self, address: str, namespace: str, runtime_env: dict, log_to_driver: bool) -> None:
        assert not log_to_driver  # each run has its own run.log; Ray's log printer races the shutdown
        self.inits += 1
        if self.inits <= self.refusals:
            raise ConnectionAbortedError(
                "Initialization failure from server:\nTraceback ...\nRuntimeError: Starting Ray client "
                "server failed. See ray_client_server_23000.err for detailed logs."
            )

    def shutdown(self) -> None:
        self.shutdowns += 1


def test_a_ray_client_connection_refused_by_the_head_is_retried_and_then_named(monkeypatch, caplog):
    monkeypatch.setattr(connection, "CLIENT_RETRY_S", 0.0)
    ray = _RefusingRay(refusals=2)
    # the retry is said on the console (no console session here: the qerl.console logger) and the
    # refusal on qerl.fanout; both below qerl's level, whatever an earlier test of this worker left it at
    with caplog.at_level("INFO", logger="qerl"):
        connection.connect(ray, "ray://127.0.0.1:10001", {})
    assert ray.inits == 3 and ray.shutdowns == 2
    assert (
        "retrying in 0 s (attempt 3 of 3)" in caplog.text
        and "Starting Ray client server failed" in caplog.text
    )
    ray = _RefusingRay(refusals=3)
    with pytest.raises(
        rules.FanoutError, match="refused the connection 3 times.*ray_client_server_23000.err"
    ):
        connection.connect(ray, "ray://127.0.0.1:10001", {})
    assert ray.inits == 3
    ray = _RefusingRay(refusals=1)  # a GCS address has no per-connection server: no retry
    with pytest.raises(rules.FanoutError, match="cannot connect to the Ray cluster at 127.0.0.1:6379"):
        connection.connect(ray, "127.0.0.1:6379", {})
    assert ray.inits == 1


def test_the_cli_refuses_a_remote_cluster_with_the_sqlite_registry_before_the_flow(
    monkeypatch, capsys, tmp_path
):
    from qerl.flows import cli, orchestration

    monkeypatch.setattr(orchestration, "prepare_environment", lambda work: None)  # no Prefect settings here
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    args = ["ablate", "--arms", "bf16-lora,nvfp4-aqn", "--seeds", "1", "--work-dir", str(tmp_path)]
    assert cli.main([*args, "--ray", "10.1.2.3:6379"]) == 2
    err = capsys.readouterr().err
    assert "sqlite file" in err and "postgresql+psycopg" in err
    monkeypatch.setenv(rules.ADDRESS_ENV, "10.1.2.3:6379")  # the environment's address: the same check
    assert cli.main(args) == 2 and "sqlite file" in capsys.readouterr().err
    assert not (tmp_path / "ablations").exists()  # nothing started


# ---- on a local Ray head ---------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _client_server_logs(temp: Path) -> str:
    """The tails of the head's Ray Client server logs: the reason a ``ray://`` connection failed is
    there, and the fixture deletes the directory at teardown."""
    tails = [
        f"--- {f.name}:\n{f.read_text(errors='replace')[-1500:]}"
        for f in sorted(temp.glob("session_*/logs/ray_client_server*"))
        if f.is_file() and f.stat().st_size
    ]
    return "\n".join(tails) or f"(no Ray Client server logs under {temp})"


@pytest.fixture
def ray_head(monkeypatch):
    """A Ray head on 127.0.0.1 with 2 CPUs in its own process group; yields its GCS address
    (``host:port``), its Ray Client address (``ray://host:port``) and a function returning the tails
    of the Ray Client server's logs (for failure messages)."""
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # node address 127.0.0.1 (module docstring)
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    temp = Path(tempfile.mkdtemp(prefix="qerl-ray-", dir="/tmp"))  # short: Ray's socket paths have a limit
    port, client_port = _free_port(), _free_port()
    ray = Path(sys.executable).parent / "ray"
    cmd = [
        str(ray), "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(port),
        "--num-cpus", "2", "--num-gpus", "0", "--include-dashboard", "false", "--disable-usage-stats",
        "--temp-dir", str(temp), "--ray-client-server-port", str(client_port),
    ]  # fmt: skip
    log = open(temp / "head.log", "w")  # noqa: SIM115 - closed at teardown
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while "Ray runtime started" not in (temp / "head.log").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, (temp / "head.log").read_text()[
                -3000:
            ]
            time.sleep(0.5)
        yield f"127.0.0.1:{port}", f"ray://127.0.0.1:{client_port}", lambda: _client_server_logs(temp)
    finally:
        # SIGTERM lets the head stop its processes; what is left after a few seconds is killed: a
        # blocked `ray start` otherwise waits out the whole grace period
        for sig, grace in ((signal.SIGTERM, 4), (signal.SIGKILL, 15)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=grace)
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_ablate_on_a_local_ray_head_runs_in_workers_and_resumes_without_rebuilding(
    ray_head, learner_model_dir, tmp_path
):
    """Every worker is killed in its second train build (QERL_FAULT reaches the workers: the driver
    forwards QERL_*); the ablation fails naming the four runs; the same command, through the head's
    Ray Client address (``ray://``) this time, resumes them without rebuilding a finished stage (a completed ablation re-run builds nothing: test_ablation's sequential
    kill-and-resume test shows it; the same store lookups run here)."""
    from tests.flows.test_ablation import tiny_ablation_config
    from tests.flows.test_flow import _journal, _qerl

    path = tiny_ablation_config(learner_model_dir, tmp_path)
    work = tmp_path / "work"
    # one seed: two runs in two workers show the fan-out; test_ablation covers two seeds in sequence
    args = ["ablate", "--config", str(path), "--arms", "bf16-lora,nvfp4-aqn", "--seeds", "1"]
    gcs, client, client_server_logs = ray_head
    args += ["--bootstrap", "200"]
    killed = _qerl([*args, "--ray", gcs], work, fault="train:2")
    assert killed.returncode == 2, (killed.returncode, killed.stderr[-4000:])
    assert killed.stderr.count(" FAILED: arm ") == 2 and "2 of 2 runs failed" in killed.stderr, killed.stderr[
        -3000:
    ]
    (record_path,) = (work / "ablations").glob("*/ablation.json")
    assert json.loads(record_path.read_text())["status"] == "failed"
    assert Counter(e["stage"] for e in _journal(work))["train"] == 2  # each run's first step survived

    proc = _qerl([*args, "--ray", client], work)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:], client_server_logs())
    record = json.loads(record_path.read_text())
    assert record["status"] == "completed", record.get("error")
    assert record["ray"]["address"] == client and record["ray"]["num_cpus"] == 1
    workers = [r["worker"] for r in record["runs"]]
    assert len(workers) == 2 and all(w["pid"] != record["driver"]["pid"] for w in workers)
    assert len({w["pid"] for w in workers}) == 2  # a fresh worker process per run (max_calls=1)
    for r in record["runs"]:
        rec = json.loads((work / "runs" / r["run_id"] / "run.json").read_text())
        assert rec["status"] == "completed" and rec["ablation"]["arm"] == r["arm"]
        assert "step 2/2" in (work / "runs" / r["run_id"] / "run.log").read_text()  # the run's own console
    assert "## Verdict" in (record_path.parent / "report.md").read_text()
    # the driver's console: one line per finished run, not the runs' stage lines
    assert proc.stderr.count(" done: arm ") == 2 and "step 1/2" not in proc.stderr, proc.stderr[-3000:]
    built = Counter((e["stage"], e["key"]) for e in _journal(work))
    assert max(built.values()) == 1, [k for k, n in built.items() if n > 1]  # the resume rebuilt nothing
    assert Counter(s for s, _ in built)["train"] == 4 and Counter(s for s, _ in built)["register"] == 2
