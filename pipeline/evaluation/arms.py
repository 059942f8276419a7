"""Ablation arms (``qerl ablate``): each arm is a set of overrides of the user's config, each
replicate a shift of the training seeds; an ablation's id is the hash of what it runs.

QeRL's claims are comparative: NVFP4 LoRA explores more (higher policy entropy early) and learns
faster than 16-bit LoRA, and AQN adds to that. An ablation runs one ordinary run per (arm, seed)
and compares the arms (``qerl.pipeline.evaluation.report``; the flow is ``qerl.flows.ablate``).

- **Arms** (``ARMS``): the paper's three ways to train a LoRA with RL. ``bf16-lora`` serves and
  trains the unquantized base (``quantize.scheme: none``, in the twin dtype = ``train.dtype``; the
  arm keeps the paper's name); ``qlora`` the NF4 base with double quantization that QLoRA trains on
  (``quantize.scheme: nf4``, bitsandbytes, without AQN as in the paper); ``nvfp4-lora`` the NVFP4
  base without AQN, and ``nvfp4-aqn`` is QeRL.
- **Variants** (``arm_overrides``): an NVFP4 arm may name its quantizer and an AQN arm its objective
  as dash-separated suffixes, ``nvfp4-lora-gptq`` or ``nvfp4-aqn-gptq-on_policy`` (values of
  ``quantize.method`` and ``train.grpo.aqn_objective``), so one ablation compares quantizers and AQN
  objectives beside the three paper arms; a bare arm keeps the user's settings of both. A suffix the
  arm cannot use is an error (bf16-lora has no quantizer, an arm without AQN no noise to treat).
- **Seeds** (``arm_config``): "everything else identical, seeds included". Replicate ``i`` adds
  ``i`` to every seed that drives training randomness (``loop.seed``: prompt order; ``rollout.seed``:
  sampling and AQN noise; ``train.seed``: LoRA init) and is the same replicate in every arm, so arm A
  seed 1 and arm B seed 1 differ only by the arm. ``data.seed`` and ``eval.seed`` stay fixed: every run
  trains on the same problems and is evaluated on the same items with the same sampling seeds,
  which is what makes the paired comparison over items valid. Each run's ``loop.name`` becomes
  ``<name>-<arm>-s<i>`` so run ids are readable (the id is still the config hash).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any, get_args

from qerl.pipeline.config import config_hash
from qerl.pipeline.evaluation.statistics import AblationError
from qerl.pipeline.nvfp4.recipe import QuantizeConfig

__all__ = ["ARMS", "AblationError", "ablation_id", "arm_config", "arm_overrides", "parse_arms"]

ARMS: dict[str, dict[str, dict[str, Any]]] = {
    "bf16-lora": {"quantize": {"scheme": "none"}, "aqn": {"enabled": False}},
    "nvfp4-lora": {"quantize": {"scheme": "nvfp4"}, "aqn": {"enabled": False}},
    "nvfp4-aqn": {"quantize": {"scheme": "nvfp4"}, "aqn": {"enabled": True}},
    "qlora": {"quantize": {"scheme": "nf4"}, "aqn": {"enabled": False}},
}


# the suffixes an arm may carry: the quantizers from the recipe model; the objectives spelled here, since
# evaluation sits beside rl in the layering (tests/flows/test_ablation.py checks them against GRPOConfig's)
QUANTIZERS: tuple[str, ...] = get_args(QuantizeConfig.model_fields["method"].annotation)
AQN_OBJECTIVES: tuple[str, ...] = ("clean_is", "on_policy", "noisy_trainer")

SEED_KEYS = (("loop", "seed"), ("rollout", "seed"), ("train", "seed"))


def arm_overrides(arm: str) -> dict[str, dict[str, Any]]:
    """The config overrides of arm ``arm``: a paper arm (``ARMS``) and its variant suffixes (module notes)."""
    base = next((a for a in sorted(ARMS, key=len, reverse=True) if arm == a or arm.startswith(a + "-")), None)
    if base is None:
        raise AblationError(
            f"unknown arm '{arm}'; the arms are {sorted(ARMS)}, optionally followed by a quantizer "
            f"{list(QUANTIZERS)} (NVFP4 arms) and an AQN objective {list(AQN_OBJECTIVES)} (nvfp4-aqn), "
            "e.g. nvfp4-aqn-gptq-on_policy"
        )
    out = copy.deepcopy(ARMS[base])
    for suffix in arm[len(base) + 1 :].split("-") if arm != base else []:
        if suffix in QUANTIZERS and out["quantize"]["scheme"] == "nvfp4":
            section, key = out["quantize"], "method"
        elif suffix in AQN_OBJECTIVES and out["aqn"]["enabled"]:
            section, key = out.setdefault("train", {}).setdefault("grpo", {}), "aqn_objective"
        else:
            allowed = (list(QUANTIZERS) if out["quantize"]["scheme"] == "nvfp4" else []) + (
                list(AQN_OBJECTIVES) if out["aqn"]["enabled"] else []
            )
            raise AblationError(
                f"arm '{arm}': '{suffix}' is not a variant of {base}; its variants are {allowed or 'none'}"
            )
        if key in section:
            raise AblationError(f"arm '{arm}' sets {key} twice ({section[key]}, {suffix})")
        section[key] = suffix
    return out


def parse_arms(text: str | Sequence[str]) -> list[str]:
    """``"a,b"`` or a list -> arm names, checked: known (with valid variants), distinct, at least two."""
    names = [a.strip() for a in (text.split(",") if isinstance(text, str) else text) if a.strip()]
    for name in names:
        arm_overrides(name)
    if len(set(names)) != len(names):
        raise AblationError(f"arms must be distinct, got {names}")
    if len(names) < 2:
        raise AblationError(f"an ablation compares at least two arms, got {names}")
    return names


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = copy.deepcopy(value)
    return base


def arm_config(config: Mapping[str, Any], arm: str, replicate: int) -> dict[str, Any]:
    """The run config of (``arm``, replicate ``replicate``): the user's config, the arm's overrides, and
    every training seed shifted by ``replicate`` (see the module docstring). ``config`` is not changed."""
    overrides = arm_overrides(arm)
    if replicate < 0:
        raise AblationError(f"replicate must be >= 0, got {replicate}")
    out = _merge(copy.deepcopy(dict(config)), overrides)
    for section, key in SEED_KEYS:
        part = out.setdefault(section, {})
        part[key] = int(part.get(key, 0)) + replicate
    loop = out.setdefault("loop", {})
    loop["name"] = f"{loop.get('name', 'demo')}-{arm}-s{replicate}"
    return out


def check_seeds(seeds: int) -> int:
    """The number of replicates per arm, checked: a whole number >= 1 (``--seeds 0`` would run nothing
    and then fail in the comparison, after Prefect had started)."""
    if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
        raise AblationError(f"--seeds must be a whole number >= 1 (replicates per arm), got {seeds!r}")
    return seeds


def ablation_id(config: Mapping[str, Any], arms: Sequence[str], seeds: int) -> str:
    """``abl-<hash>``: the same config, arms and seed count are the same ablation (so a re-run resumes).

    Checks ``seeds`` first: the CLI computes the id before it starts Prefect, so a bad count fails there."""
    check_seeds(seeds)
    return f"abl-{config_hash({'config': dict(config), 'arms': list(arms), 'seeds': seeds})[:10]}"
