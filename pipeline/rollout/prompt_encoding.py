"""Prompt token ids and stop tokens, computed the same way for every engine.

Both engines take the rendered prompt text, encode it here and stop on the same token set, so the
vLLM and transformers engines see identical inputs token for token (the comparison tests rely on
it), and the run planner measures prompt lengths with the same encoding.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from qerl.pipeline.rollout.protocol import EngineError

__all__ = ["encode_prompt", "eos_token_ids"]


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """Prompt token ids as both engines see them.

    A chat template already writes its special tokens (BOS included where the model has one), so
    the tokenizer must not add them again; a plain-text prompt gets the tokenizer's usual ones.
    """
    add_special = not bool(getattr(tokenizer, "chat_template", None))
    ids = tokenizer(text, add_special_tokens=add_special)["input_ids"]
    if not ids:
        raise EngineError(f"prompt {text[:60]!r} tokenizes to nothing")
    return list(ids)


def eos_token_ids(model_dir: Path, tokenizer: Any) -> list[int]:
    """The stop tokens: the tokenizer's EOS plus generation_config.json's (what vLLM stops on)."""
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    gen_path = Path(model_dir) / "generation_config.json"
    if gen_path.is_file():
        value = json.loads(gen_path.read_text()).get("eos_token_id")
        for tok in value if isinstance(value, list) else [value]:
            if tok is not None and int(tok) not in ids:
                ids.append(int(tok))
    if not ids:
        raise EngineError(f"model {model_dir} defines no EOS token (tokenizer or generation_config.json)")
    return ids
