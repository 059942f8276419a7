"""A throw-away PostgreSQL 15 cluster for the fleet suite: real server, loopback only.

``start_postgres(base)`` runs ``initdb`` and ``pg_ctl`` (as the ``postgres`` OS user when the tests
run as root: initdb refuses root) on a data directory under ``tempfile.mkdtemp(prefix="qerl-pg-")``
(mode 755, so that user can reach it wherever pytest's own temporary directories are). The server
listens on 127.0.0.1 on a free port and on a unix socket in that directory, with ``fsync=off`` and
low TCP keepalives. The role ``qerl`` (password ``qerl-secret-pw``, scram over TCP, so tests can check
that the password never appears in a message) owns the databases ``qerl``, ``prefect`` and ``mlflow``;
the superuser ``postgres`` is reachable only over the socket (``admin_conninfo``).
``stop()`` removes the directory and leaves a copy of the server log at ``<base>/postgres.log``.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psycopg

USER, PASSWORD = "qerl", "qerl-secret-pw"
DATABASES = ("qerl", "prefect", "mlflow")
START_TIMEOUT_S = 60


def bindir() -> Path:
    """Where ``initdb`` and ``pg_ctl`` are: ``pg_config --bindir``, else PostgreSQL 15's Debian path."""
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        found = Path(
            subprocess.run(
                ["pg_config", "--bindir"], capture_output=True, text=True, check=True
            ).stdout.strip()
        )
        if (found / "initdb").is_file():
            return found
    for candidate in (
        Path("/usr/lib/postgresql/15/bin"),
        Path(shutil.which("initdb") or "/nonexistent").parent,
    ):
        if (candidate / "initdb").is_file():
            return candidate
    raise RuntimeError(
        "no PostgreSQL binaries: neither pg_config --bindir nor /usr/lib/postgresql/15/bin has initdb"
    )


def _as_postgres(cmd: list[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _traversable_tmp() -> str:
    """A temporary-files root every user can enter (``tempfile.gettempdir()`` unless it is private)."""
    root = Path(tempfile.gettempdir())
    if all(os.stat(p).st_mode & 0o001 for p in [root, *root.parents]):
        return str(root)
    return "/tmp"


@dataclass
class Postgres:
    base: Path
    root: Path
    port: int
    bindir: Path
    log_path: Path
    password: str = PASSWORD
    _stopped: bool = field(default=False, repr=False)

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def url(self) -> str:
        return self.url_for("qerl")

    def url_for(self, db: str) -> str:
        return f"postgresql://{USER}:{self.password}@127.0.0.1:{self.port}/{db}"

    @property
    def admin_conninfo(self) -> str:
        """The superuser over the unix socket (trust): for tests that must act as the server's admin."""
        return f"host={self.root} port={self.port} user=postgres dbname=postgres"

    def _pg_ctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        cmd = _as_postgres(
            [str(self.bindir / "pg_ctl"), "-D", str(self.data), "-l", str(self.log_path), *args]
        )
        proc = subprocess.run(
            cmd, capture_output=True, text=True, cwd=self.root, timeout=START_TIMEOUT_S + 30
        )
        if check and proc.returncode != 0:
            raise RuntimeError(
                f"pg_ctl {' '.join(args)} failed ({proc.returncode}): {proc.stderr}{self._log_tail()}"
            )
        return proc

    def _log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return "\nserver log:\n" + "\n".join(self.log_path.read_text().splitlines()[-20:])
        return ""

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Until ``qerl`` can connect over TCP (bounded: RuntimeError with the log's tail)."""
        deadline, last = time.monotonic() + timeout_s, None
        while time.monotonic() < deadline:
            try:
                with psycopg.connect(self.url, connect_timeout=2) as conn:
                    conn.execute("SELECT 1")
                return
            except psycopg.Error as err:
                last = err
                time.sleep(0.1)
        raise RuntimeError(
            f"PostgreSQL on port {self.port} not ready after {timeout_s}s ({last}){self._log_tail()}"
        )

    def restart(self) -> None:
        """``pg_ctl restart -m fast`` (every session ends, every advisory lock goes), then wait."""
        self._pg_ctl("-w", "-t", str(START_TIMEOUT_S), "-m", "fast", "restart")
        self.wait_ready()

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self._pg_ctl("-m", "immediate", "stop", check=False)
        with contextlib.suppress(OSError):
            self.base.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(self.log_path, self.base / "postgres.log")
            self.log_path = self.base / "postgres.log"
        shutil.rmtree(self.root, ignore_errors=True)


def _initdb(root: Path, bin_dir: Path) -> None:
    data = root / "data"
    data.mkdir(mode=0o700)
    if os.geteuid() == 0:
        import pwd

        pw = pwd.getpwnam("postgres")
        for path in (root, data):
            os.chown(path, pw.pw_uid, pw.pw_gid)
    cmd = [str(bin_dir / "initdb"), "-D", str(data), "-U", "postgres", "-E", "UTF8", "--no-locale", "--no-sync",
           "--auth-local=trust", "--auth-host=scram-sha-256"]  # fmt: skip
    proc = subprocess.run(_as_postgres(cmd), capture_output=True, text=True, cwd=root, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"initdb failed ({proc.returncode}): {proc.stderr}")
    # TCP only on loopback and only for qerl, with its password; the superuser only over the socket
    (data / "pg_hba.conf").write_text("local all postgres trust\nhost all qerl 127.0.0.1/32 scram-sha-256\n")


def start_postgres(base: Path) -> Postgres:
    """Start a throw-away cluster (see the module docstring); ``base`` receives its log at stop."""
    bin_dir = bindir()
    root = Path(tempfile.mkdtemp(prefix="qerl-pg-", dir=_traversable_tmp()))
    root.chmod(0o755)
    _initdb(root, bin_dir)
    for attempt in range(3):  # a free port can be taken between the probe and the bind
        port = _free_port()
        with open(root / "data" / "postgresql.conf", "a") as fh:
            fh.write(
                f"\nlisten_addresses = '127.0.0.1'\nport = {port}\nunix_socket_directories = '{root}'\n"
                "fsync = off\nsynchronous_commit = off\nfull_page_writes = off\nmax_connections = 200\n"
                "shared_buffers = 32MB\ntcp_keepalives_idle = 5\ntcp_keepalives_interval = 2\n"
                "tcp_keepalives_count = 3\n"
            )
        pg = Postgres(base=base, root=root, port=port, bindir=bin_dir, log_path=root / "postgres.log")
        proc = pg._pg_ctl("-w", "-t", str(START_TIMEOUT_S), "start", check=False)
        if proc.returncode == 0:
            break
        if attempt == 2 or "could not bind" not in pg._log_tail():
            shutil.rmtree(root, ignore_errors=True)
            raise RuntimeError(f"pg_ctl start failed ({proc.returncode}): {proc.stderr}{pg._log_tail()}")
    atexit.register(pg.stop)
    try:
        with psycopg.connect(pg.admin_conninfo, autocommit=True, connect_timeout=10) as conn:
            conn.execute(f"CREATE ROLE {USER} LOGIN PASSWORD '{PASSWORD}'")
            for db in DATABASES:
                conn.execute(f"CREATE DATABASE {db} OWNER {USER}")
        pg.wait_ready()
    except BaseException:
        pg.stop()
        raise
    return pg
