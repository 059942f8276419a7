"""The embedded demo's base model: a tiny Qwen2-shaped model with a locally trained tokenizer
(``tiny_model``; tests and benchmarks build their models with it too), warmed up by a short SFT
(``base_model``). May import ``config``, ``runtime`` and ``data``."""
