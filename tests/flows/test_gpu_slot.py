"""The fleet's GPU slot (``qerl.flows.gpu_slot``) on a real Prefect server: taken, waited for while
the limit is full, renewed, released at the end and by a deadline's ``release_held``."""

from __future__ import annotations

import contextvars
import logging
import threading
import time
import uuid

import pytest


@pytest.fixture
def limit():
    """A global concurrency limit of one slot on this test process's Prefect server."""
    from prefect import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect_home import shared_api_url

    name = f"qerl-gpus-test-{uuid.uuid4().hex[:8]}"
    with temporary_settings(updates={PREFECT_API_URL: shared_api_url()}):
        with get_client(sync_client=True) as client:
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
        try:
            yield name
        finally:
            with get_client(sync_client=True) as client:
                client.delete_global_concurrency_limit_by_name(name)


def _active(name: str) -> int:
    from prefect import get_client

    with get_client(sync_client=True) as client:
        return client.read_global_concurrency_limit_by_name(name).active_slots


def test_a_slot_is_held_for_the_body_and_released_after(limit):
    from qerl.flows import gpu_slot

    flow_run_id = str(uuid.uuid4())
    with gpu_slot.hold_slot(limit, 60.0, flow_run_id):
        assert _active(limit) == 1
    assert _active(limit) == 0
    with pytest.raises(RuntimeError, match="boom"), gpu_slot.hold_slot(limit, 60.0):
        assert _active(limit) == 1
        raise RuntimeError("boom")
    assert _active(limit) == 0, "an attempt that raised kept its slot"


def test_a_second_holder_waits_until_the_first_releases(limit):
    from qerl.flows import gpu_slot

    got: list[float] = []

    def second() -> None:
        with gpu_slot.hold_slot(limit, 60.0):
            got.append(time.monotonic())

    with gpu_slot.hold_slot(limit, 60.0):
        waiter = threading.Thread(target=contextvars.copy_context().run, args=(second,))
        waiter.start()
        time.sleep(3.0)
        assert not got, "a second holder took the slot of a limit of one"
        released = time.monotonic()
    waiter.join(60.0)
    assert got and got[0] >= released, "the waiting holder never got the slot"
    assert _active(limit) == 0


def test_release_held_frees_the_slot_from_another_thread_as_a_deadline_does(limit):
    """From a thread that does not share the holder's context (a deadline's timer thread): the slot
    is released on the server it was taken from."""
    from qerl.flows import gpu_slot

    with gpu_slot.hold_slot(limit, 60.0):
        assert _active(limit) == 1
        released: list[int] = []

        def stop() -> None:  # a thread whose own settings name another server
            from prefect.settings import PREFECT_API_URL, temporary_settings

            with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:9/api"}):
                released.append(gpu_slot.release_held(10.0))

        stopper = threading.Thread(target=stop)
        stopper.start()
        stopper.join()
        assert released == [1]
        assert _active(limit) == 0, "release_held left the slot taken"
    assert _active(limit) == 0, "the body's end released a slot a second time"
    assert gpu_slot.release_held(1.0) == 0


def test_the_lease_is_renewed_while_the_body_runs(limit, monkeypatch, caplog):
    from qerl.flows import gpu_slot

    monkeypatch.setattr(gpu_slot, "RENEW_EVERY", 0.02)  # every 1.2 s of a 60 s lease
    with caplog.at_level(logging.WARNING, logger="qerl.fleet"), gpu_slot.hold_slot(limit, 60.0) as lease:
        time.sleep(4.0)
        from prefect import get_client

        with get_client(sync_client=True) as client:  # a lease that exists renews; a gone one is 410
            client.renew_concurrency_lease(lease, lease_duration=60.0)
    assert not [r for r in caplog.records if "renewing" in r.getMessage() or "ran out" in r.getMessage()]


def test_a_missing_limit_is_named_with_the_command_that_makes_it():
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect_home import shared_api_url
    from qerl.flows import gpu_slot

    with temporary_settings(updates={PREFECT_API_URL: shared_api_url()}):
        with pytest.raises(RuntimeError, match=r"'qerl-gpus-missing' does not exist.*qerl fleet init"):
            with gpu_slot.hold_slot("qerl-gpus-missing", 60.0):
                pass
