"""A whole fleet on one machine for the fleet suite: PostgreSQL, Prefect, MLflow and S3 servers on
loopback, and "machines" (``qerl worker`` process sessions, each with its own cache directory and a
logical GPU id). Simulated only: the GPUs (ids, no devices), the network (loopback), power loss (a
SIGKILL keeps the page cache).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml
from servers import BIN, Server, Worker, mlflow_server, prefect_server

POOL = "qerl-gpu"
BUCKET = "qerl"
MLFLOW_ADMIN_PW = "mlflow-admin-pw-7c1e"
TERMINAL = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")


@dataclass
class Fleet:
    base: Path
    postgres: Any
    s3: Any
    prefect: Server
    mlflow: Server
    credentials: Path
    env: dict[str, str]
    workers: list[Worker] = field(default_factory=list)

    @property
    def api(self) -> str:
        return self.env["PREFECT_API_URL"]

    @property
    def tracking_uri(self) -> str:
        return self.mlflow.health.removesuffix("/health")

    def secrets(self) -> list[str]:
        """Every password and key the fleet's services use: none may be written anywhere by qerl."""
        return [self.postgres.password, self.s3.secret_key, MLFLOW_ADMIN_PW]

    # ---- configs and deployments ----
    def write_config(self, cfg: dict, name: str, store: str = "store", model: str | None = None) -> Path:
        """``cfg`` on the fleet's services: the shared store ``s3://qerl/<store>``, the fleet's MLflow
        (registered model ``model``: its own, for a test that counts versions)."""
        cfg = json.loads(json.dumps(cfg))
        cfg.setdefault("store", {})["uri"] = f"s3://{BUCKET}/{store}"
        cfg.setdefault("registry", {})["tracking_uri"] = self.tracking_uri
        if model:
            cfg["registry"]["model_name"] = model
        path = self.base / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return path

    def qerl(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        work = self.base / "operator"
        proc = subprocess.run(
            [str(BIN / "qerl"), *args, "--work-dir", str(work)],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"qerl {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
            )
        return proc

    def deploy(self, config: Path) -> str:
        """``qerl schedule --pool`` (a cron that does not fire during the suite); the deployment id."""
        self.qerl("schedule", "--pool", POOL, "--cron", "0 3 1 1 *", "--config", str(config))
        name = yaml.safe_load(config.read_text())["loop"]["name"]
        dep = httpx.get(f"{self.api}/deployments/name/qerl-rl/nightly-{name}", timeout=10).json()
        return dep["id"]

    def start_night(self, deployment_id: str, night: str) -> str:
        """A flow run of the deployment for ``night`` (what the scheduler makes at its cron time)."""
        dep = httpx.get(f"{self.api}/deployments/{deployment_id}", timeout=10).json()
        params = {**dep["parameters"], "night": night}
        made = httpx.post(
            f"{self.api}/deployments/{deployment_id}/create_flow_run",
            json={"parameters": params, "tags": ["qerl"]},
            timeout=10,
        )
        made.raise_for_status()
        return made.json()["id"]

    def flow_runs(self, deployment_id: str) -> list[dict]:
        got = httpx.post(
            f"{self.api}/flow_runs/filter",
            json={
                "flow_runs": {"deployment_id": {"any_": [deployment_id]}},
                "sort": "EXPECTED_START_TIME_ASC",
            },
            timeout=10,
        )
        got.raise_for_status()
        return sorted(got.json(), key=lambda r: r["created"])

    def wait_completed(self, deployment_id: str, nights: int, timeout_s: float) -> list[dict]:
        """The deployment's flow runs once ``nights`` of them completed (every other one terminal)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            runs = self.flow_runs(deployment_id)
            states = [r["state_type"] for r in runs]
            if states.count("COMPLETED") >= nights and all(s in TERMINAL for s in states):
                return runs
            time.sleep(2)
        raise AssertionError(
            f"{nights} night(s) did not complete in {timeout_s:g} s: "
            + ", ".join(f"{r['name']} {r['state_type']}" for r in self.flow_runs(deployment_id))
            + "\n"
            + self.logs()
        )

    # ---- machines ----
    def worker(self, name: str, gpu: str, grace_s: float = 10.0) -> Worker:
        env = {**self.env, "QERL_CREDENTIALS_FILE": str(self.credentials)}
        for secret_var in ("QERL_FLEET_DB", "AWS_SECRET_ACCESS_KEY", "MLFLOW_TRACKING_PASSWORD"):
            env.pop(secret_var, None)  # a worker reads them from its credentials file
        work = self.base / "machines" / name
        work.mkdir(parents=True, exist_ok=True)
        w = Worker(name, gpu, work, env, POOL, self.base / f"worker-{name}.log")
        w.start(janitor_every_s=2.0, grace_s=grace_s)
        self.workers.append(w)
        return w

    def stop_workers(self) -> None:
        """Every machine's whole session, SIGKILLed (a test's machines end with it)."""
        for w in self.workers:
            w.kill()
        self.workers = []

    def logs(self, tail: int = 4000) -> str:
        out = []
        for w in self.workers:
            if w.log_path.is_file():
                out.append(f"--- {w.log_path.name} ---\n{w.log_path.read_text()[-tail:]}")
        return "\n".join(out)

    def stop(self) -> None:
        for w in self.workers:
            w.stop()
        for server in (self.mlflow, self.prefect):
            server.stop()
        self.s3.stop()
        self.postgres.stop()


def builds(work: Path) -> list[dict]:
    path = work / "store" / "builds.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def built(work: Path, stage: str | None = None) -> list[tuple[str, str]]:
    return [
        (b["stage"], b["key"]) for b in builds(work) if b["event"] == "built" and stage in (None, b["stage"])
    ]


def start_fleet(base: Path, postgres_factory: Any, seaweed_factory: Any) -> Fleet:
    """Every service, migrated and checked by ``qerl fleet init`` (2 GPUs)."""
    pg = postgres_factory(base)
    s3 = seaweed_factory(base / "s3")
    s3.create_bucket(BUCKET)
    prefect = prefect_server(base, pg.url_for("prefect")).start()
    mlflow = mlflow_server(
        base, pg.url_for("mlflow"), f"s3://{BUCKET}/mlartifacts", s3.env(), MLFLOW_ADMIN_PW
    )
    mlflow.start()
    credentials = base / "fleet.env"
    credentials.write_text(
        f"QERL_FLEET_DB={pg.url}\nAWS_SECRET_ACCESS_KEY={s3.secret_key}\nMLFLOW_TRACKING_PASSWORD={MLFLOW_ADMIN_PW}\n"
    )
    credentials.chmod(0o600)
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "QERL_"))}
    env = {
        **keep,
        **s3.env(),
        "QERL_FLEET_DB": pg.url,
        "PREFECT_API_URL": prefect.health.removesuffix("/health"),
        "PREFECT_WORKER_QUERY_SECONDS": "2",
        "PREFECT_WORKER_HEARTBEAT_SECONDS": "5",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "MLFLOW_TRACKING_USERNAME": "admin",
        "MLFLOW_TRACKING_PASSWORD": MLFLOW_ADMIN_PW,
        "QERL_GPU_LOCK_DIR": str(base / "gpu-locks"),
        "QERL_LEASE_REGAIN_S": "8",  # the suite's PostgreSQL restarts in about a second
        "PYTHONUNBUFFERED": "1",
    }
    fleet = Fleet(base, pg, s3, prefect, mlflow, credentials, env)
    fleet.qerl("fleet", "init", "--pool", POOL, "--gpus", "2")
    return fleet
