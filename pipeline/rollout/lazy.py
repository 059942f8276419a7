"""``LazyEngine``: an engine built on first use, and rebuilt after its backend died.

A re-run whose stages are all cached starts no vLLM: the run holds a ``LazyEngine`` whose ``mode``
(part of every rollout/evaluate cache key) comes from ``qerl.pipeline.rollout.factory.planned_mode``,
and the real engine is built only when a stage calls it; it must come up in exactly that mode. An
engine that died (vLLM's engine core process gone: ``EngineDeadError``) is dropped when the call
fails, so the task's retry builds a fresh one instead of calling the corpse again. The seconds
spent bringing engines up add up in ``startup_s``: the step or evaluation that paid them reports
them as start-up, which a console's ETA leaves out.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from qerl.pipeline.rollout import factory
from qerl.pipeline.rollout.config import RolloutConfig
from qerl.pipeline.rollout.protocol import Completion, EngineError, RolloutEngine, SamplingSpec
from qerl.pipeline.runtime.errors import cause_chain
from qerl.pipeline.store.manifest import Manifest

__all__ = ["LazyEngine", "engine_died"]

log = logging.getLogger("qerl.engines")


class LazyEngine:
    """An engine built on first use, so a re-run whose stages are all cached starts no vLLM.

    ``mode`` (part of every rollout/evaluate cache key) is known up front from the machine and the
    config; the real engine is checked to run in exactly that mode when it comes up. An engine that
    died (vLLM's engine core process gone: ``EngineDeadError``) is dropped when the call fails, so the
    task's retry builds a fresh one instead of calling the corpse again.
    """

    def __init__(
        self, cfg: RolloutConfig, quantized: Manifest | None, twin: Manifest | None, aqn: bool = False
    ):
        self._args = (cfg, quantized, twin, aqn)
        self.mode, self.implementation_module = factory.planned_mode(cfg, factory.base_scheme(quantized))
        self._engine: RolloutEngine | None = None
        self.builds = 0  # engines built so far (a rebuild after a death makes it 2)
        self.startup_s = 0.0  # seconds spent bringing engines up: start-up, not the stages' work

    @property
    def started(self) -> bool:
        return self._engine is not None

    def _real(self) -> RolloutEngine:
        if self._engine is None:
            t0 = time.perf_counter()
            try:
                engine = factory.build_engine(*self._args)
            finally:
                self.startup_s += time.perf_counter() - t0
            self.builds += 1
            if engine.mode != self.mode:
                engine.close()
                raise EngineError(f"engine came up in mode {engine.mode}, planned {self.mode}")
            self._engine = engine
        return self._engine

    def _call(self, name: str, *args: Any) -> Any:
        try:
            return getattr(self._real(), name)(*args)
        except Exception as err:
            if engine_died(err):
                log.warning(
                    "rollout engine died during %s (%s): it will be rebuilt on the next call", name, err
                )
                self._drop()
            raise

    def _drop(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            try:
                engine.close()
            except Exception as err:  # noqa: BLE001 - a dead engine may fail to close; it is gone either way
                log.warning("closing the dead engine failed: %s", err)

    def set_adapter(self, path: Path | None, digest: str | None) -> None:
        self._call("set_adapter", path, digest)

    def set_noise(self, sigma: float, seed: int) -> None:
        self._call("set_noise", sigma, seed)

    def generate(
        self, prompts: list[str], n: int, sampling: SamplingSpec, seed: int
    ) -> list[list[Completion]]:
        return self._call("generate", prompts, n, sampling, seed)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._real(), name)

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None


def engine_died(err: BaseException) -> bool:
    """Whether ``err`` (or its cause) says the engine's backend is gone (vLLM's ``EngineDeadError``)."""
    return any(
        any(cls.__name__ == "EngineDeadError" for cls in type(exc).__mro__) for exc in cause_chain(err)
    )
