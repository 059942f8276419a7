"""The stages: one module per stage, each a plain function ``run(...) -> Manifest`` over the artifact
store (fetch_model, demo_base, quantize, dequantize, rollout, score, train, evaluate, register).
Stages pass small manifests (paths, digests, config hash, code version), never models or tensors.
They import ``qerl.pipeline`` and ``qerl.kernels``, never Prefect."""
