"""An evaluation's per-item rates, as the evaluate stage writes them (``items.parquet``: one row per
item, its id and the fraction of its samples that were right; ``validation/items.parquet`` for the
held-out validation split): what paired comparisons (promotion, a run's lift) read."""

from __future__ import annotations

from qerl.pipeline.store.manifest import Manifest

ITEMS_FILE = "items.parquet"
VALIDATION_ITEMS_FILE = "validation/items.parquet"


def item_rates(evaluation: Manifest, validation: bool = False) -> dict[str, float]:
    """Item id -> rate of ``evaluation``'s benchmark, or of its validation split."""
    import pyarrow.parquet as pq

    table = pq.read_table(
        evaluation.file(VALIDATION_ITEMS_FILE if validation else ITEMS_FILE), columns=["id", "rate"]
    )
    return dict(
        zip(table.column("id").to_pylist(), map(float, table.column("rate").to_pylist()), strict=True)
    )
