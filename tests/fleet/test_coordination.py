"""The fleet's PostgreSQL coordination (``qerl.pipeline.fleet.coordination``) and what uses it: the run
lock, the data cursor and the registry lock, against a real PostgreSQL 15 on loopback.

Real: the server, its sessions, advisory locks, ``pg_terminate_backend``, a server restart, a holder
process SIGKILLed as a crash would. Simulated: "another machine" is a second process or a second
work dir on this one; a dead network (a host that vanishes without closing its sockets) is not
tested here.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

import psycopg
import pytest
from qerl.pipeline.fleet import coordination as co
from qerl.pipeline.planning.prompt_stream import DataCursor
from qerl.pipeline.registry import lock as registry_lock_module
from qerl.pipeline.registry.lock import RegistryError, registry_lock
from qerl.pipeline.store import run_lock

pytestmark = pytest.mark.fleet

HOST = socket.gethostname()
HOLD_LEASE = """
import sys, time
from qerl.pipeline.fleet import coordination
with coordination.hold_lease(sys.argv[1], sys.argv[2]):
    print("held", flush=True)
    time.sleep(600)
"""
HOLD_RUN = """
import sys, time
from pathlib import Path
from qerl.pipeline.store import run_lock
with run_lock.hold(Path(sys.argv[1]), sys.argv[2]):
    print("held", flush=True)
    time.sleep(600)
"""
ADVANCE = """
import sys
from qerl.pipeline.fleet.coordination import cursor_advance
line, worker, ends = sys.argv[1], sys.argv[2], [int(e) for e in sys.argv[3].split(",")]
print(",".join(str(cursor_advance(line, "s", e, f"{worker}-{i}-{e}")) for i, e in enumerate(ends)))
"""


@pytest.fixture
def fleet_db(postgres, monkeypatch):
    """``QERL_FLEET_DB`` set to the test cluster for this test (and the processes it starts)."""
    monkeypatch.setenv("QERL_FLEET_DB", postgres.url)
    return postgres


def _unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def _child(code: str, *args: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def _wait_for(predicate, timeout_s: float, step_s: float = 0.02) -> float:
    """Seconds until ``predicate()`` is true; fails the test after ``timeout_s``."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout_s, f"not true after {timeout_s}s"
        time.sleep(step_s)
    return time.monotonic() - start


def _ensure_leases_in_a_forked_child() -> int:
    """The exit status of a forked child that calls ``ensure_leases``: 0 if it passed, 3 if it raised."""

    def child() -> None:
        try:
            co.ensure_leases()
        except co.LeaseLostError:
            os._exit(3)
        os._exit(0)

    proc = multiprocessing.get_context("fork").Process(target=child)
    proc.start()
    proc.join(30)
    return proc.exitcode


def _lease_row(url: str, name: str):
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT holder FROM qerl_leases WHERE name = %s", (name,)).fetchone()
    return row[0] if row else None


def test_lock_is_held_reads_the_servers_lock_table_for_every_kind_of_key(postgres):
    # the key as registry_lock has always computed it, so a fleet and a PostgreSQL-backed MLflow agree
    name = "qerl-registry:m"
    assert co.lock_key(name) == int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big", signed=True)
    # a key of each sign, and low halves above 2**31 (pg_locks shows both halves as unsigned oids)
    kinds: dict[tuple[bool, bool], str] = {}
    for i in range(200):
        key = co.lock_key(f"probe-{i}")
        kinds.setdefault((key < 0, (key & 0xFFFFFFFF) >= 2**31), f"probe-{i}")
    assert len(kinds) == 4
    with psycopg.connect(postgres.url, autocommit=True) as raw:
        for name in kinds.values():
            assert not co.lock_is_held(name, postgres.url)
            raw.execute("SELECT pg_advisory_lock(%s)", (co.lock_key(name),))  # the server's own key
            assert co.lock_is_held(name, postgres.url)
            assert [n for n in kinds.values() if co.lock_is_held(n, postgres.url)] == [name]
            raw.execute("SELECT pg_advisory_unlock(%s)", (co.lock_key(name),))
            assert not co.lock_is_held(name, postgres.url)
            with co.try_advisory_lock(name, postgres.url) as got:
                assert got and co.lock_is_held(name, postgres.url)
                assert not raw.execute("SELECT pg_try_advisory_lock(%s)", (co.lock_key(name),)).fetchone()[0]
                with co.try_advisory_lock(name, postgres.url) as again:
                    assert again is False
            assert not co.lock_is_held(name, postgres.url)


def test_advisory_lock_waits_for_its_holder_and_times_out_naming_the_lock(postgres, monkeypatch):
    name, url = _unique("lock"), postgres.url
    got_at: list[float] = []

    def waiter():
        with co.advisory_lock(name, timeout_s=10, url=url):
            got_at.append(time.monotonic())

    with co.advisory_lock(name, url=url):
        start = time.monotonic()
        with pytest.raises(
            co.CoordinationError, match=f"timed out after 0.3s waiting for the advisory lock {name}"
        ):
            with co.advisory_lock(name, timeout_s=0.3, url=url):
                pass
        assert 0.25 < time.monotonic() - start < 5
        thread = threading.Thread(target=waiter)
        thread.start()
        time.sleep(0.3)
        assert not got_at
        released = time.monotonic()
    thread.join(10)
    assert got_at and got_at[0] >= released
    assert not co.lock_is_held(name, url)

    # build_lock: the fleet's build exclusion with QERL_FLEET_DB, a no-op without it
    monkeypatch.delenv("QERL_FLEET_DB", raising=False)
    with co.build_lock("key-1"):
        assert not co.lock_is_held("qerl-build:key-1", url)
    monkeypatch.setenv("QERL_FLEET_DB", url)
    with co.build_lock("key-1"):
        with co.try_advisory_lock("qerl-build:key-1", url) as got:
            assert got is False
    assert not co.lock_is_held("qerl-build:key-1", url)


def test_a_second_lease_is_refused_naming_its_holder(postgres):
    name, url = _unique("lease"), postgres.url
    with co.hold_lease(name, url) as lease:
        assert lease.holder["pid"] == os.getpid() and not lease.lost
        with pytest.raises(
            co.LeaseHeldError, match=f"lease {name} is held by pid {os.getpid()} on {HOST}, since"
        ) as err:
            with co.hold_lease(name, url):
                pass
        assert err.value.holder["backend_pid"] == lease.backend_pid and "token" not in err.value.holder
        assert co.lease_holder(name, url)["pid"] == os.getpid()
        assert _lease_row(url, name)["backend_pid"] == lease.backend_pid
    assert _lease_row(url, name) is None and co.lease_holder(name, url) is None
    with co.hold_lease(name, url):  # free again
        pass


def test_the_lease_of_a_killed_process_is_free_within_seconds(postgres):
    name, url = _unique("lease"), postgres.url
    proc = _child(HOLD_LEASE, name, url)
    try:
        assert co.lock_is_held(name, url)
        assert co.lease_holder(name, url)["pid"] == proc.pid
        with pytest.raises(co.LeaseHeldError, match=f"pid {proc.pid} on {HOST}"):
            with co.hold_lease(name, url):
                pass
    finally:
        _kill(proc)
    assert _wait_for(lambda: not co.lock_is_held(name, url), timeout_s=5) < 5
    assert _lease_row(url, name)["pid"] == proc.pid  # the dead holder's row stays, but it counts no more
    assert co.lease_holder(name, url) is None
    with co.hold_lease(name, url):
        assert co.lease_holder(name, url)["pid"] == os.getpid()


def test_run_lock_on_a_fleet_refuses_an_attempt_from_another_work_dir(fleet_db, tmp_path, monkeypatch):
    run_id = _unique("night")
    here, there = tmp_path / "a" / "runs" / run_id, tmp_path / "b" / "runs" / run_id  # two "machines"
    proc = _child(HOLD_RUN, str(there), run_id)  # inherits QERL_FLEET_DB
    try:
        info = run_lock.holder(here)  # no local lock file: the lease answers
        assert info is not None and info["pid"] == proc.pid and info["host"] == HOST
        with pytest.raises(
            run_lock.RunLockedError, match=f"run {run_id} is already running \\(pid {proc.pid} on {HOST}"
        ):
            with run_lock.hold(here, run_id):
                pass
        assert (here / run_lock.RUN_LOCK).read_text() == ""  # the refused attempt recorded nothing
        monkeypatch.delenv("QERL_FLEET_DB")
        assert run_lock.holder(here) is None  # without the fleet database the other machine is invisible
        monkeypatch.setenv("QERL_FLEET_DB", fleet_db.url)
    finally:
        _kill(proc)
    _wait_for(lambda: run_lock.holder(here) is None, timeout_s=5)
    with run_lock.hold(here, run_id):
        assert co.lease_holder(f"qerl-run:{run_id}")["pid"] == os.getpid()
        assert run_lock.holder(there)["pid"] == os.getpid()
    assert run_lock.holder(here) is None and not co.lock_is_held(f"qerl-run:{run_id}")


def _take_when_free(url: str, name: str, timeout_s: float = 5.0) -> psycopg.Connection:
    """Another session that takes lock ``name`` as soon as it is free (polling every 10 ms)."""
    conn = psycopg.connect(url, autocommit=True)
    deadline = time.monotonic() + timeout_s
    while not conn.execute("SELECT pg_try_advisory_lock(%s)", (co.lock_key(name),)).fetchone()[0]:
        assert time.monotonic() < deadline, f"{name} was not freed"
        time.sleep(0.01)
    return conn


def test_a_terminated_backend_loses_the_lease_and_ensure_leases_says_so(postgres, caplog):
    """The lease's session ends and another session takes the lock before the watchdog (every 1 s)
    can take it again: the lease is lost."""
    name, url, every = _unique("lease"), postgres.url, 1.0
    with co.hold_lease(name, url, check_every_s=every) as lease:
        co.ensure_leases()
        # a watchdog silent for too long (starved, say) counts as lost until it answers once more
        lease._ok_at -= 100
        assert lease.lost
        co.ensure_leases()  # asked for a fresh check, which the live connection passes
        assert not lease.lost
        assert _ensure_leases_in_a_forked_child() == 0  # no watchdog there: the server is asked
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("SELECT pg_terminate_backend(%s)", (lease.backend_pid,))
        thief = _take_when_free(url, name)
        assert _wait_for(lambda: lease.lost, timeout_s=every * 2 + 1) <= every * 2 + 1
        with pytest.raises(co.LeaseLostError, match=f"lost the lease {name} .*terminating connection") as err:
            co.ensure_leases()
        thief.close()
        assert postgres.password not in str(err.value)
        with pytest.raises(co.LeaseLostError):
            lease.check()
        assert _ensure_leases_in_a_forked_child() == 3
    co.ensure_leases()  # a lease given back is no longer checked
    assert not co.lock_is_held(name, url) and _lease_row(url, name) is None
    assert f"lease {name} lost" in caplog.text and postgres.password not in caplog.text


def test_a_server_restart_is_ridden_out_each_lease_taken_again(postgres, caplog):
    """A database restart ends every session; each lease's watchdog takes its lock again on a new
    session, so the run goes on, holding what it held (a night rides out a database restart)."""
    name, other, url, every = _unique("lease"), _unique("lease"), postgres.url, 0.3
    with (
        co.hold_lease(name, url, check_every_s=every) as lease,
        co.hold_lease(other, url, check_every_s=every) as second,
    ):
        co.ensure_leases()
        before = (lease.backend_pid, second.backend_pid)
        postgres.restart()
        _wait_for(lambda: (lease.backend_pid, second.backend_pid) != before and not lease._regaining, 30)
        co.ensure_leases()  # waits for a regain still under way, then passes
        assert not lease.lost and not second.lost
        assert co.lease_holder(name, url)["pid"] == os.getpid() == co.lease_holder(other, url)["pid"]
        with co.try_advisory_lock(name, url) as taken:
            assert not taken
    assert not co.lock_is_held(name, url) and not co.lock_is_held(other, url)
    assert f"lease {name}: taken again on a new session" in caplog.text


def _cursor_ops(cursor: DataCursor) -> list[int]:
    out = [cursor.position("s"), cursor.advance("s", 4, "night-1"), cursor.advance("s", 2, "night-0-resumed")]
    out += [cursor.position("s"), cursor.position("other"), cursor.advance("s", 4, "night-1-again")]
    out += [
        cursor.advance("fresh", 0, "night-zero"),
        cursor.position("fresh"),
        cursor.advance("neg", -3, "n"),
    ]
    out += [cursor.advance("s", 5 + i, f"night-{i + 2}") for i in range(60)]
    return out + [cursor.advance("other", 3, "night-other"), cursor.position("other"), cursor.position("s")]


def test_the_fleet_cursor_gives_the_file_cursors_answers(fleet_db, tmp_path, monkeypatch):
    line = _unique("nightly")
    fleet = DataCursor(tmp_path / "fleet", line)
    on_fleet = _cursor_ops(fleet)
    assert not (tmp_path / "fleet").exists()  # nothing written in the work dir
    with psycopg.connect(fleet_db.url) as conn:
        rows = dict(conn.execute("SELECT stream, runs FROM qerl_cursors WHERE line = %s", (line,)).fetchall())
    monkeypatch.delenv("QERL_FLEET_DB")
    local = DataCursor(tmp_path / "file", line)
    assert on_fleet == _cursor_ops(local)
    assert on_fleet[:9] == [0, 4, 4, 4, 0, 4, 0, 0, 0]
    streams = json.loads(local.path.read_text())["streams"]
    assert rows["s"] == streams["s"]["runs"] and len(rows["s"]) == 50 and rows["s"][-1] == "night-61"
    assert rows["other"] == streams["other"]["runs"] == ["night-other"]


def test_concurrent_advances_from_threads_and_processes_end_at_the_max(fleet_db):
    line, rng = _unique("nightly"), random.Random(7)
    plans = {f"t{w}": [rng.randrange(1, 400) for _ in range(12)] for w in range(6)}
    plans |= {f"p{w}": [rng.randrange(1, 400) for _ in range(12)] for w in range(2)}
    seen: dict[str, list[int]] = {}

    def thread_worker(worker: str) -> None:
        seen[worker] = [
            co.cursor_advance(line, "s", e, f"{worker}-{i}-{e}") for i, e in enumerate(plans[worker])
        ]

    procs = {w: subprocess.Popen([sys.executable, "-c", ADVANCE, line, w, ",".join(map(str, plans[w]))],
                                 stdout=subprocess.PIPE, text=True) for w in plans if w.startswith("p")}  # fmt: skip
    threads = [threading.Thread(target=thread_worker, args=(w,)) for w in plans if w.startswith("t")]
    for thread in threads:
        thread.start()
    for worker, proc in procs.items():
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0
        seen[worker] = [int(v) for v in out.strip().split(",")]
    for thread in threads:
        thread.join(60)
    assert co.cursor_position(line, "s") == max(e for ends in plans.values() for e in ends)
    for worker, values in seen.items():
        assert values == sorted(values), f"{worker} saw the cursor move back: {values}"
        assert all(v >= e for v, e in zip(values, plans[worker], strict=True))
    with psycopg.connect(fleet_db.url) as conn:
        (runs,) = conn.execute("SELECT runs FROM qerl_cursors WHERE line = %s", (line,)).fetchone()
    ends = [int(run.rsplit("-", 1)[1]) for run in runs]
    assert ends == sorted(set(ends)) and ends[-1] == co.cursor_position(line, "s")  # each id moved it


def test_registry_lock_on_a_fleet_excludes_a_second_holder_without_calling_mlflow(fleet_db, monkeypatch):
    def no_mlflow(*args, **kwargs):
        raise AssertionError("MLflow was called")

    monkeypatch.setattr(registry_lock_module, "MlflowClient", no_mlflow)
    monkeypatch.setattr(registry_lock_module, "server_lock", no_mlflow)
    uri, model = "http://127.0.0.1:9/", _unique("model")  # no tracking server there
    monkeypatch.delenv("QERL_FLEET_DB")
    with pytest.raises(AssertionError, match="MLflow was called"):  # the patch does catch MLflow use
        with registry_lock(uri, model):
            pass
    monkeypatch.setenv("QERL_FLEET_DB", fleet_db.url)
    with registry_lock(uri, model, timeout_s=10):
        assert co.lock_is_held(f"qerl-registry:{model}")
        start = time.monotonic()
        with pytest.raises(RegistryError, match=f"the registry lock on {model}: timed out after 0.3s"):
            with registry_lock("https://mlflow.example:5000", model, timeout_s=0.3):
                pass
        assert 0.25 < time.monotonic() - start < 5
        with registry_lock(uri, _unique("other-model"), timeout_s=1):  # another model is not blocked
            pass
    assert not co.lock_is_held(f"qerl-registry:{model}")
    with pytest.raises(co.LeaseLostError, match="from the block"):  # the block's errors stay what they are
        with registry_lock(uri, model, timeout_s=1):
            raise co.LeaseLostError("from the block")
    assert not co.lock_is_held(f"qerl-registry:{model}")


def test_the_password_never_appears_in_an_error(postgres, tmp_path, monkeypatch):
    monkeypatch.setattr(co, "CONNECT_RETRY_S", 0.0)  # a refused connection is not retried here
    secret = postgres.password
    wrong_port = postgres.url.replace(f":{postgres.port}/", ":9/")
    wrong_password = postgres.url.replace(secret, f"{secret}-WRONG")
    for url, why in ((wrong_port, "Connection refused"), (wrong_password, "password authentication failed")):
        with pytest.raises(co.CoordinationError, match=why) as err:
            co.connect(url)
        assert "qerl:***@127.0.0.1" in str(err.value) and secret not in str(err.value)
        assert err.value.__cause__ is None and err.value.__suppress_context__  # no driver error chained
        monkeypatch.setenv("QERL_FLEET_DB", url.replace("postgresql://", "postgresql+psycopg://"))
        calls = [
            lambda: co.lock_is_held("x"),
            lambda: co.cursor_position("l", "s"),
            lambda: co.hold_lease("x").__enter__(),
            lambda: co.advisory_lock("x", 1).__enter__(),
            lambda: run_lock.holder(tmp_path / "runs" / "r1"),
            lambda: DataCursor(tmp_path, "nightly").advance("s", 3, "r1"),
            lambda: registry_lock("http://127.0.0.1:9/", "m").__enter__(),
        ]
        for call in calls:
            with pytest.raises((co.CoordinationError, RegistryError)) as err:
                call()
            assert "***" in str(err.value) and secret not in str(err.value)
    monkeypatch.delenv("QERL_FLEET_DB")
    with pytest.raises(co.CoordinationError, match="QERL_FLEET_DB is not set"):
        co.lock_is_held("x")
