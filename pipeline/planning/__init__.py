"""Planning: what a run is and how it goes, decided before and between the stages, without Prefect.

Holds the run's config schema and presets (``run_config``), its cross-field rules (``run_checks``),
how the rollout engine is set up (``engine_setup``: the twin decision, the eval engine), which
prompts fit and which a step uses (``prompt_fit``, ``prompt_stream``: slots, nights, the data
cursor), the nightly warm start (``warm_start``), the retry rules (``retry``), the GPU memory plan
(``model_shape``, ``memory``, ``memory_plan``), the disk estimate a run checks first
(``disk_plan``) and the generated config reference.

The top of ``qerl.pipeline``: it may import every other pipeline sub-package; none imports it.
"""
