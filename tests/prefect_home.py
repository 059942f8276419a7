"""One migrated Prefect database per test session, copied into the work dirs of the tests' CLI runs.

``qerl run`` in a fresh work directory starts Prefect's temporary server on an empty database, which
Prefect migrates first: about half of the 15 s the start takes on two cores. A user's work directory
pays that once, on its first run; the tests' CLI runs each get a fresh work directory and would pay
it every time, so they start from a copy of one database migrated at the start of the session
(``seeded_env``).

Starting that server is still a large share of a short CLI run (uvicorn imports Prefect's whole
app; docs/development.md has the figures). A CLI run whose point is not the server (its console, its own temporary server, a
lost server) talks to this test process's server instead (``shared_api_url``): Prefect's own
temporary server singleton, the one in-process flows use, started on a copy of the migrated
database when no flow started it yet. ``qerl`` then runs as under ``PREFECT_API_URL`` (a scheduled
night's setting), which is a supported path of its own.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

TEMPLATE_ENV = "QERL_TEST_PREFECT_TEMPLATE"
# what an in-process flow's prepare_environment left in this process's environment: not the child's
_PER_WORK_DIR = ("PREFECT_HOME", "PREFECT_SERVER_MEMO_STORE_PATH")
_MIGRATED = "migrated"
_DATABASE = ("prefect.db", "prefect.db-wal", "prefect.db-shm")
_MIGRATE = (
    "from prefect.server.api.server import SubprocessASGIServer\n"
    "server = SubprocessASGIServer()\n"
    "server.start()\n"
    "server.stop()\n"
)


def make_template(home: Path) -> Path:
    """Start and stop a temporary server on ``home`` (a PREFECT_HOME) in a child process, which leaves
    a migrated ``prefect.db`` there; returns ``home``. ``MIGRATED`` beside it marks a finished
    migration: a database a killed session left half-migrated is made again."""
    if (home / _MIGRATED).is_file():
        return home
    shutil.rmtree(home, ignore_errors=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1")
    env["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = "180"
    subprocess.run([sys.executable, "-c", _MIGRATE], env=env, check=True, capture_output=True, timeout=300)
    (home / _MIGRATED).touch()
    return home


def _copy_database(template: Path, target: Path) -> None:
    """The template's sqlite database with its write-ahead log, if one is left: the pages it holds."""
    for name in _DATABASE:
        if (template / name).is_file():
            shutil.copyfile(template / name, target / name)


def seeded_env(env: dict[str, str], work: Path) -> dict[str, str]:
    """``env`` for a CLI run in ``work``: Prefect's home is the work dir's own (as for a user), and
    holds a copy of the session's migrated database unless it has one already."""
    env = {k: v for k, v in env.items() if k not in _PER_WORK_DIR}
    template = os.environ.get(TEMPLATE_ENV)
    target = work / "prefect"
    if template and not (target / "prefect.db").exists():
        target.mkdir(parents=True, exist_ok=True)
        _copy_database(Path(template), target)
    return env


def shared_api_url() -> str:
    """The API URL of this process's Prefect temporary server (module docstring), started if needed."""
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()
    if not server.running:
        home = Path(tempfile.mkdtemp(prefix="qerl-test-prefect-"))
        template = os.environ.get(TEMPLATE_ENV)
        if template:
            _copy_database(Path(template), home)
        before = os.environ.get("PREFECT_HOME")
        os.environ["PREFECT_HOME"] = str(home)  # the server's database: never the user's ~/.prefect
        try:
            server.start()
        finally:
            if before is None:
                os.environ.pop("PREFECT_HOME", None)
            else:
                os.environ["PREFECT_HOME"] = before
    return server.api_url


def run_here(cfg, work: Path, night=None) -> dict:
    """Run the flow for ``cfg`` in this process, as ``qerl run`` does after setting Prefect's environment
    for ``work`` (its first call in the process sets it: Prefect reads it once); the record as run.json
    holds it. The API URL the run set for this process is taken back from the environment afterwards,
    so the CLI runs a test starts later start their own server or get the one they are given."""
    from qerl.flows.orchestration import prepare_environment

    prepare_environment(work)
    from qerl.flows.commands import run_flow

    given = os.environ.get("PREFECT_API_URL")
    try:
        return run_flow(cfg, work, night).to_json()
    finally:
        if given is None:
            os.environ.pop("PREFECT_API_URL", None)


def resume_here(run_id: str, work: Path) -> dict:
    """``qerl resume RUN`` in this process: the recorded run with its own config and night."""
    from qerl.pipeline.planning.runs import recorded_config
    from qerl.pipeline.store.run_record import load_record

    record = load_record(work, run_id)
    return run_here(recorded_config(record), work, record.night)
