"""The RL steps of a run: rollout -> score -> train, an evaluation every ``loop.eval_every``, and the
``Chain`` of the run's checkpoints.

Runs share artifacts up to where their configs part (a config changed only in later steps), and the
other run's retention may have pruned the checkpoint this run continues from. ``Chain`` holds the
run's checkpoints with the scored rollouts each was trained on; a consumer that must build from the
last one (a rollout, an evaluation, the next train step) gets it whole again: the checkpoints from
the last whole one on are rebuilt in order, each checked against its recorded digests (the store's
heal), so every key downstream stays valid; a rebuild with other bytes (a GPU) is re-keyed and the
step's record entry says so. Retention cannot prevent this alone: the other run may have completed,
and pruned, before this one started.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

from qerl.flows import report, tasks
from qerl.flows.attempt import Base, Clock, Run
from qerl.pipeline.planning.prompt_stream import step_prompts
from qerl.pipeline.registry import live
from qerl.pipeline.rollout.aqn import sigma_schedule
from qerl.pipeline.rollout.lazy import LazyEngine
from qerl.pipeline.store import retention
from qerl.pipeline.store.manifest import Adapter, Manifest
from qerl.pipeline.store.retention_inputs import PrunedInputError
from qerl.pipeline.store.run_record import Rekey
from qerl.stages import train

T = TypeVar("T")


def train_steps(
    run: Run, base: Base, engine: LazyEngine, problems: list[Any], warm: Manifest | None
) -> Manifest:
    """The RL steps: rollout -> score -> train, and an evaluation every ``loop.eval_every``; the
    record is saved and retention applied after each. Returns the last checkpoint."""
    cfg, rec, ui = run.cfg, run.record, run.ui
    assert rec.plan is not None
    steps = cfg.loop.steps
    ui.steps_start(
        steps, (steps // cfg.loop.eval_every if cfg.loop.eval_every else 0) + 1 + int(cfg.loop.eval_base)
    )
    chain = Chain(run, base.quantized, warm)
    for step in range(steps):
        clock = Clock(engine)
        sigma = sigma_schedule(step, steps, cfg.aqn) if cfg.aqn.enabled else 0.0
        batch = step_prompts(problems, rec.plan.start_slot + step, cfg.loop.prompts_per_step, cfg.loop.seed)
        r = chain.build_from_last(partial(_rollouts, run, base, engine, batch, sigma, step))
        s = tasks.scored(cfg=cfg, rollouts=r, store=run.store)
        t = chain.train(s, step)
        entry = report.step_entry(step, sigma, r, s, t)
        rec.steps.append(entry)
        run.logger.info(
            "step %d/%d sigma=%.2e reward=%.3f accuracy=%.3f",
            step + 1,
            steps,
            sigma,
            s.metrics.get("reward_mean", float("nan")),
            s.metrics.get("accuracy", float("nan")),
        )
        cached = all(run.cached(m) for m in (r, s, t))
        ui.step(step, entry.metrics, clock.seconds, cached, clock.startup + _policy_load(run, t))
        if step + 1 < steps and cfg.loop.eval_every and (step + 1) % cfg.loop.eval_every == 0:
            chain.build_from_last(partial(_evaluate_last, run, base, engine, step + 1, chain))
        if run.live is not None:
            live.log_record(run.live, rec)
        run.save()
        retention.prune_run(run.work, run.run_id, cfg.store)  # after the save: the record names this step
    ui.steps_end()
    assert chain.last is not None  # loop.steps >= 1
    return chain.last


def _policy_load(run: Run, t: Manifest) -> float:
    """The trainer's one-time load of the policy, when this attempt built step ``t`` from a loaded
    (not resident) one: start-up, like the engine's."""
    if run.cached(t) or t.extra.get("policy") != "loaded":
        return 0.0
    return float(t.extra.get("policy_load_s") or 0.0)


def _rollouts(
    run: Run,
    base: Base,
    engine: LazyEngine,
    batch: list[Any],
    sigma: float,
    step: int,
    adapter: Adapter | None,
) -> Manifest:
    return tasks.rollouts(
        cfg=run.cfg,
        problems=batch,
        base=base.quantized,
        adapter=adapter,
        sigma=sigma,
        step=step,
        store=run.store,
        engine=engine,
    )


def _evaluate_last(
    run: Run, base: Base, engine: LazyEngine, step: int, chain: Chain, adapter: Adapter | None
) -> Manifest:
    return evaluate(run, base, adapter, chain.last, engine, step)


class Chain:
    """The run's checkpoints so far, each with the scored rollouts it was trained on (module
    docstring); a consumer that must build from the last gets it whole."""

    def __init__(self, run: Run, base: Manifest, warm: Manifest | None):
        self.run, self.base, self.warm = run, base, warm
        self.links: list[tuple[Manifest, Manifest]] = []  # (scored, checkpoint) per step

    @property
    def last(self) -> Manifest | None:
        return self.links[-1][1] if self.links else None

    def adapter(self) -> Adapter | None:
        """What the next step builds from: the last checkpoint, else the warm start, else none."""
        start = self.last or self.warm
        return Adapter.of(start) if start is not None else None

    def build_from_last(self, consume: Callable[[Adapter | None], T]) -> T:
        """``consume(adapter)``; when it must build from the last checkpoint's pruned adapter (a
        cache hit needs none), the chain is made whole first and it is called again."""
        try:
            return consume(self.adapter())
        except PrunedInputError as err:
            last = self.last
            if last is None or (err.stage, err.key) != (last.stage, last.key):
                raise
            self.run.logger.warning("%s: rebuilding it", err)
            self._rebuild()
            return consume(self.adapter())

    def train(self, scored: Manifest, step: int) -> Manifest:
        """The checkpoint after ``step``, trained on ``scored`` from the last one (made whole first
        when this step must be built)."""
        cfg, store, prev = self.run.cfg, self.run.store, self.last
        if (
            prev is not None
            and prev.pruned
            and train.cached(cfg=cfg.train, base=self.base, scored=scored, prev=prev, step=step, store=store)
            is None
        ):
            self._rebuild()
            prev = self.last
        init = Adapter.of(self.warm) if prev is None and self.warm is not None else None
        made = tasks.trained(
            cfg=cfg, base=self.base, scored=scored, prev=prev, step=step, store=store, init=init
        )
        self.links.append((scored, made))
        return made

    def _rebuild(self) -> None:
        """The checkpoints from the last whole one on, rebuilt in order through the store's heal: the
        same bytes go back under the same keys; a rebuild with other bytes (a GPU) is re-keyed, and
        the step's record entry names the new key (``rekeyed``)."""
        run = self.run
        first = max((i for i, (_, t) in enumerate(self.links) if not t.pruned), default=-1) + 1
        run.logger.info(
            "run %s: rebuilding the pruned checkpoints of steps %d..%d",
            run.run_id,
            first,
            len(self.links) - 1,
        )
        prev = self.links[first - 1][1] if first > 0 else None
        for i in range(first, len(self.links)):
            scored, old = self.links[i]
            init = Adapter.of(self.warm) if prev is None and self.warm is not None else None
            prev = train.run(
                cfg=run.cfg.train,
                base=self.base,
                scored=scored,
                prev=prev,
                step=i,
                store=run.store,
                init_adapter=(init.dir, init.digest) if init else None,
                heal=True,
            )
            if prev.key != old.key:
                why = prev.extra.get("rekey_reason") or "built on an earlier step's re-keyed checkpoint"
                entry = run.record.steps[i]
                assert entry.manifests is not None
                entry.manifests.train = prev.key
                entry.rekeyed = Rekey(source=old.key, to=prev.key, why=why)
                run.logger.warning(
                    "run %s step %d: checkpoint %s replaced by %s (%s)", run.run_id, i, old.key, prev.key, why
                )
            self.links[i] = (scored, prev)


def evaluate(
    run: Run,
    base: Base,
    adapter: Adapter | None,
    checkpoint: Manifest | None,
    engine: LazyEngine,
    step: int,
    validation: list[Any] | None = None,
) -> Manifest:
    """Evaluate ``adapter`` (None: the base alone), with ``validation`` beside the benchmark; its
    entry goes into the record."""
    clock = Clock(engine)

    def progress(done: int, total: int) -> None:
        run.ui.progress("evaluate", done, total)

    ev = tasks.evaluation(
        cfg=run.cfg,
        base=base.quantized,
        adapter=adapter,
        store=run.store,
        engine=engine,
        validation=validation,
        progress=progress,
    )
    entry = report.evaluation_entry(step, checkpoint, ev)
    run.record.evaluations.append(entry)
    who = f"adapter after step {step}" if adapter else "base, no adapter"
    run.show("evaluate", f"{who}: {report.eval_text(entry)}", clock, ev)
    return ev
