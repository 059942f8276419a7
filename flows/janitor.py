"""The fleet's janitor: a night whose machine died is crashed, then started again on another worker.

Prefect alone does not finish such a night. A machine that dies with its run leaves the flow run
RUNNING (no one reports its end: Prefect #16746), a worker that dies between PENDING and launch
leaves it PENDING (#18933), and Prefect's flow retries do not cover a Crashed run (#10211). qerl's own
liveness signal is sharper than a heartbeat: an attempt holds its run's lease, a PostgreSQL advisory
lock (``qerl.pipeline.fleet.coordination``) that the database drops when the holder's connection
dies. So ``sweep`` does, for the qerl flow runs of the deployments on one work pool:

1. a run RUNNING for longer than ``grace_s`` (PENDING: ``pending_grace_s``, 5 minutes, as a run's
   process may take a while to start) whose run lease no session holds (asked twice, a second
   apart) is set CRASHED, with a message saying why;
2. a night (a qerl run id: the deployment's config and the flow run's night) whose newest flow run
   is CRASHED, with no flow run of it completed or still to come, gets a new flow run of the same
   deployment with the night named in its parameters, while the night has had fewer than
   ``1 + retries`` flow runs. The new run has the same run id, so it resumes: finished stages are
   store hits, training continues from the last published checkpoint, registration happens once.

Every ``qerl worker`` sweeps every ``janitor_every_s`` under a try-lock (``qerl-janitor``), so the
janitor lives as long as any worker and two never sweep at once. A run crashed by mistake (alive but
cut off from the database for longer than the grace) has lost its lease and stops before it
publishes anything more (``ensure_leases``); its night continues in the new flow run.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from qerl.pipeline.fleet import coordination
from qerl.pipeline.planning.prompt_stream import parse_night
from qerl.pipeline.planning.run_config import RunConfig
from qerl.pipeline.planning.runs import run_id_for

log = logging.getLogger("qerl.fleet")

JANITOR_LOCK = "qerl-janitor"
RERUN_TAG = "qerl-rerun"
LIVE_STATES = ("RUNNING", "PENDING")
TO_COME_STATES = ("SCHEDULED", "PENDING", "RUNNING", "PAUSED", "CANCELLING")
# a PENDING run is a process still starting (imports take seconds on a loaded machine) until the
# worker that claimed it is gone for good: a long grace, so a slow start is never crashed
PENDING_GRACE_S = 300.0


@dataclass
class Night:
    """The flow runs of one qerl run id on the pool, oldest first."""

    run_id: str
    night: str
    deployment_id: Any
    parameters: dict[str, Any]
    flow_runs: list[Any]


def run_lease(run_id: str) -> str:
    """The lease name an attempt at ``run_id`` holds (``qerl.pipeline.store.run_lock``)."""
    return f"qerl-run:{run_id}"


def _night_of(flow_run: Any) -> _dt.date | None:
    params = flow_run.parameters or {}
    if params.get("night"):
        return parse_night(params["night"])
    if not params.get("nightly"):
        return None
    return parse_night(flow_run.expected_start_time)


def _nights(client: Any, pool: str) -> list[Night]:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterDeploymentId, WorkPoolFilter
    from prefect.client.schemas.sorting import FlowRunSort

    deployments = client.read_deployments(work_pool_filter=WorkPoolFilter(name={"any_": [pool]}))
    by_id: dict[str, Night] = {}
    configs: dict[str, RunConfig] = {}  # by the config's JSON: a deployment's config changes on redeploy
    for dep in deployments:
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(deployment_id=FlowRunFilterDeploymentId(any_=[dep.id])),
            sort=FlowRunSort.START_TIME_ASC,
            limit=200,
        )
        for fr in runs:
            night = _night_of(fr)
            if night is None or not (fr.parameters or {}).get("config"):
                continue
            text = json.dumps(fr.parameters["config"], sort_keys=True)
            if text not in configs:
                configs[text] = RunConfig.model_validate(fr.parameters["config"])
            rid = run_id_for(configs[text], night)  # each flow run's own config: it names its run
            entry = by_id.setdefault(rid, Night(rid, night.isoformat(), dep.id, dict(fr.parameters), []))
            entry.flow_runs.append(fr)
    for entry in by_id.values():
        entry.flow_runs.sort(key=lambda fr: fr.created or fr.expected_start_time)
    return list(by_id.values())


def _state_age_s(flow_run: Any) -> float:
    stamp = flow_run.state.timestamp if flow_run.state else None
    if stamp is None:
        return float("inf")
    return (_dt.datetime.now(_dt.UTC) - stamp).total_seconds()


def _lease_free(run_id: str) -> bool:
    """Whether no session holds the run's lease for a whole ``REGAIN_S`` and more: a live attempt
    whose session a database restart ended takes its lease again within that time, and an attempt
    between its start and its lease takes it within a second."""
    deadline = time.monotonic() + coordination.REGAIN_S + 5.0
    while True:
        if coordination.lock_is_held(run_lease(run_id)):
            return False
        if time.monotonic() >= deadline:
            return True
        time.sleep(1.0)


def _crash(client: Any, flow_run: Any, why: str) -> bool:
    """Set the flow run CRASHED unless it ended meanwhile: its state is read again (the sweep's
    snapshot is seconds old by now) and the transition is proposed, not forced, so a run that
    reported COMPLETED in between keeps it. Whether it was crashed."""
    from prefect.client.schemas.objects import StateType
    from prefect.states import Crashed

    now = client.read_flow_run(flow_run.id)
    if now.state is None or now.state.type not in (StateType.RUNNING, StateType.PENDING):
        flow_run.state = now.state
        return False
    result = client.set_flow_run_state(flow_run.id, Crashed(message=why))
    if getattr(result.status, "value", result.status) != "ACCEPT":
        flow_run.state = client.read_flow_run(flow_run.id).state
        return False
    flow_run.state = Crashed(message=why)
    return True


def sweep(
    pool: str, retries: int = 3, grace_s: float = 60.0, pending_grace_s: float = PENDING_GRACE_S
) -> list[str]:
    """One pass over the pool's nights (module docstring); what it did, one line each."""
    from prefect import get_client

    done: list[str] = []
    with coordination.try_advisory_lock(JANITOR_LOCK) as mine:
        if not mine:
            return done
        with get_client(sync_client=True) as client:
            for night in _nights(client, pool):
                done += _tend(client, night, retries, grace_s, pending_grace_s)
    for line in done:
        log.warning("janitor: %s", line)
    return done


def _tend(client: Any, night: Night, retries: int, grace_s: float, pending_grace_s: float) -> list[str]:
    done: list[str] = []
    for fr in night.flow_runs:
        state = fr.state.type.value if fr.state else None
        allowed = pending_grace_s if state == "PENDING" else grace_s
        if state in LIVE_STATES and _state_age_s(fr) > allowed and _lease_free(night.run_id):
            why = f"janitor: no process holds run {night.run_id}'s lease: its machine is gone"
            if _crash(client, fr, why):
                done.append(f"flow run {fr.name} ({night.run_id}) was {state} with its lease free: crashed")
    states = [fr.state.type.value if fr.state else None for fr in night.flow_runs]
    if "COMPLETED" in states or any(s in TO_COME_STATES for s in states) or states[-1] != "CRASHED":
        return done
    if len(night.flow_runs) > retries:
        done.append(f"night {night.run_id} crashed {len(night.flow_runs)} times: no retry left ({retries})")
        return done
    params = {**night.parameters, "nightly": True, "night": night.night}
    new = client.create_flow_run_from_deployment(
        night.deployment_id, parameters=params, tags=["qerl", RERUN_TAG, f"qerl-run:{night.run_id}"]
    )
    done.append(
        f"night {night.run_id}: started flow run {new.name} (attempt {len(night.flow_runs) + 1} "
        f"of {retries + 1}) after {night.flow_runs[-1].name} crashed"
    )
    return done
