"""What a registered version is evaluated under: its run's protocol and the base it was trained on.

``qerl eval --adapter models:/...`` evaluates a version the way its run did, so that its figure
compares with the registered one. ``run_protocol`` finds that run's sections: in its record when the
work directory holds it (``<work>/runs/<run_id>/run.json``), else in the ``protocol.json`` its
registration logged on the version's MLflow run (``qerl.pipeline.registry.protocol``), else none
(an older registration: the defaults apply, and the caller says so). Each section is validated
against the installed config models; one that does not validate is a ``ConfigError`` naming where
it came from.

The base is the exact checkpoint the version trained on: its lineage names it by content digest
(``base_checkpoint``) and recipe (``quant_recipe``). ``quantize_inputs`` gives what the run quantized
with besides its recipe (the data config with the rollout template, and the validation questions
GPTQ's calibration leaves out), computed as the run computes them, so a rebuild from the recorded
sections makes the same calibration text and, where the arithmetic is deterministic, the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qerl.pipeline.config import ConfigError, apply_overrides, load_config
from qerl.pipeline.data.datasets import DataConfig, load_problems
from qerl.pipeline.data.rewards import RewardConfig
from qerl.pipeline.evaluation.eval_config import EvalConfig, ValidationConfig, validation_split
from qerl.pipeline.nvfp4.recipe import QuantizeConfig
from qerl.pipeline.registry.protocol import read_protocol
from qerl.pipeline.store.layout import RUN_RECORD, RUNS_DIR
from qerl.pipeline.store.run_record import read_record

__all__ = ["RunProtocol", "eval_settings", "quantize_inputs", "run_protocol"]


@dataclass(frozen=True)
class RunProtocol:
    """The sections of the run that registered a version, and where they were read (for people)."""

    run_id: str | None
    where: str
    eval: EvalConfig
    reward: RewardConfig
    quantize: QuantizeConfig
    data: DataConfig | None  # None: an older registration, which logged no data section
    template: str | None  # the rollout template GPTQ's calibration prompts were rendered with


def quantize_inputs(
    data: DataConfig, template: str, validation: ValidationConfig
) -> tuple[DataConfig, frozenset[str]]:
    """(data config, held-out questions) a run quantizes with: its data rendered with the rollout
    template (as the validation items are) and its validation split's questions, chosen from the
    training data as read, which GPTQ's calibration never holds."""
    rows = load_problems(data, "train")
    held = validation_split(rows, validation)[1]
    return data.model_copy(update={"template": template}), frozenset(p["question"] for p in held)


def run_protocol(version: Any, work: str | Path) -> RunProtocol | None:
    """The protocol of the run that registered ``version`` (module docstring); None when neither its
    record nor a ``protocol.json`` is there."""
    run_id = version.tags.get("run_id")
    path = Path(work) / RUNS_DIR / str(run_id) / RUN_RECORD
    if run_id and path.is_file():
        where = f"run record {path}"
        try:
            config = read_record(path).config
        except ValueError as err:
            _bad_protocol(where, err)
        return _protocol(config, config.get("rollout"), str(run_id), where)
    try:
        logged = read_protocol(version)
    except ValueError as err:
        _bad_protocol(f"MLflow run {version.run_id}", err)
    if logged is None:
        return None
    where = f"MLflow run {version.run_id}'s protocol.json"
    return _protocol(logged, logged.get("rollout"), logged.get("run_id"), where)


def _protocol(config: Any, rollout: Any, run_id: str | None, where: str) -> RunProtocol:
    try:
        data = DataConfig.model_validate(config["data"]) if "data" in config else None
        template = str(rollout["template"]) if isinstance(rollout, dict) and "template" in rollout else None
        return RunProtocol(
            run_id=run_id, where=where, eval=EvalConfig.model_validate(config["eval"]),
            reward=RewardConfig.model_validate(config["reward"]),
            quantize=QuantizeConfig.model_validate(config["quantize"]), data=data, template=template,
        )  # fmt: skip
    except (ValueError, KeyError, TypeError) as err:  # one of an older or newer qerl
        _bad_protocol(where, err)


def _bad_protocol(where: str, err: Exception) -> Any:
    raise ConfigError(
        f"{where}: no valid eval, reward and quantize sections ({err}); pass --config FILE"
    ) from err


def eval_settings(
    protocol: RunProtocol | None,
    config_file: str | None,
    sets: list[str],
    reward_sets: list[str],
    quantize_sets: list[str],
) -> tuple[EvalConfig, RewardConfig, QuantizeConfig | None, QuantizeConfig | None]:
    """What ``qerl eval`` evaluates under: (eval, reward, the recipe the caller's ``quantize.*``
    settings make or None, the recipe the version's run quantized with or None). A registered
    version's run protocol comes first, ``--set`` on top; ``--config FILE`` (or no protocol) starts
    from the file and the defaults instead."""
    if protocol is None or config_file:
        cfg = load_config(EvalConfig, config_file, sets)
        reward = load_config(RewardConfig, None, reward_sets, prefix="reward")
    else:
        cfg = apply_overrides(protocol.eval, sets)
        reward = apply_overrides(protocol.reward, reward_sets, "reward")
    run_recipe = None if protocol is None else protocol.quantize  # what its adapter was trained on
    recipe = (
        apply_overrides(run_recipe or QuantizeConfig(), quantize_sets, "quantize") if quantize_sets else None
    )
    return cfg, reward, recipe, run_recipe
