"""The promotion policy: owned by the registered model, not by the run that hopes to be promoted.

A candidate never sets the bar it is judged by: were the margin its own config's, ``--set
registry.promote_margin_se=0`` would pass anything, and it would choose the protocol (template, k,
decoding, scorer) and the validation items under which the champion is re-scored. The policy lives
on the registered model as the tag ``promotion_policy`` (JSON):

- ``margin_se`` and ``margin``: how far the paired per-item difference must exceed zero, in its
  standard errors and in absolute accuracy;
- ``benchmark``: the decision split's id, which carries the validation items' digest and the
  evaluation protocol's (``name@items~protocol``): a candidate evaluated on other items or under
  another protocol is not compared;
- ``base_digest`` and ``quant_recipe``: the base the model's versions are trained and evaluated on
  (the source model's digest, and the recipe the quantize stage computed it with,
  ``qerl.pipeline.registry.adapters.base_recipe``); a candidate on another base (an RTN-trained LoRA
  against a GPTQ-based champion) is not compared, and the register stage does not evaluate a
  champion on a checkpoint of another recipe, so a champion is only ever evaluated on its own base.
  A policy an older qerl set holds a bare hash there, which every NVFP4 method shared: the first
  paired comparison on a named recipe names it (a recorded change).

The first complete candidate with a validation split sets it from its config and evaluation
(``set_by``). From then on only ``qerl policy NAME --change key=value`` changes it; each change is kept
as a tag ``promotion_policy_change_N`` (when, what it was, what it became), so a promotion can always
be traced to the rule in force. A run's ``registry.promote_margin*`` settings seed a new model's
policy and change nothing after that.

Why two standard errors by default: a night that learned nothing is a tie with the champion; with a
one-standard-error bar a tie is promoted about one night in six (the upper tail of a normal
difference beyond one sigma), so a month of nights crowns about five champions on noise. Two
standard errors take that to one tie night in 44, about one false promotion in six weeks of nightly
runs, and a real gain of three standard errors still passes about 84% of the time. A sequential test
over nights (alpha spending) would bound false promotions across the whole history, but it needs the
nights' comparisons to be independent, which warm starts from the champion break; a fixed, stricter
margin is the rule that stays true.
"""

from __future__ import annotations

import datetime as _dt
import json
from collections.abc import Mapping
from typing import Any

from mlflow.tracking import MlflowClient
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from qerl.pipeline.registry.lock import RegistryError

POLICY_TAG = "promotion_policy"
CHANGE_TAG = "promotion_policy_change_"


class PromotionPolicy(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    margin_se: float = Field(ge=0.0, description="standard errors of the paired difference to beat")
    margin: float = Field(ge=0.0, description="absolute accuracy difference to beat")
    benchmark: str = Field(description="the decision split: name@validation-items~protocol")
    base_digest: str = Field(description="lineage digest of the base every version is trained on")
    quant_recipe: str = Field(description="the base's quantization recipe (adapters.base_recipe)")
    set_by: str = Field(default="", description="who set it: a run, or a qerl policy change")


CHANGEABLE = ("margin_se", "margin", "benchmark", "base_digest", "quant_recipe")


def read_policy(name: str) -> PromotionPolicy | None:
    """The policy registered model ``name`` holds; None before its first candidate set one."""
    tags = MlflowClient().get_registered_model(name).tags
    if POLICY_TAG not in tags:
        return None
    try:
        return PromotionPolicy.model_validate_json(tags[POLICY_TAG])
    except ValidationError as err:
        raise RegistryError(
            f"registered model {name}'s tag {POLICY_TAG} is not a promotion policy: {err}"
        ) from err


def _write(name: str, policy: PromotionPolicy) -> None:
    MlflowClient().set_registered_model_tag(name, POLICY_TAG, policy.model_dump_json())


def first_policy(name: str, proposed: PromotionPolicy) -> PromotionPolicy:
    """The model's policy, set to ``proposed`` if it has none yet (call under the registry lock)."""
    current = read_policy(name)
    if current is None:
        _write(name, proposed)
        return proposed
    return current


def change_policy(name: str, updates: Mapping[str, Any], by: str) -> tuple[PromotionPolicy, PromotionPolicy]:
    """Apply ``updates`` (``CHANGEABLE`` fields) to ``name``'s policy and record the change as the
    next ``promotion_policy_change_N`` tag; returns (before, after). Call under the registry lock."""
    before = read_policy(name)
    if before is None:
        raise RegistryError(
            f"registered model {name} has no promotion policy yet: its first complete run sets it"
        )
    unknown = sorted(set(updates) - set(CHANGEABLE))
    if unknown:
        raise RegistryError(f"policy has no field {unknown}; valid fields: {', '.join(CHANGEABLE)}")
    try:
        after = PromotionPolicy.model_validate({**before.model_dump(), **updates, "set_by": by})
    except ValidationError as err:
        raise RegistryError(f"invalid policy change {dict(updates)}: {err}") from err
    tags = MlflowClient().get_registered_model(name).tags
    n = 1 + sum(1 for key in tags if key.startswith(CHANGE_TAG))
    change = {
        "at": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "by": by,
        "from": {k: v for k, v in before.model_dump().items() if k in updates},
        "to": {k: after.model_dump()[k] for k in updates},
    }
    MlflowClient().set_registered_model_tag(name, f"{CHANGE_TAG}{n}", json.dumps(change, sort_keys=True))
    _write(name, after)
    return before, after


def policy_changes(name: str) -> list[dict[str, Any]]:
    """The recorded changes of ``name``'s policy, oldest first."""
    tags = MlflowClient().get_registered_model(name).tags
    numbered = sorted((int(k[len(CHANGE_TAG) :]), v) for k, v in tags.items() if k.startswith(CHANGE_TAG))
    return [json.loads(v) for _, v in numbered]


def mismatch(policy: PromotionPolicy, benchmark: str, lineage: Mapping[str, Any]) -> str | None:
    """Why a candidate cannot be compared under ``policy`` (None: it can)."""
    if benchmark != policy.benchmark:
        return (
            f"it was evaluated on {benchmark}, the registered model's policy decides on {policy.benchmark} "
            "(other validation items or another protocol; `qerl policy` changes it)"
        )
    for key in ("base_digest", "quant_recipe"):
        if str(lineage.get(key)) != getattr(policy, key):
            return (
                f"its {key} {lineage.get(key)} is not the policy's {getattr(policy, key)}: a champion is "
                "compared only on its own base (`qerl policy` changes it)"
            )
    return None
