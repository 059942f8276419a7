"""What a Ray worker gets from the driver in the job's ``runtime_env``: the code and the environment.

- the code: ``py_modules`` ships the driver's ``qerl`` package (``qerl_package_dir``: from a source
  checkout, a staged copy that gathers its folders), so every node runs the driver's code.
  Third-party packages and the ``qerl`` distribution itself (its version is part of every cache key)
  must be installed on every node at the driver's versions: ``qerl.flows.ray.probe`` checks that
  before any run starts.
- the environment: workers of ``ray start`` inherit the raylet's environment, not the driver's, so
  ``env_vars`` forwards the driver's ``QERL_*``, ``HF_*``, ``VLLM_*``, ``TRITON_*``,
  ``TRANSFORMERS_*``, ``MLFLOW_*``, ``PREFECT_*`` and ``TOKENIZERS_PARALLELISM`` (``forwarded_env``).
"""

from __future__ import annotations

import os
from pathlib import Path

SUBPACKAGES = ("pipeline", "flows", "stages", "kernels")  # qerl's sub-packages: what py_modules ships
FORWARD_PREFIXES = ("QERL_", "HF_", "VLLM_", "TRITON_", "TRANSFORMERS_", "MLFLOW_", "PREFECT_")


FORWARD_NAMES = ("TOKENIZERS_PARALLELISM", "DO_NOT_TRACK")


def forwarded_env() -> dict[str, str]:
    """The driver's environment variables a worker's run depends on (module docstring)."""
    return {k: v for k, v in os.environ.items() if k.startswith(FORWARD_PREFIXES) or k in FORWARD_NAMES}


def qerl_package_dir(staging: Path) -> Path:
    """The ``qerl`` package as one folder, for ``py_modules``: an installed package is one already; a
    source checkout maps the top-level folders into it (pyproject's package-dir), so they are copied
    under ``staging/qerl``."""
    import importlib
    import shutil

    import qerl

    root = Path(qerl.__file__).resolve().parent
    dirs = {
        name: Path(importlib.import_module(f"qerl.{name}").__file__).resolve().parent for name in SUBPACKAGES
    }
    if all(path == root / name for name, path in dirs.items()):
        return root
    staged = staging / "qerl"
    shutil.copytree(root, staged, ignore=shutil.ignore_patterns("__pycache__"))
    for name, path in dirs.items():
        shutil.copytree(path, staged / name, ignore=shutil.ignore_patterns("__pycache__"))
    return staged
