"""The ablation flow (``qerl ablate``): one ordinary run per (arm, seed), then the comparison.

What. ``ablate_flow`` runs ``qerl.flows.run.rl_flow`` as a subflow for every (arm, replicate), one after the
other (arm configs and seeds: ``qerl.pipeline.evaluation.arms``), then compares them
(``qerl.pipeline.evaluation.report``): ``report.md`` and
``plots/*.png`` under ``<work>/ablations/<ablation id>/``, a Prefect table and markdown artifact, and
an MLflow parent run (run name = the ablation id) whose children are the runs' own MLflow runs
(``mlflow.parentRunId``), holding the report, the plots and each arm's accuracy.

Resumption is the runs' own: each run is an ordinary run whose id is its config's hash and whose
stages are cached in the store, so re-running a killed ablation (the same command) finds every
finished stage and builds only what is missing; a completed run costs a store lookup per stage.
The ablation id is the hash of (config, arms, seed count), so the same command is the same ablation;
its record (``ablation.json``) keeps the MLflow parent run id, so a resumed ablation keeps one parent
and the runs' register stages keep their cache keys.

Ablation runs are registered with ``ablation_id`` and ``arm`` lineage tags and never move an alias
(``qerl.stages.register`` with ``promote=False``).

Where the runs go. By default one after the other in this process, each run's stage lines and step
bar on the ablation's console. With a Ray address (``qerl ablate --ray ADDRESS``, ``ray`` parameter)
all runs are submitted at once, each a Prefect task in its own Ray worker process with the resources
it asks for, and the console shows one line per finished run; ``qerl.flows.ray`` has the rules (shared
work dir, registry and Prefect API reachable by every node) and what a worker gets. Either way each
run is the same ordinary run, so the ablation id, the run ids and resumption do not depend on where
the runs went; the record notes the driver and, per run, the worker's node and pid. On a fleet (``qerl ablate --pool NAME``) each
run is a flow run of the deployment ``qerl-rl/ablation-arms`` on the fleet's work pool, so arms and
nights share the GPUs and the fleet-wide limit; the records come back through the shared store.
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
import socket
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from qerl.flows import console
from qerl.flows.run import rl_flow
from qerl.pipeline.config import key_payload
from qerl.pipeline.evaluation.arms import AblationError, ablation_id, arm_config, parse_arms
from qerl.pipeline.evaluation.report import ArmRuns, table_rows, write_report
from qerl.pipeline.planning.run_config import RunConfig
from qerl.pipeline.planning.runs import run_id_for
from qerl.pipeline.registry import tracking as registry
from qerl.pipeline.store.files import atomic_write_json, read_json
from qerl.pipeline.store.layout import ABLATION_DIR, ABLATION_RECORD, default_work_dir
from qerl.pipeline.store.run_record import load_record

log = logging.getLogger("qerl.ablate")


def ablation_dir(work: Path, ablation_id: str) -> Path:
    return work / ABLATION_DIR / ablation_id


def plan_runs(config: dict[str, Any], arms: list[str], seeds: int) -> list[dict[str, Any]]:
    """Every (arm, replicate) with its validated config and run id, in run order (seed-major: the
    first replicate of every arm comes first, so an interrupted ablation already compares arms)."""
    if seeds < 1:
        raise AblationError(f"--seeds must be >= 1, got {seeds}")
    planned = []
    for replicate in range(seeds):
        for arm in arms:
            cfg = RunConfig.model_validate(arm_config(config, arm, replicate))
            planned.append(
                {
                    "arm": arm,
                    "replicate": replicate,
                    "config": cfg.model_dump(mode="json"),
                    "run_id": run_id_for(cfg),
                }
            )
    ids = [p["run_id"] for p in planned]
    if len(set(ids)) != len(ids):  # a config the arms do not change (impossible today): say so, do not merge
        raise AblationError(f"two (arm, seed) runs would share a run id: {ids}")
    return planned


def _parent_run(cfg: RunConfig, work: Path, record: dict[str, Any]) -> str:
    """The MLflow parent run of the ablation: created once, then reused from the ablation record."""
    resolved = registry.connect(cfg.registry, work)
    if not record.get("parent_run_id"):
        tags = {"ablation_id": record["id"], "arms": ",".join(record["arms"]), "seeds": record["seeds"]}
        record["parent_run_id"] = registry.start_run(resolved, run_name=record["id"], tags=tags)
    return str(record["parent_run_id"])


def _arm_runs(work: Path, planned: list[dict[str, Any]], arms: list[str]) -> list[ArmRuns]:
    """Read each finished run's final evaluation (accuracy, per-item rates) and step history."""
    import pyarrow.parquet as pq

    out = {arm: ArmRuns(arm, [], [], [], []) for arm in arms}
    for p in planned:
        record = load_record(work, p["run_id"])
        if record.status != "completed":
            raise AblationError(f"run {p['run_id']} is {record.status}, not completed")
        steps = int(record.loop["steps"])
        final = [e for e in record.evaluations if e.adapter is not None and e.step == steps]
        if not final or final[-1].manifest is None:
            raise AblationError(f"run {p['run_id']} has no evaluation of its final adapter")
        rows = pq.read_table(Path(final[-1].manifest) / "items.parquet").to_pylist()
        arm = out[p["arm"]]
        arm.run_ids.append(p["run_id"])
        arm.final_accuracy.append(final[-1].accuracy)
        arm.items.append({str(r["id"]): float(r["rate"]) for r in rows})
        arm.histories.append(record.history())
        arm.base_accuracy += [e.accuracy for e in record.evaluations if e.adapter is None][-1:]
        arm.quantize.append(record.quantize.model_dump(exclude_none=True) if record.quantize else {})
    return [out[a] for a in arms]


def _log_parent(cfg: RunConfig, parent: str, result: dict[str, Any], out: Path) -> None:
    """The comparison on the MLflow parent run: per-arm accuracy metrics, the report and the plots."""
    client = registry.MlflowClient()
    for arm, r in result["arms"].items():
        client.log_metric(parent, f"accuracy_{arm}", r["accuracy_ci"].mean)
    client.log_artifact(parent, str(out / "report.md"))
    if (out / "plots").is_dir():
        client.log_artifacts(parent, str(out / "plots"), artifact_path="plots")
    client.set_terminated(parent, status="FINISHED")


def _run_sequentially(aid: str, work: Path, planned: list[dict[str, Any]], parent: str) -> None:
    logger = get_run_logger()
    for i, p in enumerate(planned, 1):
        text = f"run {i}/{len(planned)}: arm {p['arm']} seed {p['replicate']} ({p['run_id']})"
        logger.info("ablation %s: %s", aid, text)
        console.current().line(text)
        info = {"id": aid, "arm": p["arm"], "replicate": p["replicate"], "parent_run_id": parent}
        rl_flow(config=p["config"], work_dir=str(work), ablation=info)


def _driver() -> dict[str, Any]:
    return {"pid": os.getpid(), "host": socket.gethostname()}


@flow(name="qerl-ablate", log_prints=True)
def ablate_flow(
    config: dict[str, Any],
    work_dir: str,
    arms: list[str],
    seeds: int,
    n_boot: int = 10_000,
    ray: dict[str, Any] | None = None,
    pool: str | None = None,
) -> dict[str, Any]:
    """Run every (arm, seed) and compare (see the module docstring); returns the ablation record.

    ``ray``: run on a Ray cluster, the plan ``qerl.flows.ray.connection.cluster`` yields (with its task runner on
    this flow: ``ablate_flow.with_options(task_runner=...)``); ``pool``: submit every run to that work
    pool of a fleet; neither: sequentially, in this process."""
    arms = parse_arms(arms)
    base = RunConfig.model_validate(config)  # the user's config must be valid before any arm runs
    work = default_work_dir(work_dir)
    aid = ablation_id(key_payload(base), arms, seeds)  # resource settings are not its identity
    out = ablation_dir(work, aid)
    path = out / ABLATION_RECORD
    previous = read_json(path) if path.is_file() else {}
    planned = plan_runs(base.model_dump(mode="json"), arms, seeds)
    record: dict[str, Any] = {
        "id": aid,
        "arms": arms,
        "seeds": seeds,
        "config": base.model_dump(mode="json"),
        "status": "running",
        "runs": [{k: p[k] for k in ("arm", "replicate", "run_id")} for p in planned],
        "parent_run_id": previous.get("parent_run_id"),
        "driver": _driver(),
        "ray": None if ray is None else {k: ray[k] for k in ("address", "num_cpus", "num_gpus", "cluster")},
        "started_at": previous.get("started_at") or _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
    }
    try:
        parent = _parent_run(base, work, record)
        atomic_write_json(path, record)
        if pool is not None:  # each run a flow run on a fleet's work pool (qerl.flows.fleet)
            from qerl.flows.fleet import run_arms_on_pool

            run_arms_on_pool(planned, work, {"id": aid, "parent_run_id": parent}, pool)
        elif ray is None:
            _run_sequentially(aid, work, planned, parent)
        else:
            from qerl.flows.ray.runs import run_all

            def done(i: int, worker: dict[str, Any]) -> None:  # progress on disk as runs finish
                record["runs"][i]["worker"] = worker
                atomic_write_json(path, record)

            run_all(planned, work, parent, aid, ray, done)
        result, report = write_report(aid, _arm_runs(work, planned, arms), out, n_boot=n_boot)
        _log_parent(base, parent, result, out)
        record.update(
            status="completed",
            report=str(report),
            verdicts=[p.verdict() for p in result["pairs"]],
            table=table_rows(result),
        )
        _publish(aid, report.read_text(), record["table"])
    except BaseException as err:
        record.update(status="failed", error=f"{type(err).__name__}: {err}")
        raise
    finally:
        record["updated_at"] = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
        atomic_write_json(path, record)
    return record


def _publish(aid: str, report: str, rows: list[dict[str, Any]]) -> None:
    """Prefect artifacts; a failure to publish is a warning (the files on disk hold the same)."""
    try:
        create_markdown_artifact(report, key=f"{aid}-report", description="qerl ablation report")
        create_table_artifact(rows, key=f"{aid}-arms", description="final accuracy per arm")
    except Exception as err:  # noqa: BLE001
        log.warning("could not publish Prefect artifacts for %s: %s", aid, err)
