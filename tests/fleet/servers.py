"""The fleet suite's Prefect and MLflow servers and its workers: real processes on loopback.

Each server runs in a process session of its own (``start_new_session``), so a restart or a kill
takes the whole of it; each worker ("machine") too, with its own work directory (its cache of the
shared store) and a logical GPU id: there are no GPUs here, the ids only name the GPU locks and
the fleet-wide slots.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_http(
    url: str, proc: subprocess.Popen, log: Path, timeout_s: float, auth: tuple | None = None
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"{url}: the server exited ({proc.returncode}); {log}:\n{log.read_text()[-3000:]}"
            )
        try:
            if httpx.get(url, timeout=2.0, auth=auth).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} did not answer in {timeout_s:g} s; {log}:\n{log.read_text()[-3000:]}")


def kill_session(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """Signal the whole process session of ``proc`` (a "machine" or a server with its children)."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


@dataclass
class Server:
    """A server process started by ``cmd`` in ``env``, answering ``health`` once up."""

    name: str
    cmd: list[str]
    env: dict[str, str]
    health: str
    log_path: Path
    start_s: float = 180.0
    auth: tuple | None = None
    proc: subprocess.Popen | None = None
    started_in_s: list[float] = field(default_factory=list)

    def start(self) -> Server:
        t0 = time.monotonic()
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(
                self.cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        wait_http(self.health, self.proc, self.log_path, self.start_s, self.auth)
        self.started_in_s.append(time.monotonic() - t0)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            kill_session(self.proc, signal.SIGTERM)

    def restart(self) -> None:
        self.stop()
        self.start()


def prefect_server(base: Path, database_url: str) -> Server:
    """Prefect's server on PostgreSQL (asyncpg), its concurrency leases on disk (a restart keeps
    them: Prefect's default memory storage loses every lease)."""
    port, home = free_port(), base / "prefect-server"
    home.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_DATABASE_CONNECTION_URL": database_url.replace(
            "postgresql://", "postgresql+asyncpg://"
        ),
        "PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE": "prefect.server.concurrency.lease_storage.filesystem",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_API_URL": "",
    }
    cmd = [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port), "--no-ui"]
    return Server("prefect", cmd, env, f"http://127.0.0.1:{port}/api/health", base / "prefect-server.log")


def mlflow_server(
    base: Path, database_url: str, artifacts: str, env: dict[str, str], admin_pw: str
) -> Server:
    """MLflow's server on PostgreSQL with proxied artifacts and its basic-auth app."""
    port = free_port()
    auth_ini = base / "mlflow-auth.ini"
    auth_ini.write_text(
        "[mlflow]\ndefault_permission = READ\n"
        f"database_uri = sqlite:///{base / 'mlflow-auth.db'}\nadmin_username = admin\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
    )
    server_env = {
        **os.environ,
        **env,
        "MLFLOW_AUTH_CONFIG_PATH": str(auth_ini),
        "MLFLOW_AUTH_ADMIN_PASSWORD": admin_pw,
        "MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.token_hex(16),  # CSRF protection of the auth app
        "MLFLOW_S3_ENDPOINT_URL": env.get("AWS_ENDPOINT_URL", ""),
    }
    cmd = [str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    cmd += ["--backend-store-uri", database_url.replace("postgresql://", "postgresql+psycopg://")]
    cmd += ["--artifacts-destination", artifacts, "--serve-artifacts", "--app-name", "basic-auth"]
    return Server(
        "mlflow",
        cmd,
        server_env,
        f"http://127.0.0.1:{port}/health",
        base / "mlflow-server.log",
        auth=("admin", admin_pw),
    )


@dataclass
class Worker:
    """One "machine": ``qerl worker`` for one logical GPU, in a process session of its own."""

    name: str
    gpu: str
    work: Path
    env: dict[str, str]
    pool: str
    log_path: Path
    proc: subprocess.Popen | None = None

    def start(self, janitor_every_s: float = 3.0, grace_s: float = 60.0) -> Worker:
        cmd = [str(BIN / "qerl"), "worker", "--pool", self.pool, "--gpu", self.gpu, "--name", self.name]
        cmd += [
            "--work-dir",
            str(self.work),
            "--janitor-every",
            str(janitor_every_s),
            "--grace",
            str(grace_s),
        ]
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(
                cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        return self

    def kill(self) -> None:
        """SIGKILL the machine's whole session: the worker, its flow runs, their children."""
        if self.proc is not None:
            kill_session(self.proc)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            kill_session(self.proc, signal.SIGTERM)
