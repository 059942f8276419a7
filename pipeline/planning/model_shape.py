"""A decoder-only model's shape as the memory plan needs it, and where a named model's shape comes from.

``ModelShape`` holds the config.json fields the arithmetic uses (hidden size, layers, heads, KV heads,
intermediate size, vocabulary, tied embeddings, head_dim, q/k/v biases); ``projections()`` gives each
decoder layer's seven linears. ``KNOWN_SHAPES`` is the Qwen2.5 family as its config.json files give it,
so a plan for those needs no download; ``resolve_model`` reads a config.json, a model directory, a
known shape's name or a hub id (whose config.json is fetched).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelShape:
    """What the memory plan needs from a decoder-only model's config.json."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tie_embeddings: bool = False
    head_dim: int = 0  # 0: hidden // heads
    qkv_bias: bool = True  # Qwen2 has q/k/v biases, Llama and Qwen3 do not

    @property
    def dim(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.dim

    def projections(self) -> dict[str, tuple[int, int]]:
        """(out, in) of each of a layer's seven projections."""
        q, kv, h, i = self.heads * self.dim, self.kv_dim, self.hidden, self.intermediate
        return {
            "q_proj": (q, h),
            "k_proj": (kv, h),
            "v_proj": (kv, h),
            "o_proj": (h, q),
            "gate_proj": (i, h),
            "up_proj": (i, h),
            "down_proj": (h, i),
        }

    @classmethod
    def from_config(cls, config: dict[str, Any], name: str = "model") -> ModelShape:
        cfg = config.get("text_config", config)  # multimodal wrappers keep the LM under text_config
        need = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
        missing = [k for k in need if not isinstance(cfg.get(k), int)]
        if missing:
            raise ValueError(f"{name}: config.json lacks {', '.join(missing)}: not a decoder-only LM config")
        arch = " ".join(cfg.get("architectures") or [cfg.get("model_type", "")])
        return cls(
            name=name,
            hidden=cfg["hidden_size"],
            layers=cfg["num_hidden_layers"],
            heads=cfg["num_attention_heads"],
            kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
            intermediate=cfg["intermediate_size"],
            vocab=cfg["vocab_size"],
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            head_dim=cfg.get("head_dim") or 0,
            qkv_bias=bool(cfg.get("attention_bias", "Qwen2" in arch)),
        )


def _qwen25(name: str, hidden: int, layers: int, heads: int, kv: int, inter: int, vocab: int, tie: bool):  # noqa: ANN202
    return ModelShape(name, hidden, layers, heads, kv, inter, vocab, tie)


# The Qwen2.5 family as its config.json files give it (the paper's models are 7B, 14B and 32B).
KNOWN_SHAPES: dict[str, ModelShape] = {
    s.name: s
    for s in (
        _qwen25("qwen2.5-0.5b", 896, 24, 14, 2, 4864, 151936, True),
        _qwen25("qwen2.5-1.5b", 1536, 28, 12, 2, 8960, 151936, True),
        _qwen25("qwen2.5-3b", 2048, 36, 16, 2, 11008, 151936, True),
        _qwen25("qwen2.5-7b", 3584, 28, 28, 4, 18944, 152064, False),
        _qwen25("qwen2.5-14b", 5120, 48, 40, 8, 13824, 152064, False),
        _qwen25("qwen2.5-32b", 5120, 64, 40, 8, 27648, 152064, False),
        _qwen25("qwen2.5-72b", 8192, 80, 64, 8, 29568, 152064, False),
    )
}


def _shape_key(spec: str) -> str:
    """``Qwen/Qwen2.5-7B-Instruct`` -> ``qwen2.5-7b`` (the instruct and base models share a shape)."""
    key = spec.lower().rsplit("/", 1)[-1]
    return re.sub(r"-(instruct|base|chat)$", "", key)


def resolve_model(spec: str) -> tuple[ModelShape, str]:
    """(shape, where it came from) for a config.json path, a model directory, a known shape's name or
    a hub id (whose config.json is fetched from the hub; the known shapes are tried first, offline)."""
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return ModelShape.from_config(json.loads(path.read_text()), path.parent.name), str(path)
    key = _shape_key(spec)
    if key in KNOWN_SHAPES:
        return KNOWN_SHAPES[key], f"known shape ({key})"
    if spec.count("/") != 1 or spec.startswith((".", "/")):
        raise ValueError(
            f"model '{spec}' is not a config.json, a model directory, a hub id or one of the known shapes "
            f"{', '.join(KNOWN_SHAPES)}"
        )
    try:
        from huggingface_hub import hf_hub_download

        local = hf_hub_download(spec, "config.json")
    except Exception as err:  # noqa: BLE001 - offline, unknown repo, gated: all mean "cannot read it"
        raise ValueError(f"cannot fetch config.json of hub model '{spec}': {err}") from err
    return ModelShape.from_config(json.loads(Path(local).read_text()), spec), f"hub ({spec})"
