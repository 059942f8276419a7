"""The whole run's configuration: every stage's config under one root.

Defaults live in one place, each stage's own config class (the QeRL recipe's values). Presets are
YAML files in ``pipeline/presets``: ``demo.yaml`` is the embedded demo that ``qerl run`` uses with
no config (a tiny Qwen2 built and warmed up here, the procedural arithmetic task, the vLLM CPU
engine), ``qwen2.5-7b-gsm8k.yaml`` the paper's GSM8K recipe on one H100; ``qerl run --config FILE --set a.b=c`` loads YAML then applies overrides, and
an unknown key anywhere fails with the list of valid keys at that level.

Cross-field rules live here (``model_validator``), not in the stages: the train stage's sampling
temperature must equal the rollout engine's, and the group size must allow a standard deviation.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import Field, model_validator

from pipeline.aqn import AQNConfig
from pipeline.config import StrictModel, load_config
from pipeline.data import DataConfig
from pipeline.demo import DemoBaseConfig
from pipeline.engines import RolloutConfig
from pipeline.evaluation import EvalConfig
from pipeline.nvfp4 import QuantizeConfig
from pipeline.registry import RegistryConfig
from pipeline.retention import RetentionConfig
from pipeline.rewards import RewardConfig
from pipeline.training import TrainConfig

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

    @model_validator(mode="after")
    def _consistent(self) -> RunConfig:
        if self.train.temperature != self.rollout.temperature:
            raise ValueError(
                f"train.temperature ({self.train.temperature}) must equal rollout.temperature "
                f"({self.rollout.temperature}): the importance ratio compares the same distribution"
            )
        if self.rollout.n_samples < 2:
            raise ValueError("rollout.n_samples must be >= 2: GRPO needs a group to compare against")
        return self


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def load_run_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """YAML (a path, or a preset name) then ``--set`` overrides; no path = the embedded demo preset."""
    if path is None:
        path = PRESET_DIR / "demo.yaml"
    elif not Path(path).exists() and str(path) in preset_names():
        path = PRESET_DIR / f"{path}.yaml"
    return load_config(RunConfig, path, overrides)


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
        from pipeline.artifacts import atomic_write_text

        atomic_write_text(readme, readme_with_reference(readme.read_text()))
    else:
        print(reference_markdown(), end="")
