"""The whole run's configuration: every stage's config under one root.

Defaults live in one place, each stage's own config class (the QeRL recipe's values). Presets are
YAML files in ``pipeline/planning/presets``: ``demo.yaml`` is the embedded demo that ``qerl run``
uses with no config (a tiny Qwen2 built and warmed up here, the procedural arithmetic task, the vLLM
CPU engine), ``qwen2.5-7b-gsm8k.yaml`` the paper's GSM8K recipe on one H100. ``qerl run --config
FILE --set a.b=c`` loads YAML then applies overrides, and an unknown key anywhere fails with the
list of valid keys at that level.

Cross-field rules (what is derived from other settings, which combinations are refused) run when
the config is validated, so a bad combination fails when the config is loaded rather than after the
first step; they live in ``qerl.pipeline.planning.run_checks``, which says what each one is and why.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ModelWrapValidatorHandler, model_validator
from qerl.pipeline.config import StrictModel, load_config, resource_field
from qerl.pipeline.data.datasets import DataConfig
from qerl.pipeline.data.rewards import RewardConfig
from qerl.pipeline.demo.base_model import DemoBaseConfig
from qerl.pipeline.evaluation.eval_config import EvalConfig
from qerl.pipeline.nvfp4.recipe import QuantizeConfig
from qerl.pipeline.planning.run_checks import (
    check_consistent,
    check_model,
    check_serving,
    derived_settings,
)
from qerl.pipeline.registry.tracking import RegistryConfig
from qerl.pipeline.rl.train_config import TrainConfig
from qerl.pipeline.rollout.aqn import AQNConfig
from qerl.pipeline.rollout.config import RolloutConfig
from qerl.pipeline.store.files import read_json
from qerl.pipeline.store.retention_policy import RetentionConfig

PRESET_DIR = Path(__file__).parent / "presets"


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
    deadline_h: float | None = resource_field(
        None,
        gt=0,
        description="stop an attempt still running after this many hours: recorded as failed, its "
        "processes killed, exit status 124, so a hung night cannot hold back the next (unset: no deadline)",
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
    store: RetentionConfig = resource_field(
        RetentionConfig(), description="what retention may delete: never part of a key or the run id"
    )

    @model_validator(mode="wrap")
    @classmethod
    def _derive(cls, data: Any, handler: ModelWrapValidatorHandler[RunConfig]) -> RunConfig:
        """Fill the settings that follow from others (null = derived; ``run_checks.derived_settings``)."""
        cfg = handler(data)
        derived = derived_settings(cfg)
        if not derived:
            return cfg
        dumped = cfg.model_dump()
        return handler({**dumped, **{k: {**dumped[k], **v} for k, v in derived.items()}})

    @model_validator(mode="after")
    def _consistent(self) -> RunConfig:
        check_consistent(self)
        return self


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def load_run_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """YAML (a path, or a preset name) then ``--set`` overrides; no path = the embedded demo preset."""
    if path is None:
        path = PRESET_DIR / "demo.yaml"
    elif not Path(path).exists() and str(path) in preset_names():
        path = PRESET_DIR / f"{path}.yaml"
    cfg = load_config(RunConfig, path, overrides)
    # the settings a CUDA engine can refuse (asking whether CUDA is here imports torch: only for them)
    if cfg.rollout.dtype == "float32" or (cfg.quantize.scheme == "nf4" and cfg.rollout.engine == "vllm"):
        check_serving(cfg)
    model_json = Path(cfg.model.source) / "config.json"
    if model_json.is_file():  # other sources are checked after the base stage (run_checks)
        check_model(cfg.rollout, read_json(model_json))
    return cfg
