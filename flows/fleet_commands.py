"""The fleet's commands: ``qerl worker``, ``qerl fleet init``, ``qerl fleet doctor``, ``qerl fleet janitor``.

The parser blocks live here (``add_parsers``, called by ``qerl.flows.cli``) beside their handlers;
what each does is ``qerl.flows.fleet`` and ``qerl.flows.janitor``. Every one of them talks to the
fleet's services, named by the environment (``qerl.pipeline.fleet.settings``): PREFECT_API_URL,
QERL_FLEET_DB, and the store and registry of the config given with ``--config``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

API_HELP = "the fleet's Prefect API (default: $PREFECT_API_URL)"


def add_parsers(sub: argparse._SubParsersAction, commands: dict[str, str], common: Any, config: Any) -> None:
    """Declare ``worker`` and ``fleet`` on the CLI's subparsers (``common``/``config``: its helpers)."""
    p = sub.add_parser("worker", help="run one GPU's Prefect worker on a fleet's pool (and its janitor)")
    p.add_argument("--pool", required=True, help="the work pool (qerl fleet init creates it)")
    p.add_argument("--gpu", required=True, help="the GPU this worker runs on (CUDA id or UUID)")
    p.add_argument("--name", default=None, help="the worker's name (default: <host>-gpu<id>)")
    p.add_argument("--api-url", default=None, metavar="URL", help=API_HELP)
    p.add_argument(
        "--janitor-every", type=float, default=30.0, metavar="S", help="seconds between janitor passes"
    )
    p.add_argument("--retries", type=int, default=3, help="new flow runs the janitor gives a crashed night")
    p.add_argument("--grace", type=float, default=60.0, metavar="S", help="seconds a run may be silent")
    common(p)
    commands["worker"] = "fleet_commands:cmd_worker"

    p = sub.add_parser("fleet", help="set up and check a team's fleet: init, doctor, janitor")
    fleet_sub = p.add_subparsers(dest="fleet_command", required=True)
    q = fleet_sub.add_parser("init", help="create the pool and the GPU limit; check every service")
    q.add_argument("--pool", required=True, help="the process work pool to create")
    q.add_argument("--gpus", type=int, required=True, help="GPUs in the fleet: the limit nights share")
    q.add_argument("--api-url", default=None, metavar="URL", help=API_HELP)
    config(q, "the nightly config (its store.uri and registry are checked)", "override a setting")
    common(q)
    q = fleet_sub.add_parser(
        "doctor", help="per worker: versions that differ and what a resume there rebuilds"
    )
    q.add_argument("--pool", default=None, help="only this pool's workers")
    common(q)
    q = fleet_sub.add_parser("janitor", help="one janitor pass now (workers run it every --janitor-every)")
    q.add_argument("--pool", required=True)
    q.add_argument("--api-url", default=None, metavar="URL", help=API_HELP)
    q.add_argument("--retries", type=int, default=3)
    q.add_argument("--grace", type=float, default=60.0, metavar="S", help="seconds a run may be silent")
    common(q)
    commands["fleet"] = "fleet_commands:cmd_fleet"


def _api(args: argparse.Namespace) -> None:
    from qerl.flows.orchestration import check_api

    url = getattr(args, "api_url", None) or os.environ.get("PREFECT_API_URL")
    if not url:
        raise RuntimeError("the fleet's Prefect server is not named: pass --api-url or set PREFECT_API_URL")
    os.environ["PREFECT_API_URL"] = url
    check_api(url, needed_for=f"qerl {args.command} needs the fleet's Prefect server")


def cmd_worker(args: argparse.Namespace) -> int:
    from qerl.flows import fleet
    from qerl.pipeline.store.layout import default_work_dir

    _api(args)
    return fleet.run_worker(
        args.pool,
        args.gpu,
        default_work_dir(args.work_dir),
        args.name,
        janitor_every_s=args.janitor_every,
        retries=args.retries,
        grace_s=args.grace,
    )


def cmd_fleet(args: argparse.Namespace) -> int:
    from qerl.flows import fleet, janitor
    from qerl.pipeline.store.layout import default_work_dir

    if args.fleet_command == "init":
        from qerl.pipeline.planning.run_config import load_run_config

        _api(args)
        cfg = load_run_config(args.config, args.set) if args.config else None
        failed = 0
        for label, ok, what in fleet.init(args.pool, args.gpus, cfg):
            print(f"  {'ok ' if ok else 'FAIL'} {label:9} {what}")
            failed += not ok
        print(f"qerl fleet init: {'ready' if not failed else f'{failed} check(s) failed'}")
        return 0 if not failed else 1
    if args.fleet_command == "doctor":
        for line in fleet.doctor(args.pool, default_work_dir(args.work_dir)):
            print(line)
        return 0
    _api(args)
    started = time.monotonic()
    done = janitor.sweep(args.pool, retries=args.retries, grace_s=args.grace)
    for line in done:
        print(f"  {line}")
    print(f"qerl fleet janitor: {len(done)} action(s) in {time.monotonic() - started:.1f} s", file=sys.stderr)
    return 0
