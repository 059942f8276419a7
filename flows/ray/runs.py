"""The runs of a Ray fan-out: the Prefect task one (arm, seed) run is in its Ray worker
(``ablation_run``), and the driver's loop that submits them all and collects them as they finish
(``run_all``).

``max_calls=1``: each run gets a fresh worker process, so the engine, the resident policy, GPU memory
and the console's redirected file descriptors go with it. ``max_retries=0``: a worker that dies fails
its run; the others go on, and the ablation fails after all have finished, naming the failed runs
(the same command again resumes them). In the worker the run's console is the quiet one of
``qerl run`` with its log in ``<work>/runs/<run id>/run.log``; the driver's console shows one line
per finished run (arm, seed, final accuracy, duration, node and pid).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from qerl.flows import console
from qerl.flows.ray.rules import FanoutError


def _check_worker(work: Path, aid: str, tracking_uri: str, config: dict[str, Any]) -> None:
    """In the worker, before the run: the same store and the same registry as the driver."""
    from qerl.flows.ablate import ablation_dir
    from qerl.pipeline.planning.run_config import RunConfig
    from qerl.pipeline.registry import tracking as registry
    from qerl.pipeline.store.layout import ABLATION_RECORD

    if not (ablation_dir(work, aid) / ABLATION_RECORD).is_file():
        raise FanoutError(
            f"{socket.gethostname()} does not see the ablation under the work dir {work}: mount the "
            "work dir at the same path on every node"
        )
    mine, _ = registry.resolve_uris(RunConfig.model_validate(config).registry, work)
    if mine != tracking_uri:
        raise FanoutError(
            f"the worker resolves the MLflow tracking URI to {mine}, the driver to {tracking_uri}"
        )


@task(name="ablation-run", cache_policy=NO_CACHE, persist_result=False)
def ablation_run(
    config: dict[str, Any], work_dir: str, ablation: dict[str, Any], tracking_uri: str
) -> dict[str, Any]:
    """One (arm, seed) run in a Ray worker, its console quiet (its log in the run's run.log); returns
    where it ran and its final accuracy."""
    import ray
    from qerl.flows.run import rl_flow
    from qerl.pipeline.planning.run_config import RunConfig
    from qerl.pipeline.planning.runs import run_id_for
    from qerl.pipeline.store.run_record import run_dir

    work = Path(work_dir)
    _check_worker(work, ablation["id"], tracking_uri, config)
    run_id = run_id_for(RunConfig.model_validate(config))
    where = {
        "pid": os.getpid(),
        "node_id": ray.get_runtime_context().get_node_id(),
        "host": socket.gethostname(),
    }
    t0 = time.perf_counter()
    with console.session(run_dir(work, run_id) / console.LOG_NAME, keep_fds=True):
        record = rl_flow(config=config, work_dir=work_dir, ablation=ablation)
    final = [e for e in record.evaluations if e.adapter is not None]
    return {
        "run_id": run_id,
        "status": record.status,
        "seconds": time.perf_counter() - t0,
        "accuracy": final[-1].accuracy if final else None,
        "stderr": final[-1].stderr if final else None,
        **where,
    }


def _line(i: int, n: int, p: dict[str, Any], result: dict[str, Any] | None, err: BaseException | None) -> str:
    head = f"run {i}/{n} {'done' if err is None else 'FAILED'}: arm {p['arm']} seed {p['replicate']} ({p['run_id']})"
    if err is not None:
        return f"{head}: {type(err).__name__}: {err} (log: runs/{p['run_id']}/run.log)"
    assert result is not None
    acc = result.get("accuracy")
    text = (
        ""
        if acc is None
        else f" accuracy {acc:.3f}"
        + (f" ± {result['stderr']:.3f}" if result.get("stderr") is not None else "")
    )
    return f"{head}{text} in {console.fmt_duration(result['seconds'])} [node {result['node_id'][:8]} pid {result['pid']}]"


def run_all(
    planned: list[dict[str, Any]],
    work: Path,
    parent: str,
    aid: str,
    plan: dict[str, Any],
    on_done: Callable[[int, dict[str, Any]], None],
) -> None:
    """Submit every run at once (inside the ablation flow, whose task runner is Ray's), report each as it
    finishes (``on_done(index, worker info)``, one console line), then raise if any failed."""
    import ray
    from prefect.context import FlowRunContext
    from prefect_ray import RayTaskRunner
    from prefect_ray.context import remote_options

    ctx = FlowRunContext.get()
    if ctx is None or not isinstance(ctx.task_runner, RayTaskRunner):
        raise FanoutError(
            "run_all needs the ablation flow on a RayTaskRunner (qerl.flows.ray.connection.cluster)"
        )
    ui = console.current()
    ui.line(
        f"{len(planned)} runs on Ray at {plan['address']} ({plan['num_cpus']:g} CPU, {plan['num_gpus']:g} GPU each; "
        f"cluster: {plan['cluster']['nodes']} node(s), {plan['cluster']['CPU']:g} CPU, {plan['cluster']['GPU']:g} GPU)"
    )
    pending: dict[Any, tuple[int, Any]] = {}
    with remote_options(num_cpus=plan["num_cpus"], num_gpus=plan["num_gpus"], max_calls=1, max_retries=0):
        for i, p in enumerate(planned):
            info = {"id": aid, "arm": p["arm"], "replicate": p["replicate"], "parent_run_id": parent}
            future = ablation_run.with_options(name=f"run-{p['arm']}-s{p['replicate']}").submit(
                config=p["config"], work_dir=str(work), ablation=info, tracking_uri=plan["tracking_uri"]
            )
            pending[future.wrapped_future] = (i, future)
    failed, done = [], 0
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1)
        i, future = pending.pop(ready[0])
        done += 1
        try:
            result, err = future.result(raise_on_failure=True), None
        except Exception as exc:  # noqa: BLE001 - reported, and the ablation fails after the others
            result, err = None, exc
        ui.line(_line(done, len(planned), planned[i], result, err))
        if err is None:
            on_done(i, {k: result[k] for k in ("pid", "node_id", "host", "seconds")})
        else:
            failed.append(f"{planned[i]['run_id']} ({type(err).__name__}: {err})")
    if failed:
        from qerl.pipeline.evaluation.arms import AblationError

        raise AblationError(
            f"{len(failed)} of {len(planned)} runs failed: {'; '.join(failed)}; the others are complete, "
            "the same command resumes the failed ones"
        )
