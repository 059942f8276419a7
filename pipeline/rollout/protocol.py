"""What every rollout engine offers: the ``RolloutEngine`` protocol and the types it speaks.

What. An engine is built once per run and lives across RL steps. Per step it takes the new LoRA
adapter (``set_adapter``) and the step's AQN sigma (``set_noise``), then ``generate``s n completions
per prompt (``SamplingSpec``) with their per-token sampler logprobs (``Completion``). ``EngineError``
says an engine cannot run as configured.

AQN. ``set_noise`` returns the realised sigma, measured from the norm weights the engine will
use (``qerl.pipeline.rollout.aqn.realised_sigma``), and the engine keeps it as ``sigma_realised``
(a wrapper such as ``LazyEngine`` forwards the attribute; the rollout stage reads it there). It is
not a protocol member so that test doubles, which add no noise, need not carry it.

Logprob semantics (the train stage must compute the same quantity). The recorded logprob of a
sampled token is ``log_softmax(logits / T)`` at that position, where T is the sampling temperature
(T = 1 for greedy), taken over the full vocabulary: NOT renormalised over the top-k / top-p set.
vLLM 0.32 offers ``raw_logprobs`` (log_softmax(logits), before temperature) and
``processed_logprobs`` (after temperature *and* top-k/top-p masking). So the vLLM engine uses
``processed_logprobs`` when top-k/top-p are off (then it is exactly the quantity above) and
``raw_logprobs`` when T = 1 (also exactly it); T != 1 together with top-k/top-p has no exact vLLM
mode and is rejected with an error rather than recorded as something else. An engine that records
no logprobs (``logprobs: false``, evaluation) accepts any sampling: its mode is never read.

Seeds. Every (prompt, sample) pair gets its own seed (``sample_seed``) derived from (seed, prompt
index, sample index), so vLLM's sampling does not depend on batching. transformers ``generate`` has
no per-request generator: the HF engine seeds the global RNG per batch (forked, so the caller's RNG
is untouched), which is reproducible for the same inputs but samples different tokens than vLLM.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Literal, Protocol, runtime_checkable

from qerl.pipeline.runtime.seeds import derive_seed

__all__ = [
    "Completion",
    "EngineError",
    "RolloutEngine",
    "SamplingSpec",
    "check_adapter_dir",
    "engine_module",
    "sample_seed",
]


class EngineError(RuntimeError):
    """An engine cannot run as configured; the message says what is missing or inconsistent."""


@dataclass(frozen=True)
class SamplingSpec:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 256
    # Evaluation needs no logprobs; without them any temperature/top-p combination is allowed.
    logprobs: bool = True

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def truncates(self) -> bool:
        """Whether top-k/top-p actually cut the distribution (ignored under greedy)."""
        return not self.greedy and (self.top_p < 1.0 or self.top_k > 0)


@dataclass
class Completion:
    prompt_ids: list[int]
    completion_ids: list[int]
    completion_text: str
    logprobs: list[float]
    finish_reason: Literal["stop", "length"]
    extra: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class RolloutEngine(Protocol):
    mode: str
    info: dict[str, Any]
    tokenizer: Any  # the HF tokenizer prompts are rendered and encoded with

    def set_adapter(self, path: Path | None, digest: str | None) -> None: ...

    def set_noise(self, sigma: float, seed: int) -> float: ...

    def generate(
        self, prompts: list[str], n: int, sampling: SamplingSpec, seed: int
    ) -> list[list[Completion]]: ...

    def close(self) -> None: ...


def engine_module(engine: Any) -> ModuleType:
    """The module that implements ``engine`` (a wrapper's ``implementation_module``, which names the
    engine it will start): what a stage generating with it keys besides its own code."""
    return importlib.import_module(getattr(engine, "implementation_module", None) or type(engine).__module__)


def sample_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """A 63-bit seed for one (prompt, sample) pair, independent of batching."""
    return derive_seed("qerl-sample", seed, prompt_index, sample_index)


def check_adapter_dir(path: Path) -> Path:
    """``path`` if it holds a peft adapter (``set_adapter``'s argument), else an ``EngineError``."""
    path = Path(path)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        if not (path / name).is_file():
            raise EngineError(f"LoRA adapter directory {path} has no {name}")
    return path
