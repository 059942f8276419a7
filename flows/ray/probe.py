"""The probe before any run: a zero-CPU task on every alive node reads a token the driver wrote under
the work dir and reports the node's package versions; a node that does not see the token (the work
dir not mounted at the same path) or runs other versions than the driver stops the ablation before
it starts."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import uuid
from pathlib import Path
from typing import Any

from qerl.flows.ray.rules import FanoutError
from qerl.pipeline.store.code_version import installed_versions

VERSIONS = ("qerl", "prefect", "prefect-ray", "ray", "torch", "mlflow")  # must match on every node
PROBE_TIMEOUT_S = 600.0  # the first task on a node also sets up the runtime env (py_modules download)


def package_versions() -> dict[str, str | None]:
    """The installed versions of ``VERSIONS`` (None: not installed)."""
    return installed_versions(VERSIONS)


def alive_nodes(ray: Any) -> list[dict[str, Any]]:
    """The cluster's nodes that are alive (``ray.nodes()`` entries)."""
    return [n for n in ray.nodes() if n.get("Alive") or n.get("alive")]


def _probe(token_path: str) -> dict[str, Any]:
    """Runs on one node: does it see the driver's work dir, and with which package versions?"""
    import ray

    path = Path(token_path)
    return {
        "node_id": ray.get_runtime_context().get_node_id(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "token": json.loads(path.read_text())["token"] if path.is_file() else None,
        "versions": package_versions(),
    }


def probe_nodes(ray: Any, work: Path, timeout_s: float = PROBE_TIMEOUT_S) -> list[dict[str, Any]]:
    """A zero-CPU probe on every alive node with resources; raises ``FanoutError`` naming the nodes that
    do not see the work dir or run other package versions than the driver."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    token = uuid.uuid4().hex
    token_path = work / "ray-probe" / f"{token}.json"
    token_path.parent.mkdir(parents=True, exist_ok=True)
    token_path.write_text(json.dumps({"token": token, "host": socket.gethostname(), "pid": os.getpid()}))
    nodes = [n for n in alive_nodes(ray) if n.get("Resources", {}).get("CPU", 0) > 0]
    remote_probe = ray.remote(num_cpus=0, max_retries=0)(_probe)
    refs = [
        remote_probe.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
        ).remote(str(token_path))
        for n in nodes
    ]
    try:
        answers = ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError as err:
        raise FanoutError(
            f"a node of the Ray cluster did not answer the probe within {timeout_s:.0f} s"
        ) from err
    finally:
        token_path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # the folder goes when no other driver's probe is in it
            token_path.parent.rmdir()
    mine = package_versions()
    problems = []
    for node, answer in zip(nodes, answers, strict=True):
        where = f"node {answer['host']} ({node.get('NodeManagerAddress')})"
        if answer["token"] != token:
            problems.append(
                f"{where} does not see the work dir {work} (mount it at the same path on every node)"
            )
        differ = {
            k: (v, answer["versions"].get(k)) for k, v in mine.items() if answer["versions"].get(k) != v
        }
        if differ:
            text = ", ".join(f"{k} {theirs} (driver: {ours})" for k, (ours, theirs) in differ.items())
            problems.append(f"{where} runs other package versions: {text}")
    if problems:
        raise FanoutError("the Ray cluster cannot run this ablation: " + "; ".join(problems))
    return answers
