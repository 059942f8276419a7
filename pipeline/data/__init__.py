"""Problems, prompts and rewards: what the model is asked and how its answers are scored.

``datasets`` (named benchmarks, local files, ``DataConfig``), ``arithmetic`` (the procedural default
set), ``jsonl`` (the JSON Lines reader), ``prompts`` (templates), ``answers`` (answer extraction,
normalisation, verdicts decided without math-verify), ``rewards`` (``RewardConfig``, the math-verify
worker pool, ``score_batch``), ``catalogue`` (real models fetched without the hub, pinned),
``calibration_text`` (GPTQ's calibration texts: problems with their solutions) and ``heldout`` (the
held-out texts the quantization quality is measured on). May import
``config``, ``runtime`` and ``store``.
"""
