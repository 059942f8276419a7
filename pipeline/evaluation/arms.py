"""Ablation arms (``qerl ablate``): each arm is a set of overrides of the user's config, each
replicate a shift of the training seeds; an ablation's id is the hash of what it runs.

QeRL's claims are comparative: NVFP4 LoRA explores more (higher policy entropy early) and learns
faster than 16-bit LoRA, and AQN adds to that. An ablation runs one ordinary run per (arm, seed)
and compares the arms (``qerl.pipeline.evaluation.report``; the flow is ``qerl.flows.ablate``).

- **Arms** (``ARMS``): ``bf16-lora`` serves and trains the unquantized base (``quantize.scheme:
  none``, in the twin dtype = ``train.dtype``; the arm keeps the paper's name), ``nvfp4-lora`` the
  NVFP4 base without AQN, ``nvfp4-aqn`` is QeRL.
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
from typing import Any

from qerl.pipeline.config import config_hash

ARMS: dict[str, dict[str, dict[str, Any]]] = {
    "bf16-lora": {"quantize": {"scheme": "none"}, "aqn": {"enabled": False}},
    "nvfp4-lora": {"quantize": {"scheme": "nvfp4"}, "aqn": {"enabled": False}},
    "nvfp4-aqn": {"quantize": {"scheme": "nvfp4"}, "aqn": {"enabled": True}},
}


SEED_KEYS = (("loop", "seed"), ("rollout", "seed"), ("train", "seed"))


class AblationError(ValueError):
    """An ablation cannot be set up or compared as asked; the message names the offending thing."""


def parse_arms(text: str | Sequence[str]) -> list[str]:
    """``"a,b"`` or a list -> arm names, checked: known, distinct, at least two."""
    names = [a.strip() for a in (text.split(",") if isinstance(text, str) else text) if a.strip()]
    unknown = [a for a in names if a not in ARMS]
    if unknown:
        raise AblationError(f"unknown arm(s) {unknown}; the arms are {sorted(ARMS)}")
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
    if arm not in ARMS:
        raise AblationError(f"unknown arm '{arm}'; the arms are {sorted(ARMS)}")
    if replicate < 0:
        raise AblationError(f"replicate must be >= 0, got {replicate}")
    out = _merge(copy.deepcopy(dict(config)), ARMS[arm])
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
