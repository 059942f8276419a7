"""Rebuilding what retention pruned, for a run that must build from it (the RL flow's step loop).

Runs share artifacts up to where their configs part (an ablation's AQN arm equals its no-AQN arm
while sigma is 0; a config changed only in later steps), and one run's retention may prune a
checkpoint the other must continue from, or an adapter its rollout or evaluation must load.
``healing`` runs such a consumer and, when it raises ``PrunedInputError`` for the checkpoint the
run continues from, rebuilds that checkpoint (``heal_chain``) and runs the consumer again.
``heal_chain`` rebuilds the checkpoints from the last whole one on through the store's heal
(``ArtifactStore._heal``): the same bytes (the CPU trainer; the GPU trainer under
``train.deterministic``) put the files back under the same keys; other bytes (another GPU or driver)
are re-keyed, and the run record's step entry names the new key (``rekeyed``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from qerl.pipeline.store.layout import TRAIN_STAGE
from qerl.pipeline.store.manifest import Manifest
from qerl.pipeline.store.retention_inputs import PrunedInputError
from qerl.stages import train

if TYPE_CHECKING:
    from qerl.flows.rl_phases import Run

log = logging.getLogger("qerl.flow")


def heal_chain(
    run: Run, quantized: Manifest, history: list[tuple[Manifest, Manifest]], warm: Manifest | None
) -> Manifest:
    """The last checkpoint of ``history`` made whole again, for a step that must be built from it.

    A run that found its steps cached can reach one it must build (it diverges from the run that
    made them: the AQN arm after the noise-free first stage) whose previous checkpoint the other
    run's retention pruned. The checkpoints from the last whole one on are rebuilt in order, each
    checked against its recorded digests (``ArtifactStore._heal``): the same bytes, so the keys
    downstream stay valid. A rebuild that gives other bytes (a GPU) is re-keyed: a new checkpoint,
    and the ones after it are built on it; the run record's step entry names the new key and says
    so (``rekeyed``).
    """
    last_whole = max((i for i, (_, t) in enumerate(history) if not t.pruned), default=-1)
    prev = history[last_whole][1] if last_whole >= 0 else None
    log.info(
        "run %s: rebuilding the pruned checkpoints of steps %d..%d",
        run.run_id,
        last_whole + 1,
        len(history) - 1,
    )
    for i in range(last_whole + 1, len(history)):
        init = warm if prev is None else None
        init_adapter = (init.dir / "adapter", init.digest) if init is not None else None
        prev = train.run(
            cfg=run.cfg.train,
            base=quantized,
            scored=history[i][0],
            prev=prev,
            step=i,
            store=run.store,
            init_adapter=init_adapter,
            heal=True,
        )
        if prev.key != history[i][1].key:
            _record_rekey(run, i, history[i][1], prev)
        history[i] = (history[i][0], prev)
    assert prev is not None
    return prev


def _record_rekey(run: Run, step: int, old: Manifest, new: Manifest) -> None:
    """The step's record entry names the checkpoint that replaced ``old`` (its metrics stay old's)."""
    why = new.extra.get("rekey_reason") or "built on an earlier step's re-keyed checkpoint"
    entry = run.record["steps"][step]
    entry["manifests"][TRAIN_STAGE] = new.key
    entry["rekeyed"] = {"from": old.key, "to": new.key, "why": why}
    run.logger.warning(
        "run %s step %d: checkpoint %s replaced by %s (%s)", run.run_id, step, old.key, new.key, why
    )


def healing(
    run: Run, quantized: Manifest, history: list[tuple[Manifest, Manifest]], warm: Manifest | None,
    prev: Manifest | None, call: Callable[[Manifest | None], Any],
) -> tuple[Any, Manifest | None]:  # fmt: skip
    """``(call(prev), prev)``. A consumer that must build from ``prev``'s pruned adapter raises
    ``PrunedInputError`` (a cache hit needs nothing): ``prev``, the last checkpoint of ``history``,
    is then rebuilt (``heal_chain``, possibly re-keyed) and ``call`` repeated with it."""
    try:
        return call(prev), prev
    except PrunedInputError as err:
        if prev is None or (err.stage, err.key) != (prev.stage, prev.key):
            raise
        run.logger.warning("%s: rebuilding it", err)
        prev = heal_chain(run, quantized, history, warm)
        return call(prev), prev
