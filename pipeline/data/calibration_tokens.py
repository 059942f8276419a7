"""GPTQ's calibration token ids: reference text, or the base model's own completions.

What: ``calibration_tokens(cal, src_dir, data)`` (``cal``: the ``quantize.calibration`` settings)
returns a function that gives the calibration token ids, and ``info``, what the quantize key and
manifest record of them (source, sequences, digest). For the text sources (``gsm8k``, ``train``:
``qerl.pipeline.data.calibration_text``) the ids are tokenized at once and ``info["digest"]`` is
their digest. For ``samples`` the ids are the run's training prompts followed by the base model's own
completions (``greedy_completions``), generated only when the function is called, inside the build:
``info["digest"]`` is then the digest of the prompts (the completions are a function of them, the
base model and this code, all in the key), so a cache hit costs a tokenization, not a generation. The
build adds the generated ids' digest and token count and the device and dtype that generated them
to ``info`` (``completions_digest``, ``tokens``, ``generated_on``), which the manifest records. It lives with the data (not with the NVFP4 format) because
it is the calibration text; it loads the base model only to complete it.

Departure and why: the completions are greedy, not sampled. A greedy completion is a function of
the prompt, the weights and the arithmetic alone, so the artifact is reproducible on another machine
of the same kind without an RNG in its key, and it is the model's most likely text, which is what the
quantized model will be run on most. Across kinds (fp32 on a CPU, bf16 on a GPU) a near-tie can
decode differently, as a rollout can: the key is the same and the store's own digest check re-keys
a rebuild with other bytes; ``generated_on`` says which it was.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
from qerl.pipeline.data.calibration_text import (
    calibration_pairs,
    calibration_questions,
    calibration_token_ids,
    prompt_token_ids,
    resolve_source,
    token_digest,
)
from qerl.pipeline.data.datasets import DataConfig
from qerl.pipeline.runtime.device import default_device

__all__ = ["CalibrationSettings", "calibration_tokens", "generation_device", "greedy_completions"]

TokenIds = list[list[int]]


class CalibrationSettings(Protocol):
    """What this module reads of ``quantize.calibration`` (``qerl.pipeline.nvfp4.recipe.CalibrationConfig``)."""

    source: str
    count: int
    seed: int
    max_tokens: int


def calibration_tokens(
    cal: CalibrationSettings, src_dir: Path, data: DataConfig | None, held_out: frozenset[str] = frozenset()
) -> tuple[Callable[[], TokenIds], dict[str, Any]]:
    """The calibration token ids (as a function: ``samples`` generates them when called) and ``info``;
    none of the questions in ``held_out`` (the run's validation split) is among them."""
    from transformers import AutoTokenizer

    data = data or DataConfig()
    tokenizer = AutoTokenizer.from_pretrained(src_dir)
    if resolve_source(cal.source, data) != "samples":
        pairs, label = calibration_pairs(cal.source, cal.count, cal.seed, data, held_out)
        ids = calibration_token_ids(tokenizer, pairs, data.template, cal.max_tokens)
        info = {
            "source": label,
            "sequences": len(ids),
            "tokens": sum(map(len, ids)),
            "template": data.template,
            "held_out_questions": len(held_out),
        }
        return (lambda: ids), {**info, "digest": token_digest(ids)}
    questions, label = calibration_questions(cal.count, cal.seed, data, held_out)
    prompts = prompt_token_ids(tokenizer, questions, data.template)
    info = {"source": label, "sequences": len(prompts), "template": data.template, "completions": "greedy",
            "held_out_questions": len(held_out)}  # fmt: skip
    info["digest"] = token_digest(prompts)

    def generate() -> TokenIds:
        eos = tokenizer.eos_token_id
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
        device, dtype = generation_device()
        ids = greedy_completions(src_dir, prompts, cal.max_tokens, eos, pad)
        info.update(
            tokens=sum(map(len, ids)), completions_digest=token_digest(ids), generated_on=f"{device}/{dtype}"
        )
        return ids

    return generate, info


def generation_device() -> tuple[torch.device, torch.dtype]:
    """Where and in what dtype the completions are generated: fp32 on the CPU, bf16 on a GPU."""
    device = torch.device(default_device())
    return device, torch.bfloat16 if device.type == "cuda" else torch.float32


def greedy_completions(
    src_dir: Path, prompts: TokenIds, max_tokens: int, eos_id: int, pad_id: int, batch_size: int = 16
) -> TokenIds:
    """Each prompt followed by the base model's greedy completion (through its first EOS), truncated
    to ``max_tokens``. Batches are left-padded; fp32 on the CPU, bf16 on a GPU."""
    from transformers import AutoModelForCausalLM

    device, dtype = generation_device()
    model = AutoModelForCausalLM.from_pretrained(src_dir, dtype=dtype).to(device).eval()
    out: TokenIds = []
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start : start + batch_size]
        width = max(map(len, batch))
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, p in enumerate(batch):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        with torch.no_grad():
            generated = model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                do_sample=False,
                max_new_tokens=max(1, max_tokens - min(map(len, batch))),
                pad_token_id=pad_id,
                eos_token_id=eos_id,
            )
        for row, p in enumerate(batch):
            new = generated[row, width:].tolist()
            if eos_id in new:
                new = new[: new.index(eos_id) + 1]
            out.append((p + new)[:max_tokens])
    del model
    return out
