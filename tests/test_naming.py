"""Naming hazard (DESIGN.md): our top-level ``kernels`` package shares its import name with Hugging Face's
``kernels`` hub package, which transformers probes for and would use if its version looked right."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import kernels

REPO = Path(__file__).resolve().parents[1]


def test_our_kernels_package_is_importable_as_kernels():
    assert Path(kernels.__file__).resolve().parent == REPO / "kernels"
    assert importlib.util.find_spec("kernels.nvfp4") is not None


def test_transformers_does_not_take_ours_for_the_hub_kernels_package():
    from transformers.integrations import hub_kernels
    from transformers.utils import import_utils

    assert not import_utils.is_kernels_available()
    # transformers only imports `kernels` inside `if is_kernels_available()`: nothing of ours was bound
    assert (
        not hasattr(hub_kernels, "get_kernel")
        or getattr(hub_kernels.get_kernel, "__module__", "") != "kernels"
    )
    assert not any(getattr(v, "__module__", "").startswith("kernels.") for v in vars(hub_kernels).values())


def test_transformers_model_load_ignores_our_kernels(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    hub_modules = [m for m in model.modules() if type(m).__module__.startswith("kernels")]
    assert hub_modules == []
