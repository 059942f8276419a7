"""Held-out lineage: which validation items no run of a registered version's lineage trained on.

Paired promotion is fair only on items neither side trained on. Each version carries the digest of
its run's validation items (``validation_digest``) and of the items its whole lineage held out
(``heldout_lineage``, ``HELDOUT_TAG``): a run from the bare base held out its own; a warm start keeps
them only if the version it started from held out the same ones, else the lineage is ``none``, and
stays so for every descendant (``heldout_lineage``). ``heldout_conflict`` says why a comparison would
be unfair.

A lineage loses the status without having trained on the items when a version predates the tag (an
existing registry's first upgraded night) or the split moved with the data. ``attest_heldout`` is the
operator's way back (``qerl heldout NAME VERSION --reason TEXT``): it sets a version's held-out items,
its run's validation digest unless ``items`` names others, and records who did it, when, why and what
the tag was (``heldout_attested``), so every later night warm-started from it compares again.
"""

from __future__ import annotations

import datetime as _dt
import json
from collections.abc import Mapping
from typing import Any

from mlflow.entities.model_registry import ModelVersion
from mlflow.tracking import MlflowClient
from qerl.pipeline.registry.lock import RegistryError

__all__ = [
    "ATTESTED_TAG",
    "HELDOUT_TAG",
    "NO_HELDOUT",
    "attest_heldout",
    "heldout_conflict",
    "heldout_lineage",
]

HELDOUT_TAG = "heldout_lineage"  # the validation items every run of a version's lineage held out
NO_HELDOUT = "none"


def heldout_lineage(validation_digest: str, warm_start_tags: Mapping[str, str] | None) -> str:
    """The digest of the validation items that no run of a version's lineage trained on: its run's
    ``validation_digest`` when the run started from the bare base (``warm_start_tags`` None) or from a
    version whose lineage held out the same items; else ``NO_HELDOUT`` (some run of the lineage held
    out other items, or none, and may have trained on these)."""
    if validation_digest == NO_HELDOUT or warm_start_tags is None:
        return validation_digest
    return validation_digest if warm_start_tags.get(HELDOUT_TAG) == validation_digest else NO_HELDOUT


def heldout_conflict(champion: ModelVersion | None, lineage: Mapping[str, Any]) -> str | None:
    """Why paired evidence on the candidate's validation items would be unfair (None: it is not):
    the candidate's lineage, or the champion's, may have trained on them."""
    items = str(lineage.get("validation_digest", NO_HELDOUT))
    if items == NO_HELDOUT:
        return "it held out no validation items"
    if lineage.get(HELDOUT_TAG) != items:
        return (
            f"its lineage may have trained on its own validation items ({items[:12]}): it warm-started "
            "from a version whose lineage held out other items, or none (qerl promote decides by hand; "
            "qerl heldout restores the status of a lineage that did not train on them)"
        )
    held = None if champion is None else champion.tags.get(HELDOUT_TAG)
    if champion is not None and held != items:
        what = f"held out {held[:12]}" if held and held != NO_HELDOUT else "records no held-out items"
        return (
            f"champion v{champion.version}'s lineage {what}, not these validation items ({items[:12]}): "
            "it may have trained on them, which would favour it (qerl promote decides by hand; qerl "
            "heldout restores the status of a lineage that did not train on them)"
        )
    return None


ATTESTED_TAG = "heldout_attested"  # who set HELDOUT_TAG by hand, when, why, and what it was


def attest_heldout(name: str, version: str, reason: str, by: str, items: str | None = None) -> dict[str, Any]:
    """Set ``name`` v``version``'s held-out items (``items``, default its ``validation_digest`` tag)
    and record the attestation as the ``heldout_attested`` tag; returns the record. Call under the
    registry lock."""
    if not reason.strip():
        raise RegistryError("an attestation needs a reason (--reason): it is kept beside the tag")
    client = MlflowClient()
    mv = client.get_model_version(name, str(version))
    digest = items or mv.tags.get("validation_digest")
    if not digest or digest == NO_HELDOUT:
        raise RegistryError(
            f"{name} v{version} records no validation items (validation_digest "
            f"{mv.tags.get('validation_digest', 'absent')}): pass the digest its lineage held out (--items)"
        )
    record = {
        "at": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"), "by": by, "reason": reason.strip(),
        "items": digest, "was": mv.tags.get(HELDOUT_TAG),
    }  # fmt: skip
    client.set_model_version_tag(name, str(version), HELDOUT_TAG, digest)
    client.set_model_version_tag(name, str(version), ATTESTED_TAG, json.dumps(record, sort_keys=True))
    return record
