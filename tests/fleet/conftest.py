"""The fleet suite's shared fixture: one throw-away PostgreSQL cluster per test module (tests/fleet/postgres.py)."""

from __future__ import annotations

import pytest
from postgres import Postgres, start_postgres


@pytest.fixture(scope="module")
def postgres(tmp_path_factory: pytest.TempPathFactory) -> Postgres:
    """A real PostgreSQL 15 on 127.0.0.1 (role ``qerl``, databases qerl, prefect and mlflow), stopped
    after the module; its log is kept under the module's temporary directory."""
    pg = start_postgres(tmp_path_factory.mktemp("postgres"))
    yield pg
    pg.stop()
