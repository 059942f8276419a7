"""A run's slot of the fleet-wide GPU limit (``qerl-gpus``), held through Prefect's client.

``hold_slot`` takes one slot of a Prefect global concurrency limit under a lease (waiting while
every slot is taken, as the server's ``Retry-After`` says), renews the lease from a thread for as
long as the attempt runs, and releases the slot when the attempt ends. ``release_held`` releases
the slots this process holds from any thread: a deadline stop calls it before its ``os._exit``,
which runs no ``finally``, so the night's restart does not wait out a lease for a slot nobody uses.
A killed process releases nothing: its slot comes back when the lease runs out.

A renewal that fails (the Prefect server restarting) is logged and tried again at the next turn,
not raised: the host's GPU lock, not the slot, keeps two runs off one GPU. A lease the server no
longer has (410: it ran out while the server was away) is not renewed again; the run goes on
without its slot, and says so.

Why not ``prefect.concurrency.sync.concurrency``: it keeps the lease id to itself, so nothing but
its own ``finally`` can release the slot.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
import time
from collections.abc import Iterator
from uuid import UUID

log = logging.getLogger("qerl.fleet")

RENEW_EVERY = 0.25  # of the lease: three renewals can fail before it runs out
WAIT_MAX_S = 30.0  # the longest sleep between tries while the limit is full
# this process's leases: what stops each one's renewal, and the context it was taken in (Prefect's
# settings, the API URL among them, are context variables that a new thread does not inherit)
_held: dict[UUID, tuple[threading.Event, contextvars.Context]] = {}
_lock = threading.Lock()


@contextlib.contextmanager
def hold_slot(limit: str, lease_s: float, flow_run_id: str | None = None) -> Iterator[UUID]:
    """One slot of ``limit`` for the body (module docstring); yields the lease id. ``flow_run_id``
    names the holder on the server."""
    lease_id = acquire(limit, lease_s, flow_run_id)
    stop, context = threading.Event(), contextvars.copy_context()
    with _lock:
        _held[lease_id] = (stop, context)
    renewer = threading.Thread(
        target=context.copy().run, args=(_renew, lease_id, lease_s, stop), name=f"qerl-slot-{lease_id}",
        daemon=True,
    )  # fmt: skip
    renewer.start()
    try:
        yield lease_id
    finally:
        release(lease_id)


def acquire(limit: str, lease_s: float, flow_run_id: str | None = None) -> UUID:
    """A leased slot of ``limit``, waiting while every slot is taken; its lease id."""
    from prefect import get_client
    from prefect.client.schemas.objects import ConcurrencyLeaseHolder
    from prefect.exceptions import PrefectHTTPStatusError

    holder = ConcurrencyLeaseHolder(type="flow_run", id=UUID(flow_run_id)) if flow_run_id else None
    waiting_since = None
    with get_client(sync_client=True) as client:
        while True:
            try:
                response = client.increment_concurrency_slots_with_lease(
                    names=[limit], slots=1, mode="concurrency", lease_duration=lease_s, holder=holder
                )
            except PrefectHTTPStatusError as err:
                if err.response.status_code != 423:  # 423 Locked: every slot is taken
                    raise
                if waiting_since is None:
                    waiting_since = time.monotonic()
                    log.info("every slot of %s is taken: waiting for one", limit)
                time.sleep(min(WAIT_MAX_S, max(1.0, float(err.response.headers.get("Retry-After", 5)))))
                continue
            body = response.json()
            if not body.get("limits"):
                client.release_concurrency_slots_with_lease(UUID(body["lease_id"]))  # a lease of nothing
                raise RuntimeError(
                    f"the fleet-wide GPU limit '{limit}' does not exist on this Prefect server: create "
                    "it with `qerl fleet init --pool POOL --gpus N`"
                )
            if waiting_since is not None:
                log.info("got a slot of %s after %.0f s", limit, time.monotonic() - waiting_since)
            return UUID(body["lease_id"])


def release(lease_id: UUID) -> None:
    """Release the slot of ``lease_id`` (once; a second call does nothing). A failure is logged:
    the lease runs out on its own."""
    with _lock:
        held = _held.pop(lease_id, None)
    if held is None:
        return
    stop, context = held
    stop.set()
    try:
        context.copy().run(_release, lease_id)
    except Exception as err:  # noqa: BLE001  (the lease expires by itself)
        log.warning(
            "the GPU slot of lease %s was not released (%s): it frees when the lease runs out", lease_id, err
        )


def _release(lease_id: UUID) -> None:
    from prefect import get_client

    with get_client(sync_client=True) as client:
        client.release_concurrency_slots_with_lease(lease_id)


def release_held(timeout_s: float) -> int:
    """Release every slot this process holds, from any thread, waiting ``timeout_s`` at most (a
    Prefect server that does not answer must not keep a stopping process alive); how many."""
    with _lock:
        leases = list(_held)
    ender = threading.Thread(target=lambda: [release(lease) for lease in leases], daemon=True)
    ender.start()
    ender.join(timeout_s)
    return len(leases)


def _renew(lease_id: UUID, lease_s: float, stop: threading.Event) -> None:
    from prefect import get_client
    from prefect.exceptions import PrefectHTTPStatusError

    while not stop.wait(lease_s * RENEW_EVERY):
        try:
            with get_client(sync_client=True) as client:
                client.renew_concurrency_lease(lease_id, lease_duration=lease_s)
        except PrefectHTTPStatusError as err:
            if err.response.status_code == 410:
                log.warning(
                    "the GPU slot's lease %s ran out while the Prefect server was away: this run no "
                    "longer counts against the fleet's GPU limit (its GPU lock still holds its GPU)",
                    lease_id,
                )
                return
            log.warning("renewing the GPU slot's lease %s failed (%s): trying again", lease_id, err)
        except Exception as err:  # noqa: BLE001  (module docstring: logged, not raised)
            log.warning("renewing the GPU slot's lease %s failed (%s): trying again", lease_id, err)
