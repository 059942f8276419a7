"""``qerl gc``: plan what retention releases and deletes, print it, and carry it out.

The handler asks ``qerl.pipeline.registry.release`` which registered versions ``store.keep_versions``
lets go, has ``qerl.pipeline.store.retention`` plan the deletions with those releases in view, prints
both (``--dry-run`` stops there), then releases first and deletes after, skipping the deletions of a
release that did not happen.
"""

from __future__ import annotations

import argparse

from pydantic import ValidationError
from qerl.pipeline.registry import release
from qerl.pipeline.schemes import scheme_module_name
from qerl.pipeline.store import retention
from qerl.pipeline.store.code_version import code_version
from qerl.pipeline.store.layout import STORE_DIR, default_work_dir
from qerl.pipeline.store.retention_policy import RetentionConfig, RetentionError


def _base_code_versions() -> dict[str, set[str]]:
    """The installed code versions of each base stage, one per scheme, as its ``run`` computes them
    (from the modules' source: nothing is imported), for ``qerl gc``'s superseded copies."""
    stages = "qerl.stages."
    return {
        "demo-base": {code_version(stages + "demo_base")},
        "fetch-model": {code_version(stages + "fetch_model")},
        "quantize": {code_version(stages + m) for m in ("quantize", "quantize_nf4", "quantize_none")},
        # as qerl.stages.dequantize.code_roots gives them
        "dequantize": {code_version(stages + "dequantize", scheme_module_name(s)) for s in ("nvfp4", "nf4")},
    }


def _count(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


def cmd_gc(args: argparse.Namespace) -> int:
    work = default_work_dir(args.work_dir)
    names = ("keep_optimizer_last", "keep_adapters_every", "live_window_h", "keep_versions")
    overrides = {n: getattr(args, n) for n in names if getattr(args, n) is not None}
    for name, value in overrides.items():  # the flag, not the first run record, is what is wrong
        try:
            RetentionConfig.model_validate({name: value})
        except ValidationError as err:
            reason = err.errors()[0]["msg"]
            raise RetentionError(f"--{name.replace('_', '-')} {value}: {reason}") from None
    notes: list[str] = []
    planned = release.plan_releases(work, overrides, notes) if (work / STORE_DIR).is_dir() else []
    gc_plan = retention.plan(work, overrides=overrides, current_code=_base_code_versions(), releasing=planned)
    for note in notes + gc_plan.notes:
        print(f"  {note}")
    human = retention.human_bytes
    for rel in planned:
        what = "already tagged released; its files" if rel.already else "its adapter in MLflow"
        print(f"  {human(rel.nbytes):>10}  release {rel.label} in {rel.registry}: {what}  [{rel.reason}]")
    for d in gc_plan.deletions:
        what = ", ".join(d.files) if d.files else "(leftovers)" if d.kind == "prune" else "whole folder"
        print(f"  {human(d.nbytes):>10}  {d.kind:5} {d.path}: {what}  [{d.reason}]")
    count = _count(len(gc_plan.deletions), "deletion") + (
        f" and {_count(len(planned), 'release')}" if planned else ""
    )
    nbytes = gc_plan.nbytes + sum(r.nbytes for r in planned)
    if not gc_plan.deletions and not planned:
        print(f"gc {work / STORE_DIR}: nothing to delete")
    elif args.dry_run:
        print(f"gc --dry-run: would free {human(nbytes)} in {count}")
    else:
        failed: list[str] = []
        done = release.release_all(work, planned, failed)
        for note in failed:
            print(f"  {note}: its store copies stay until the next gc")
        gc_plan.deletions = [d for d in gc_plan.deletions if not d.release or d.release in done]
        freed = retention.apply(work, gc_plan) + sum(r.nbytes for r in planned if r.label in done)
        count = _count(len(gc_plan.deletions), "deletion") + (
            f" and {_count(len(done), 'release')}" if planned else ""
        )
        print(f"gc: freed {human(freed)} in {count}")
    return 0
