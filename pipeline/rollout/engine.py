"""Rollout engines: one small protocol, two implementations (vLLM in-process, transformers generate).

What. An engine is built once per run and lives across RL steps. Per step it takes the new LoRA
adapter (``set_adapter``) and the step's AQN sigma (``set_noise``), then ``generate``s n completions
per prompt with their per-token sampler logprobs.

Modes (recorded in every rollout manifest and logged at WARNING when emulated; never silent):
- ``vllm-nvfp4-marlin``: CUDA, vLLM serves the NVFP4 compressed-tensors checkpoint (FP4 Marlin,
  weight-only) with LoRA on top. The quantization scheme vLLM picked is read back from the workers
  and kept in ``engine.info``.
- ``vllm-nvfp4-emulated``: CPU. vLLM has no NVFP4 kernel there, so it serves the dequantized twin
  (bf16 weights equal to the NVFP4 values): the same function up to accumulation order.
- ``hf-nvfp4-emulated``: transformers ``generate`` on the twin, the reference and the fallback.
- ``vllm-unquantized`` / ``hf-unquantized``: ``quantize.scheme: none`` (the 16-bit arm of an
  ablation): the quantize stage's artifact is the plain base (mode ``unquantized``), served as is.

Logprob semantics (the train stage must compute the same quantity). The recorded logprob of a
sampled token is ``log_softmax(logits / T)`` at that position, where T is the sampling temperature
(T = 1 for greedy), taken over the full vocabulary: NOT renormalised over the top-k / top-p set.
vLLM 0.32 offers ``raw_logprobs`` (log_softmax(logits), before temperature) and
``processed_logprobs`` (after temperature *and* top-k/top-p masking). So the vLLM engine uses
``processed_logprobs`` when top-k/top-p are off (then it is exactly the quantity above) and
``raw_logprobs`` when T = 1 (also exactly it); T != 1 together with top-k/top-p has no exact vLLM
mode and is rejected with an error rather than recorded as something else. An engine that records
no logprobs (``logprobs: false``, evaluation) accepts any sampling: its mode is never read.

Seeds. Every (prompt, sample) pair gets its own seed derived from (seed, prompt index, sample
index), so vLLM's sampling does not depend on batching. transformers ``generate`` has no
per-request generator: the HF engine seeds the global RNG per batch (forked, so the caller's RNG is
untouched), which is reproducible for the same inputs but samples different tokens than vLLM.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

from pydantic import Field, model_validator
from qerl.pipeline.config import StrictModel
from qerl.pipeline.data.prompts import template_names
from qerl.pipeline.nvfp4.checkpoint import TWIN_MODE, UNQUANTIZED_MODE
from qerl.pipeline.runtime import device
from qerl.pipeline.runtime.seeds import derive_seed
from qerl.pipeline.store.artifacts import Manifest

__all__ = [
    "Completion",
    "EngineError",
    "RolloutConfig",
    "RolloutEngine",
    "SamplingSpec",
    "build_engine",
    "sample_seed",
]

log = logging.getLogger("qerl.engines")


class EngineError(RuntimeError):
    """An engine cannot run as configured; the message says what is missing or inconsistent."""


class RolloutConfig(StrictModel):
    """Rollout engine and sampling settings (defaults: the QeRL recipe's rollout)."""

    engine: Literal["vllm", "hf"] = "vllm"
    n_samples: int = Field(8, ge=1, description="completions per prompt (the GRPO group size)")
    temperature: float = Field(1.0, ge=0.0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, description="-1 or 0 = off")
    max_new_tokens: int = Field(256, ge=1)
    max_model_len: int = Field(2048, ge=16)
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    template: str = "boxed"
    seed: int = 0
    enable_lora: bool = True
    max_lora_rank: int = Field(32, ge=1)
    kv_cache_gib: float = Field(1.0, gt=0.0, description="vLLM KV cache size on CPU")
    gpu_memory_utilization: float = Field(0.5, gt=0.0, le=1.0)
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int | None = Field(
        None,
        ge=16,
        description="vLLM tokens per engine step (None: vLLM's default; at least max_model_len on CPU)",
    )
    kv_block_size: int | None = Field(
        None,
        ge=16,
        description="vLLM KV-cache block (tokens). A group shares its prompt's full blocks only "
        "(None: vLLM's default on GPU, 32 on CPU, where vLLM's 128 is longer than most prompts)",
    )
    enforce_eager: bool = Field(False, description="no CUDA graphs / compilation (fast startup)")
    in_process: bool = Field(
        False, description="vLLM engine core and worker in this process (fast CPU startup; one GPU only)"
    )
    hf_batch_size: int = Field(16, ge=1, description="sequences per transformers generate call")
    logprobs: bool = Field(
        True,
        description="record the sampler's per-token logprobs (GRPO needs them); false: an evaluation "
        "engine, any temperature/top-p",
    )
    tensor_parallel_size: int = Field(
        1, ge=1, description="GPUs the vLLM engine is split over (must divide the attention heads; 1 on CPU)"
    )

    @model_validator(mode="after")
    def _check(self) -> RolloutConfig:
        if self.template not in template_names():
            raise ValueError(f"unknown template '{self.template}'; valid: {', '.join(template_names())}")
        if self.in_process and self.tensor_parallel_size > 1:
            raise ValueError(
                "rollout.in_process runs one vLLM worker in this process: it needs tensor_parallel_size 1, "
                f"got {self.tensor_parallel_size}"
            )
        if self.max_new_tokens >= self.max_model_len:
            raise ValueError(
                f"max_new_tokens {self.max_new_tokens} must be < max_model_len {self.max_model_len}"
            )
        return self

    def sampling(self) -> SamplingSpec:
        return SamplingSpec(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_new_tokens=self.max_new_tokens,
            logprobs=self.logprobs,
        )


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

    def set_noise(self, sigma: float, seed: int) -> None: ...

    def generate(
        self, prompts: list[str], n: int, sampling: SamplingSpec, seed: int
    ) -> list[list[Completion]]: ...

    def close(self) -> None: ...


def sample_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """A 63-bit seed for one (prompt, sample) pair, independent of batching."""
    return derive_seed("qerl-sample", seed, prompt_index, sample_index)


def check_adapter_dir(path: Path) -> Path:
    path = Path(path)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        if not (path / name).is_file():
            raise EngineError(f"LoRA adapter directory {path} has no {name}")
    return path


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """Prompt token ids as both engines see them.

    A chat template already writes its special tokens (BOS included where the model has one), so
    the tokenizer must not add them again; a plain-text prompt gets the tokenizer's usual ones.
    """
    add_special = not bool(getattr(tokenizer, "chat_template", None))
    ids = tokenizer(text, add_special_tokens=add_special)["input_ids"]
    if not ids:
        raise EngineError(f"prompt {text[:60]!r} tokenizes to nothing")
    return list(ids)


def eos_token_ids(model_dir: Path, tokenizer: Any) -> list[int]:
    """The stop tokens: the tokenizer's EOS plus generation_config.json's (what vLLM stops on)."""
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    gen_path = Path(model_dir) / "generation_config.json"
    if gen_path.is_file():
        value = json.loads(gen_path.read_text()).get("eos_token_id")
        for tok in value if isinstance(value, list) else [value]:
            if tok is not None and int(tok) not in ids:
                ids.append(int(tok))
    if not ids:
        raise EngineError(f"model {model_dir} defines no EOS token (tokenizer or generation_config.json)")
    return ids


def _checkpoint_dir(manifest: Manifest, what: str) -> Path:
    directory = manifest.dir
    if not (directory / "config.json").is_file():
        raise EngineError(
            f"{what} artifact {manifest.stage}/{manifest.key} at {directory} has no config.json"
        )
    return directory


def build_engine(cfg: RolloutConfig, quantized: Manifest | None, twin: Manifest | None) -> RolloutEngine:
    """Build the configured engine on this machine and log the mode it runs in.

    ``quantized`` is the quantize stage's NVFP4 checkpoint, ``twin`` the dequantize stage's bf16
    twin. On CUDA vLLM serves ``quantized``; otherwise (CPU vLLM, or the HF engine) the twin is
    required and a missing twin is an error, not a silent switch to some other model. An unquantized
    base (``quantize.scheme: none``) is served directly by either engine, and then takes no twin.
    """
    if is_unquantized(quantized):
        assert quantized is not None
        if twin is not None:
            raise EngineError(f"an unquantized base ({quantized.dir}) has no twin, but one was given")
        model_dir, mode = _checkpoint_dir(quantized, "unquantized base"), planned_mode(cfg, True)[0]
        log.info("rollout engine mode %s: %s serves the unquantized base %s", mode, cfg.engine, model_dir)
        if cfg.engine == "vllm":
            from qerl.pipeline.rollout.vllm_engine import VLLMEngine

            return VLLMEngine(cfg, model_dir, mode)
        from qerl.pipeline.rollout.hf_engine import HFEngine

        return HFEngine(cfg, model_dir, mode)
    if twin is not None and twin.mode != TWIN_MODE:
        raise EngineError(
            f"twin artifact {twin.stage}/{twin.key} has mode {twin.mode!r}, expected {TWIN_MODE!r} "
            "(the dequantize stage's output)"
        )
    if cfg.engine == "vllm":
        from qerl.pipeline.rollout.vllm_engine import VLLMEngine

        if device.cuda_available():
            if quantized is None:
                raise EngineError(
                    "vLLM on CUDA serves the NVFP4 checkpoint: pass the quantize stage's manifest"
                )
            model_dir, mode = _checkpoint_dir(quantized, "quantized"), "vllm-nvfp4-marlin"
            log.info("rollout engine mode %s: vLLM serves the NVFP4 checkpoint %s", mode, model_dir)
        else:
            if twin is None:
                raise EngineError(
                    "vLLM on CPU has no NVFP4 kernel and serves the dequantized twin, but no twin was "
                    "given: run the dequantize stage and pass its manifest"
                )
            model_dir, mode = _checkpoint_dir(twin, "twin"), "vllm-nvfp4-emulated"
            log.warning(
                "rollout engine mode %s: no CUDA, vLLM serves the dequantized NVFP4 twin %s "
                "(the NVFP4 values stored in %s, not the FP4 kernel)",
                mode,
                model_dir,
                twin.extra.get("dtype", "the twin's dtype"),
            )
        return VLLMEngine(cfg, model_dir, mode)
    if twin is None:
        raise EngineError("the transformers engine runs the dequantized twin, but no twin was given")
    from qerl.pipeline.rollout.hf_engine import HFEngine

    model_dir, mode = _checkpoint_dir(twin, "twin"), "hf-nvfp4-emulated"
    log.warning("rollout engine mode %s: transformers generate on the dequantized twin %s", mode, model_dir)
    return HFEngine(cfg, model_dir, mode)


def is_unquantized(quantized: Manifest | None) -> bool:
    """Whether the quantize stage's artifact is the plain base (``quantize.scheme: none``)."""
    return quantized is not None and quantized.mode == UNQUANTIZED_MODE


def planned_mode(cfg: RolloutConfig, unquantized: bool = False) -> tuple[str, str]:
    """(mode, implementation module) that ``build_engine`` will choose on this machine."""
    if unquantized:
        return f"{cfg.engine}-unquantized", f"qerl.pipeline.rollout.{cfg.engine}_engine"
    if cfg.engine == "vllm":
        mode = "vllm-nvfp4-marlin" if device.cuda_available() else "vllm-nvfp4-emulated"
        return mode, "qerl.pipeline.rollout.vllm_engine"
    return "hf-nvfp4-emulated", "qerl.pipeline.rollout.hf_engine"


class LazyEngine:
    """An engine built on first use, so a re-run whose stages are all cached starts no vLLM.

    ``mode`` (part of every rollout/evaluate cache key) is known up front from the machine and the
    config; the real engine is checked to run in exactly that mode when it comes up. An engine that
    died (vLLM's engine core process gone: ``EngineDeadError``) is dropped when the call fails, so the
    task's retry builds a fresh one instead of calling the corpse again.
    """

    def __init__(self, cfg: RolloutConfig, quantized: Manifest | None, twin: Manifest | None):
        self._args = (cfg, quantized, twin)
        self.mode, self.implementation_module = planned_mode(cfg, is_unquantized(quantized))
        self._engine: RolloutEngine | None = None
        self.builds = 0  # engines built so far (a rebuild after a death makes it 2)

    @property
    def started(self) -> bool:
        return self._engine is not None

    def _real(self) -> RolloutEngine:
        if self._engine is None:
            engine = build_engine(*self._args)
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
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if any(cls.__name__ == "EngineDeadError" for cls in type(current).__mro__):
            return True
        current = current.__cause__ or current.__context__
    return False
