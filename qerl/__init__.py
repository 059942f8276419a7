"""QeRL: NVFP4 4-bit base weights + LoRA + GRPO + Adaptive Quantization Noise, as resumable stages.

``qerl`` is the one name the project installs. Its sub-packages live in the repository's top-level
folders, mapped by pyproject.toml's ``package-dir``:

- ``qerl.pipeline`` (``pipeline/``): the domain core, importable without Prefect;
- ``qerl.stages`` (``stages/``): one plain function per stage, manifests in and out;
- ``qerl.kernels`` (``kernels/``): NVFP4 kernels beside their plain-PyTorch reference;
- ``qerl.flows`` (``flows/``): Prefect only: the RL flow, ablations, the nightly deployment, the CLI.

Imports go one way: flows -> stages -> pipeline -> kernels. From an uninstalled checkout ``qerl``
resolves them from the checkout's folders the same way, so scripts need no install.
"""

import os as _os

_here = _os.path.dirname(_os.path.abspath(__file__))
_checkout = _os.path.dirname(_here)
if not _os.path.isdir(_os.path.join(_here, "pipeline")) and _os.path.isfile(
    _os.path.join(_checkout, "pipeline", "__init__.py")
):
    # imported from a source checkout that is not installed (the GPU machine, a script that puts the
    # repository first on sys.path): resolve the sub-packages where package-dir puts them
    __path__.append(_checkout)
