"""Where the published benchmark files are for the tests that read them (``../shared/data`` of a
developer's checkout; a user's checkout has none, and those tests skip saying where they looked).

``$QERL_DATA_DIR`` names a copy; else the first ``shared/data`` beside the checkout or beside any
folder above it, so a clone at ``/x/main`` or ``/x/clones/main`` beside ``/x/shared`` finds it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

CHECKOUT = Path(__file__).resolve().parents[1]


def _find() -> tuple[Path | None, list[Path]]:
    looked = []
    if os.environ.get("QERL_DATA_DIR"):
        looked.append(Path(os.environ["QERL_DATA_DIR"]))
    looked += [folder / "shared" / "data" for folder in CHECKOUT.parents]
    return next((p for p in looked if (p / "gsm8k" / "test.jsonl").is_file()), None), looked


SHARED_DATA, _LOOKED = _find()
needs_shared = pytest.mark.skipif(
    SHARED_DATA is None,
    reason=f"the published benchmark files are in none of {[str(p) for p in _LOOKED[:3]]}... "
    "(set QERL_DATA_DIR to a copy)",
)
