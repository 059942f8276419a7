"""Retries: only transient failures are retried, and a dead rollout engine is rebuilt, not reused."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from qerl.pipeline.config import ConfigError
from qerl.pipeline.planning.errors import RunPlanError
from qerl.pipeline.planning.prompt_fit import fit_prompts
from qerl.pipeline.planning.retry import is_transient
from qerl.pipeline.rollout import factory
from qerl.pipeline.rollout.config import RolloutConfig
from qerl.pipeline.rollout.lazy import LazyEngine
from qerl.pipeline.rollout.protocol import EngineError


class EngineDeadError(RuntimeError):
    """Named as vLLM's: the engine core process is gone."""


class FakeEngine:
    def __init__(self, dies: bool):
        self.mode, self.info, self.tokenizer = "hf-nvfp4-emulated", {}, None
        self.dies, self.closed, self.calls = dies, False, 0

    def set_adapter(self, path, digest) -> None:  # noqa: ANN001
        pass

    def set_noise(self, sigma, seed) -> None:  # noqa: ANN001
        pass

    def generate(self, prompts, n, sampling, seed):  # noqa: ANN001, ANN201
        self.calls += 1
        if self.dies:
            raise EngineDeadError("EngineCore encountered an issue")
        return [["ok"] * n for _ in prompts]

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def fake_engines(monkeypatch):
    built: list[FakeEngine] = []

    def build(cfg, quantized, twin, aqn=False):  # noqa: ANN001, ANN202
        engine = FakeEngine(dies=not built)  # the first one dies on its first generate
        built.append(engine)
        return engine

    monkeypatch.setattr(factory, "build_engine", build)
    return built


def test_a_lazy_engine_builds_its_engine_for_aqn_when_asked(monkeypatch):
    """The run's engine is built for AQN (``aqn=cfg.aqn.active`` in the RL flow), a rebuild too."""
    asked = []
    monkeypatch.setattr(
        factory, "build_engine", lambda cfg, q, t, aqn=False: asked.append(aqn) or FakeEngine(dies=False)
    )
    LazyEngine(RolloutConfig(engine="hf"), None, None, aqn=True).generate(["p"], 1, None, 0)
    LazyEngine(RolloutConfig(engine="hf"), None, None).generate(["p"], 1, None, 0)
    assert asked == [True, False]


def test_a_dead_engine_is_dropped_and_rebuilt(fake_engines):
    lazy = LazyEngine(RolloutConfig(engine="hf"), None, None)
    with pytest.raises(EngineDeadError):
        lazy.generate(["p"], 2, None, 0)
    assert fake_engines[0].closed and not lazy.started  # the corpse is gone
    assert lazy.generate(["p"], 2, None, 0) == [["ok", "ok"]]
    assert lazy.builds == 2 and fake_engines[1].calls == 1


def test_a_deterministic_engine_error_keeps_the_engine(monkeypatch):
    class Broken(FakeEngine):
        def generate(self, prompts, n, sampling, seed):  # noqa: ANN001, ANN201
            raise EngineError("prompt too long")

    monkeypatch.setattr(factory, "build_engine", lambda *a, **k: Broken(dies=False))
    lazy = LazyEngine(RolloutConfig(engine="hf"), None, None)
    with pytest.raises(EngineError):
        lazy.generate(["p"], 2, None, 0)
    assert lazy.started and lazy.builds == 1


def test_transient_or_not():
    import httpx

    transient = [
        EngineDeadError("gone"),
        ConnectionRefusedError("refused"),
        TimeoutError("slow"),
        sqlite3.OperationalError("database is locked"),
        httpx.ConnectError("no route"),
    ]
    wrapped = RuntimeError("registry write failed")
    wrapped.__cause__ = sqlite3.OperationalError("database is locked")
    deterministic = [
        EngineError("max_new_tokens too large"),
        ConfigError("unknown key"),
        ValueError("bad row"),
        FileNotFoundError("no model"),
        KeyError("x"),
        RuntimeError("CUDA out of memory"),
    ]
    assert all(is_transient(e) for e in [*transient, wrapped])
    assert not any(is_transient(e) for e in deterministic)


@pytest.mark.slow
def test_flow_tasks_retry_transient_errors_only(fake_engines, tmp_path):
    """Through Prefect itself: a deterministic error runs once, a dead engine is retried and rebuilt."""
    from qerl.flows.orchestration import prepare_environment

    prepare_environment(tmp_path)
    from prefect import flow, task
    from qerl.flows.tasks import RETRY_OPTS

    opts = {**RETRY_OPTS, "retry_delay_seconds": 0}
    attempts: list[str] = []

    @task(**opts)
    def deterministic() -> None:
        attempts.append("deterministic")
        raise EngineError("the config asks for something the engine cannot do")

    @task(**opts)
    def generate(lazy: LazyEngine) -> list:
        attempts.append("generate")
        return lazy.generate(["p"], 1, None, 0)

    @flow
    def probe() -> list:
        lazy = LazyEngine(RolloutConfig(engine="hf"), None, None)
        out = generate(lazy)
        with pytest.raises(EngineError):
            deterministic()
        return [out, lazy.builds]

    out, builds = probe()
    assert out == [["ok"]] and builds == 2
    assert attempts == ["generate", "generate", "deterministic"]


def test_fit_prompts_drops_over_long_prompts_with_a_count(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    problems = [{"id": "short", "question": "1 + 1 ="}, {"id": "long", "question": "1 + 1 = " * 80}]
    fit = fit_prompts(problems, tok, "terse", limit=40)
    assert [p["id"] for p in fit.kept] == ["short"]
    report = fit.report()
    assert report["dropped_too_long"] == 1 and report["loaded"] == 2 and report["prompt_token_limit"] == 40
    assert report["dropped_examples"][0]["id"] == "long" and report["dropped_examples"][0]["tokens"] > 40
    with pytest.raises(RunPlanError, match="no prompt fits"):
        fit_prompts(problems[1:], tok, "terse", limit=40)
