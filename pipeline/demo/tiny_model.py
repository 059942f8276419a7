"""Tiny causal LMs built from configs, with a tokenizer trained locally: nothing is downloaded.

Tests and the embedded demo need real Hugging Face model directories (config.json, safetensors,
tokenizer files, generation config) of the architectures the pipeline supports, small enough to run
on two CPU cores. ``build_tiny_model`` writes one: a byte-level BPE tokenizer trained with the
``tokenizers`` library on a corpus (arithmetic text by default), a ChatML chat template like Qwen's,
and randomly initialised weights from a seeded generator. head_dim defaults to 32 because vLLM's CPU
attention needs head_dim >= 32.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]

# ChatML, as Qwen2.5 uses it; a system turn only when given.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

ARCHITECTURES = {
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "llama": ("LlamaForCausalLM", "llama"),
}


def default_corpus(n: int = 4000, seed: int = 0) -> list[str]:
    """Arithmetic-flavoured text: enough to give the BPE merges for digits, operators and words."""
    rng = random.Random(seed)
    words = [
        "What", "is", "the", "answer", "total", "sum", "of", "and", "plus", "minus", "times", "has",
        "apples", "books", "coins", "left", "each", "gives", "buys", "more", "Tom", "Ana", "boxed",
        "Answer", "So", "then", "first", "step", "<answer>", "</answer>", "\\boxed{", "}", "####",
    ]  # fmt: skip
    lines = []
    for _ in range(n):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice(["+", "-", "*", "/"])
        phrase = " ".join(rng.choice(words) for _ in range(rng.randint(3, 12)))
        lines.append(f"{phrase} {a} {op} {b} = {a + b} \\boxed{{{a + b}}} <answer>{a - b}</answer>")
    return lines


def train_tokenizer(corpus: Iterable[str] | None = None, vocab_size: int = 512) -> Any:
    """Train a byte-level BPE tokenizer and wrap it as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Digits one token each, as Qwen's tokenizer does: arithmetic stays learnable for a tiny model.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(corpus if corpus is not None else default_corpus()), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        bos_token=None,
        unk_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_config(
    arch: str = "qwen2",
    vocab_size: int = 512,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 256,
    max_position_embeddings: int = 1024,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    tie_word_embeddings: bool = False,
) -> Any:
    """A transformers config of the given family at toy size."""
    from transformers import AutoConfig

    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown tiny architecture '{arch}'; choose one of {sorted(ARCHITECTURES)}")
    arch_name, model_type = ARCHITECTURES[arch]
    extra = {"head_dim": hidden_size // num_heads} if arch == "qwen3" else {}
    return AutoConfig.for_model(
        model_type,
        architectures=[arch_name],
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
        tie_word_embeddings=tie_word_embeddings,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        **extra,
    )


def build_tiny_model(
    out_dir: str | Path,
    arch: str = "qwen2",
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    corpus: Iterable[str] | None = None,
    vocab_size: int = 512,
    norm_jitter: float = 0.0,
    **sizes: int,
) -> Path:
    """Write a complete HF model directory with random weights and a locally trained tokenizer.

    ``norm_jitter`` perturbs RMSNorm weights away from exactly 1.0 so tests can tell them apart.
    """
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(corpus, vocab_size=vocab_size)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = tokenizer.convert_tokens_to_ids("<|pad|>")
    config = tiny_config(arch, vocab_size=len(tokenizer), eos_token_id=eos, pad_token_id=pad, **sizes)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and norm_jitter:
                param.add_(torch.randn_like(param) * norm_jitter)
            elif param.dim() == 2:
                param.normal_(0.0, 0.05)
    model.to(dtype).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    GenerationConfig(eos_token_id=eos, pad_token_id=pad, bos_token_id=None).save_pretrained(out)
    (out / "qerl_tiny.json").write_text(json.dumps({"arch": arch, "seed": seed, "dtype": str(dtype)}))
    return out
