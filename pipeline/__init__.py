"""The domain core, importable without Prefect: one sub-package per concern.

Imports go one way, from the bottom of this list to the top:

- ``config`` and ``schemes`` (modules) and ``runtime``: typed configs, the base schemes' mode names
  and decoding modules, device, threads, seeds; ``fleet``: where a fleet's services are, PostgreSQL
  coordination (leases, build locks, the cursor) and the host-local GPU lock; import nothing of qerl.
- ``store``: the content-addressed artifact store, manifests, retention.
- ``nvfp4``: the NVFP4A16 checkpoint format, its I/O and the quantized linear for training (uses
  ``qerl.kernels``); ``data``: datasets, prompts, rewards, the model catalogue.
- ``nf4``: QLoRA's NF4 base (bitsandbytes): its checkpoint, dequantization and training load (it
  reuses ``nvfp4``'s safetensors reader and writer).
- ``rollout`` (engines, AQN), ``rl`` (GRPO objective, logprobs, training), ``evaluation``
  (statistics, ablations), ``registry`` (MLflow tracking, promotion), ``demo`` (the demo's base model).
- ``planning``: what a run does (run config and presets, prompt stream, cursor, warm start, memory
  plan, retry rules); it may import every other sub-package.
"""
