"""QeRL: NVFP4 4-bit base weights + LoRA + GRPO + Adaptive Quantization Noise, as resumable stages.

``qerl`` is the one name the project installs. Its sub-packages live in the repository's top-level
folders, mapped by pyproject.toml's ``package-dir``:

- ``qerl.pipeline`` (``pipeline/``): the domain core, importable without Prefect;
- ``qerl.stages`` (``stages/``): one plain function per stage, manifests in and out;
- ``qerl.kernels`` (``kernels/``): NVFP4 kernels beside their plain-PyTorch reference;
- ``qerl.flows`` (``flows/``): Prefect only: the RL flow, ablations, the nightly deployment, the CLI.

Imports go one way: flows -> stages -> pipeline -> kernels.
"""
