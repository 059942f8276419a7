"""The whole run's configuration: every stage's config under one root.

Defaults live in one place, each stage's own config class (the QeRL recipe's values). Presets are
YAML files in ``pipeline/planning/presets``: ``demo.yaml`` is the embedded demo that ``qerl run`` uses with
no config (a tiny Qwen2 built and warmed up here, the procedural arithmetic task, the vLLM CPU
engine), ``qwen2.5-7b-gsm8k.yaml`` the paper's GSM8K recipe on one H100; ``qerl run --config FILE --set a.b=c`` loads YAML then applies overrides, and
an unknown key anywhere fails with the list of valid keys at that level.

Cross-field rules live here (``model_validator``), not in the stages, so a bad combination fails
when the config is loaded rather than after the first step:

- the train stage's sampling temperature equals the rollout engine's, and a group has >= 2 samples;
- the LR schedule spans the loop: ``train.total_steps: null`` (the default) is derived as
  ``loop.steps`` x the optimizer updates of one RL step, ``mu * ceil(ceil(prompts_per_step *
  n_samples / minibatch_size) / grad_accum)`` (what ``qerl.pipeline.rl.training`` runs); an explicit value
  shorter than that is rejected, since the cosine would then hold lr at its floor for the rest of
  the run (a longer one is allowed: the run stops before the end of the decay);
- sampler and trainer hold the same weights: the dequantized twin (what vLLM serves on a CPU and
  the HF engine runs) is stored in ``train.dtype`` (``quantize.twin_dtype: null`` derives it; any
  other value is rejected), and the rollout dtype is ``train.dtype`` or ``auto``. ``auto`` is
  refused for a float32 trainer on vLLM, which serves float32 checkpoints in bfloat16 under
  ``auto``. A bf16 twin served beside an fp32 trainer differed in every nonzero weight (0.37% at
  most), so the importance ratio compared two different functions;
- the adapter fits the engine: LoRA is on and ``train.lora_r <= rollout.max_lora_rank``, one of the
  ranks vLLM accepts;
- one data directory: with ``data.root`` set, a named benchmark of ``eval.benchmark`` or ``eval.also``
  without a ``root`` of its own takes it (derived here, so the run record and the evaluation's cache key
  say where the items came from); one with its own root keeps it, and a procedural set or a file path
  has no use for one. ``$QERL_DATA_DIR`` needs nothing derived: every load without a root reads it
  (``qerl.pipeline.data.datasets.data_root``), training and evaluation alike.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ModelWrapValidatorHandler, model_validator
from qerl.pipeline.config import StrictModel, apply_overrides, load_config
from qerl.pipeline.data.datasets import NAMED, DataConfig
from qerl.pipeline.data.rewards import RewardConfig
from qerl.pipeline.demo.base_model import DemoBaseConfig
from qerl.pipeline.evaluation.metrics import EvalConfig
from qerl.pipeline.nvfp4.checkpoint import QuantizeConfig
from qerl.pipeline.registry.tracking import RegistryConfig
from qerl.pipeline.rl.training import TrainConfig
from qerl.pipeline.rollout.aqn import AQNConfig
from qerl.pipeline.rollout.engine import RolloutConfig
from qerl.pipeline.store.retention import RetentionConfig

PRESET_DIR = Path(__file__).parent / "presets"
# vLLM 0.32's ``LoRAConfig.max_lora_rank`` (``MaxLoRARanks``): any other value fails at engine start
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class ModelConfig(StrictModel):
    """Where the base model comes from: ``demo`` (built here), a local HF directory, or a hub id."""

    source: str = "demo"
    demo: DemoBaseConfig = DemoBaseConfig()


class LoopConfig(StrictModel):
    """The RL loop: how many steps, how many prompts a step, how often to evaluate."""

    name: str = "demo"
    steps: int = Field(8, ge=1)
    prompts_per_step: int = Field(16, ge=1)
    eval_every: int = Field(0, ge=0, description="evaluate every E steps (0: only at the end)")
    eval_base: bool = Field(True, description="also evaluate the base without adapter (the baseline)")
    seed: int = 0
    warm_start: Literal["champion", "base"] = Field(
        "champion",
        description="nightly runs: step 0 starts from the registered champion's adapter (fresh optimizer) "
        "or from the bare base",
    )


class RunConfig(StrictModel):
    """Every stage's config. Defaults are each stage's own (the QeRL recipe); presets set the rest."""

    model: ModelConfig = ModelConfig()
    quantize: QuantizeConfig = QuantizeConfig()
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    reward: RewardConfig = RewardConfig()
    train: TrainConfig = TrainConfig()
    aqn: AQNConfig = AQNConfig()
    eval: EvalConfig = EvalConfig()
    registry: RegistryConfig = RegistryConfig()
    loop: LoopConfig = LoopConfig()
    store: RetentionConfig = RetentionConfig()

    @model_validator(mode="wrap")
    @classmethod
    def _derive(cls, data: Any, handler: ModelWrapValidatorHandler[RunConfig]) -> RunConfig:
        """Fill the settings that follow from others (null = derived); see the module docstring."""
        cfg = handler(data)
        derived: dict[str, dict[str, Any]] = {}
        if cfg.train.total_steps is None:
            derived["train"] = {"total_steps": cfg.loop.steps * updates_per_step(cfg)}
        if cfg.quantize.twin_dtype is None:
            derived["quantize"] = {"twin_dtype": cfg.train.dtype}
        roots = _eval_roots(cfg)
        if roots:
            derived["eval"] = roots
        if not derived:
            return cfg
        dumped = cfg.model_dump()
        return handler({**dumped, **{k: {**dumped[k], **v} for k, v in derived.items()}})

    @model_validator(mode="after")
    def _consistent(self) -> RunConfig:
        if self.train.temperature != self.rollout.temperature:
            raise ValueError(
                f"train.temperature ({self.train.temperature}) must equal rollout.temperature "
                f"({self.rollout.temperature}): the importance ratio compares the same distribution"
            )
        if self.rollout.n_samples < 2:
            raise ValueError("rollout.n_samples must be >= 2: GRPO needs a group to compare against")
        if not self.rollout.logprobs:
            raise ValueError("rollout.logprobs is false: GRPO needs the sampler's per-token logprobs")
        self._check_schedule()
        self._check_dtypes()
        self._check_lora()
        return self

    def _check_schedule(self) -> None:
        train, loop = self.train, self.loop
        per_step = updates_per_step(self)
        needed = loop.steps * per_step
        if train.total_steps is not None and train.total_steps < needed:
            raise ValueError(
                f"train.total_steps ({train.total_steps}) is shorter than the run's {needed} optimizer "
                f"updates (loop.steps {loop.steps} x {per_step} per step: {loop.prompts_per_step} prompts x "
                f"{self.rollout.n_samples} samples in minibatches of {train.minibatch_size}, grad_accum "
                f"{train.grad_accum}, mu {train.mu}): after update {train.total_steps} the cosine would hold "
                f"the lr at min_lr_ratio x lr ({train.min_lr_ratio * train.lr:g}) for the rest of the run. "
                f"Set train.total_steps: null to derive it, or >= {needed}"
            )
        total = train.total_steps if train.total_steps is not None else needed
        if train.warmup_steps >= total:
            raise ValueError(
                f"train.warmup_steps ({train.warmup_steps}) must be < the schedule's {total} updates"
            )

    def _check_dtypes(self) -> None:
        train_dtype, twin, served = self.train.dtype, self.quantize.twin_dtype, self.rollout.dtype
        if twin is not None and twin != train_dtype:
            raise ValueError(
                f"quantize.twin_dtype ({twin}) must equal train.dtype ({train_dtype}): the twin is what "
                "the sampler serves on a CPU, so any other dtype samples from different weights than "
                "the trainer's (set quantize.twin_dtype: null to follow train.dtype)"
            )
        if served not in ("auto", train_dtype):
            raise ValueError(
                f"rollout.dtype ({served}) must be train.dtype ({train_dtype}) or auto: the sampler's "
                "logprobs must come from the trainer's weights and precision"
            )
        if served == "auto" and train_dtype == "float32" and self.rollout.engine == "vllm":
            raise ValueError(
                "rollout.dtype auto with train.dtype float32: vLLM serves a float32 checkpoint in "
                "bfloat16 under auto; set rollout.dtype: float32"
            )

    def _check_lora(self) -> None:
        rollout, r = self.rollout, self.train.lora_r
        if not rollout.enable_lora:
            raise ValueError(
                "rollout.enable_lora is false: the rollout engine must serve each step's LoRA adapter"
            )
        if rollout.engine != "vllm":  # transformers applies the peft adapter as saved: no LoRA slots
            return
        if r > rollout.max_lora_rank:
            raise ValueError(
                f"train.lora_r ({r}) exceeds rollout.max_lora_rank ({rollout.max_lora_rank}): the engine "
                f"could not load the adapter; raise rollout.max_lora_rank to >= {r}"
            )
        if rollout.max_lora_rank not in VLLM_LORA_RANKS:
            raise ValueError(
                f"rollout.max_lora_rank ({rollout.max_lora_rank}) is not one vLLM accepts: "
                f"{', '.join(map(str, VLLM_LORA_RANKS))}"
            )


def _eval_roots(cfg: RunConfig) -> dict[str, Any] | None:
    """``eval.benchmark``/``eval.also`` with ``data.root`` filled in where a named benchmark has no root
    of its own (module docstring); None when nothing changes."""
    root = cfg.data.root

    def needs(bench: DataConfig) -> bool:
        return root is not None and bench.root is None and bench.dataset in NAMED

    benches = [cfg.eval.benchmark, *cfg.eval.also]
    if not any(needs(b) for b in benches):
        return None
    filled = [{**b.model_dump(), "root": root} if needs(b) else b.model_dump() for b in benches]
    return {"benchmark": filled[0], "also": filled[1:]}


def updates_per_step(cfg: RunConfig) -> int:
    """Optimizer updates of one RL step (``qerl.pipeline.rl.training._update_groups`` makes exactly these)."""
    samples = cfg.loop.prompts_per_step * cfg.rollout.n_samples
    minibatches = math.ceil(samples / cfg.train.minibatch_size)
    return cfg.train.mu * math.ceil(minibatches / cfg.train.grad_accum)


def vllm_lora_rank(r: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds a rank-``r`` adapter."""
    for rank in VLLM_LORA_RANKS:
        if rank >= r:
            return rank
    raise ValueError(f"LoRA rank {r} exceeds vLLM's largest max_lora_rank {VLLM_LORA_RANKS[-1]}")


def adapter_rank(adapter_dir: str | Path) -> int:
    """The largest LoRA rank in a peft adapter folder (``r`` and any per-module ``rank_pattern``)."""
    path = Path(adapter_dir) / "adapter_config.json"
    if not path.is_file():
        raise ValueError(f"LoRA adapter directory {adapter_dir} has no adapter_config.json")
    config = json.loads(path.read_text())
    ranks = [config.get("r")] + list((config.get("rank_pattern") or {}).values())
    if not isinstance(config.get("r"), int) or not all(isinstance(x, int) and x > 0 for x in ranks):
        raise ValueError(f"{path}: 'r' / 'rank_pattern' must be positive integers, got {ranks}")
    return max(ranks)


def eval_rollout_config(
    cfg: EvalConfig,
    engine: str,
    model_dir: str | Path,
    adapter_dir: str | Path | None,
    overrides: list[str] | None = None,
) -> RolloutConfig:
    """The engine config of a standalone evaluation (``qerl eval``): sampled as ``cfg`` says, no logprobs.

    Derived rather than fixed: the context is the rollout default capped by the model's
    ``max_position_embeddings``, the LoRA slot is the smallest vLLM rank that holds the adapter (no
    LoRA without one). ``overrides`` (``key=value``, RolloutConfig keys) are applied last.
    """
    default_len = RolloutConfig.model_fields["max_model_len"].default
    positions = json.loads((Path(model_dir) / "config.json").read_text()).get("max_position_embeddings")
    derived = RolloutConfig.model_construct(  # validated once, with the overrides, below
        engine=engine,
        n_samples=cfg.n_samples,
        temperature=cfg.sampling_temperature,
        top_p=cfg.sampling_top_p,
        max_new_tokens=cfg.max_new_tokens,
        max_model_len=min(default_len, int(positions or default_len)),
        template=cfg.benchmark.template,
        enable_lora=adapter_dir is not None,
        max_lora_rank=vllm_lora_rank(adapter_rank(adapter_dir))
        if adapter_dir is not None
        else RolloutConfig.model_fields["max_lora_rank"].default,
        logprobs=False,
    )
    return apply_overrides(derived, overrides)


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def load_run_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """YAML (a path, or a preset name) then ``--set`` overrides; no path = the embedded demo preset."""
    if path is None:
        path = PRESET_DIR / "demo.yaml"
    elif not Path(path).exists() and str(path) in preset_names():
        path = PRESET_DIR / f"{path}.yaml"
    cfg = load_config(RunConfig, path, overrides)
    model_json = Path(cfg.model.source) / "config.json"
    if cfg.rollout.tensor_parallel_size > 1 and model_json.is_file():  # 1 is valid everywhere
        from qerl.pipeline.runtime.device import cuda_available

        check_parallelism(cfg.rollout, json.loads(model_json.read_text()), cuda_available())
    return cfg


def check_parallelism(rollout: RolloutConfig, model_config: dict[str, Any], cuda: bool) -> None:
    """vLLM's tensor-parallel rules for this model on this machine; a ConfigError names the setting.

    It needs the model's config.json, so it runs where that is known: ``load_run_config`` for a local
    model directory, and wherever a hub model's config has been fetched (``qerl plan``, the flow).
    vLLM shards the attention heads over the GPUs (``num_attention_heads % tp == 0``) and splits or
    replicates the KV heads (``num_key_value_heads % tp == 0`` or ``tp % num_key_value_heads == 0``);
    on a CPU it runs a single worker.
    """
    from qerl.pipeline.config import ConfigError

    tp = rollout.tensor_parallel_size
    if tp == 1:
        return
    if not cuda:
        raise ConfigError(
            f"rollout.tensor_parallel_size is {tp} but this machine has no CUDA device: vLLM on a CPU runs "
            "one worker, set rollout.tensor_parallel_size: 1"
        )
    heads = int(model_config.get("num_attention_heads") or 0)
    kv_heads = int(model_config.get("num_key_value_heads") or heads)
    if heads <= 0:
        raise ConfigError("the model's config.json has no num_attention_heads to check tensor_parallel_size")
    valid = [d for d in range(1, heads + 1) if heads % d == 0 and (kv_heads % d == 0 or d % kv_heads == 0)]
    if tp not in valid:
        raise ConfigError(
            f"rollout.tensor_parallel_size {tp} does not fit the model's {heads} attention heads and "
            f"{kv_heads} KV heads (vLLM shards the heads across GPUs: tp must divide them, and divide or "
            f"be a multiple of the KV heads); valid sizes: {', '.join(map(str, valid))}"
        )


def _type_name(annotation: object) -> str:
    text = getattr(annotation, "__name__", None) or str(annotation)
    return text.replace("typing.", "").replace("NoneType", "None")


def reference_rows(model: type[StrictModel] = RunConfig, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(key, type, default, description) for every leaf setting, in declaration order."""
    rows: list[tuple[str, str, str, str]] = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, StrictModel):
            rows.extend(reference_rows(annotation, f"{key}."))
            continue
        default = field.get_default(call_default_factory=True)
        default_text = json.dumps(
            default.model_dump(mode="json") if hasattr(default, "model_dump") else default
        )
        rows.append((key, _type_name(annotation), default_text, (field.description or "").replace("|", "/")))
    return rows


def reference_markdown() -> str:
    """The README's configuration reference, generated so it cannot drift from the code."""
    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    lines += [f"| `{k}` | `{t}` | `{d}` | {m} |" for k, t, d, m in reference_rows()]
    return "\n".join(lines) + "\n"


README_START, README_END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"


def readme_with_reference(text: str) -> str:
    """``text`` (the README) with its generated configuration reference block replaced."""
    head, _, rest = text.partition(README_START)
    _, _, tail = rest.partition(README_END)
    return f"{head}{README_START}\n{reference_markdown()}{README_END}{tail}"


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["--readme"]:
        readme = Path(sys.argv[2])
        from qerl.pipeline.store.artifacts import atomic_write_text

        atomic_write_text(readme, readme_with_reference(readme.read_text()))
    else:
        print(reference_markdown(), end="")
