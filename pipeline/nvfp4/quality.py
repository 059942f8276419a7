"""What quantization costs: per-linear weight error and whole-model KL / top-1 / perplexity.

What: ``quality_section`` measures an NVFP4 (or NF4) checkpoint against the model it was quantized from and
returns a small ordered dict (rounded floats, byte-deterministic) that the quality stage
(``qerl.stages.quality``) keeps as its artifact and in its manifest (``extra["quality"]``):

* ``layers``: for every quantized linear, the relative weight error ``||W - deq(Q)||_F / ||W||_F``
  (``deq``: ``qerl.kernels``' NVFP4 decode; the stage passes bitsandbytes' for an NF4 checkpoint),
  streamed one linear at a time (the source tensor from the source safetensors, the packed one from
  the checkpoint, row-chunked float32 differences summed in float64), so memory stays one tensor.
* ``kl``, ``top1``, ``ppl_base``, ``ppl_quant``: over the completion tokens of held-out prompt +
  completion texts (``qerl.pipeline.data.heldout``: in a run, its validation split with reference
  completions; else GSM8K test reference solutions, else the arithmetic set's test answers), the
  mean of KL(base || quantized) per token in nats, the share of tokens where both models' most
  likely next token agree, and both perplexities of the completion (exp of the mean negative
  log-likelihood). Prompt tokens are context only.

How: fp32 (``dtype: bfloat16`` halves the memory where an fp32 copy does not fit the GPU; the
device's free memory is checked first), on the GPU where there is one (two fp32 passes of a 7B model
are hours of CPU), else on the CPU. The base model (its own weights, upcast) runs first; its completion-position logits
are spilled to a float32 temporary file (written and read back in order), so only one model is ever
resident (a 7B model's two fp32 copies would not fit beside each other). Then the quantized model (the
checkpoint's dequantized weights, ``load_dequantized``, fp32) runs and each chunk of
positions is compared with the spilled rows. Texts run in right-padded batches of about
``_BATCH_TOKENS`` tokens (few forward calls for a small model, bounded activations for a large one);
the LM head is applied to the decoder's hidden states a chunk of positions at a time (``_chunk_rows``:
about 16 Mi logits), so no [tokens x vocab] tensor of a whole text is built. Sums are float64;
``logit_metrics`` is the per-chunk arithmetic, tested against hand-derived values, and the whole
path against plain whole-sequence forwards. The section carries no timing (it would break its
byte-determinism); the stage records ``quality_seconds`` among its metrics.

Departures, and why: the quantized model is evaluated with fp32 dequantized weights, not the bf16 twin
or the FP4 Marlin kernel a server runs: the measure is the quantization's cost, not that of a serving
dtype. Prompt and completion are tokenized separately and concatenated (no merge across the
boundary), so the scored tokens are exactly the completion's tokens; no end-of-turn token is added.
The prompt is the plain question and a newline by default (``prompt: plain``), not the chat template
the RL run uses: this is the setting of the issue's own measurement (64 GSM8K test solutions, 7,862
SmolLM2 tokens, base perplexity 4.43), so numbers stay comparable across the project's reports, and it
measures language modelling of the solutions rather than the chat protocol. ``prompt: chat`` renders
the tokenizer's chat template instead (an error for a tokenizer without one).
"""

from __future__ import annotations

import json
import math
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from qerl.pipeline.nvfp4.quality_config import QualityConfig
from qerl.pipeline.nvfp4.safetensors_io import read_tensor, safetensors_index
from qerl.pipeline.runtime.device import default_device
from qerl.pipeline.store.files import free_bytes, human_bytes

# a checkpoint's quantized linears, decoded: (module, float32 weight) one at a time
Linears = Callable[[str | Path], Iterator[tuple[str, torch.Tensor]]]

__all__ = [
    "QualityConfig",
    "check_texts",
    "check_device_room",
    "check_spill_space",
    "encode_items",
    "logit_metrics",
    "model_metrics",
    "quality_section",
    "relative_error",
    "text_tokenizer",
    "weight_errors",
]

_LOGIT_BUDGET = 1 << 24  # logits per chunk of positions (64 MiB in float32; a few such temporaries)
_BATCH_TOKENS = 4096  # padded tokens per forward: few calls for small models, bounded activations
_ROUND = 6


# --- per-linear weight error ------------------------------------------------------------------


def relative_error(w: torch.Tensor, d: torch.Tensor, chunk_elements: int = 1 << 22) -> float:
    """``||w - d||_F / ||w||_F`` in float64, row-chunked; 0.0 for an all-zero ``w`` decoded exactly."""
    if w.shape != d.shape:
        raise ValueError(f"relative_error: shapes differ, {tuple(w.shape)} vs {tuple(d.shape)}")
    w2, e2 = 0.0, 0.0
    rows = w.reshape(w.shape[0], -1) if w.dim() > 1 else w.reshape(1, -1)
    dec = d.reshape(rows.shape)
    step = max(1, chunk_elements // max(1, rows.shape[1]))
    for r in range(0, rows.shape[0], step):
        a = rows[r : r + step].to(torch.float64)
        w2 += float((a * a).sum())
        diff = a - dec[r : r + step].to(torch.float64)
        e2 += float((diff * diff).sum())
    if w2 == 0.0:
        return 0.0 if e2 == 0.0 else math.inf
    return math.sqrt(e2 / w2)


def weight_errors(src_dir: str | Path, ckpt_dir: str | Path, linears: Linears) -> dict[str, float]:
    """Relative weight error of every quantized linear of ``ckpt_dir`` (``linears`` decodes them) against
    ``src_dir``, in natural module order; one linear in memory at a time."""
    specs = safetensors_index(src_dir)
    out: dict[str, float] = {}
    for module, deq in linears(ckpt_dir):
        spec = specs.get(f"{module}.weight")
        if spec is None:
            raise ValueError(f"{ckpt_dir}: quantized linear '{module}' has no '{module}.weight' in {src_dir}")
        out[module] = relative_error(read_tensor(spec), deq)
    return out


# --- whole-model metrics ----------------------------------------------------------------------


def logit_metrics(base: torch.Tensor, quant: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    """Sums over rows of [n, vocab] logits: ``kl`` (sum of KL(base||quant) per row, nats), ``agree``
    (rows whose argmax agree), ``nll_base`` / ``nll_quant`` (sum of -log p(target)), ``tokens`` (n)."""
    if base.shape != quant.shape or base.dim() != 2 or targets.shape != base.shape[:1]:
        raise ValueError(
            f"logit_metrics: base {tuple(base.shape)}, quant {tuple(quant.shape)} and targets "
            f"{tuple(targets.shape)} must be [n, vocab], [n, vocab], [n]"
        )
    lp = torch.log_softmax(base.float(), dim=-1)
    lq = torch.log_softmax(quant.float(), dim=-1)
    kl = (lp.exp() * (lp - lq)).sum(-1, dtype=torch.float64)
    t = targets.long().unsqueeze(-1)
    return {
        "kl": float(kl.sum()),
        "agree": float((base.argmax(-1) == quant.argmax(-1)).sum()),
        "nll_base": float(-lp.gather(-1, t).sum(dtype=torch.float64)),
        "nll_quant": float(-lq.gather(-1, t).sum(dtype=torch.float64)),
        "tokens": float(base.shape[0]),
    }


def encode_items(
    tokenizer: Any, items: list[dict[str, Any]], max_tokens: int, prompt: str = "plain"
) -> tuple[list[tuple[list[int], int]], int]:
    """(list of (token ids, prompt length), truncated count): each item's prompt (``prompt``: plain,
    the question and a newline; chat, the chat template's rendering) and its completion, tokenized apart."""
    if prompt not in ("plain", "chat"):
        raise ValueError(f"quantize.quality.prompt must be plain or chat, not '{prompt}'")
    chat = prompt == "chat"
    if chat and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"quantize.quality.prompt chat: the tokenizer ({getattr(tokenizer, 'name_or_path', '?')}) has no "
            "chat template; use prompt plain"
        )
    encoded, truncated = [], 0
    for item in items:
        if chat:
            text = tokenizer.apply_chat_template(item["messages"], tokenize=False, add_generation_prompt=True)
        else:
            text = "\n".join(m["content"] for m in item["messages"]) + "\n"
        p = tokenizer(text, add_special_tokens=False).input_ids
        c = tokenizer(item["completion"], add_special_tokens=False).input_ids
        if len(p) + 1 > max_tokens:
            raise ValueError(
                f"held-out item {item.get('id')}: its prompt is {len(p)} tokens, no room for a completion "
                f"within quantize.quality.max_tokens={max_tokens}"
            )
        if not c:
            raise ValueError(f"held-out item {item.get('id')}: the completion has no tokens")
        if len(p) + len(c) > max_tokens:
            c, truncated = c[: max_tokens - len(p)], truncated + 1
        encoded.append((p + c, len(p)))
    return encoded, truncated


def _chunk_rows(vocab: int) -> int:
    return max(1, _LOGIT_BUDGET // max(1, vocab))


def _batches(encoded: list[tuple[list[int], int]]) -> Iterator[list[tuple[list[int], int]]]:
    """Consecutive texts, as many as fit ``_BATCH_TOKENS`` padded tokens (one text at least)."""
    batch: list[tuple[list[int], int]] = []
    for item in encoded:
        longest = max([len(ids) for ids, _ in batch] + [len(item[0])])
        if batch and longest * (len(batch) + 1) > _BATCH_TOKENS:
            yield batch
            batch = []
        batch.append(item)
    if batch:
        yield batch


@torch.inference_mode()
def _completion_logits(
    model: torch.nn.Module, encoded: list[tuple[list[int], int]]
) -> Iterator[torch.Tensor]:
    """Float32 logits at the positions that predict the completion tokens, every text in order, a
    chunk of rows at a time (a chunk may span texts). Texts run in right-padded batches (the mask
    hides the padding; a real token's position and context are those of the text alone)."""
    head = model.get_output_embeddings()
    step = _chunk_rows(head.weight.shape[0])
    for batch in _batches(encoded):
        width = max(len(ids) for ids, _ in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for b, (toks, _) in enumerate(batch):
            ids[b, : len(toks)], mask[b, : len(toks)] = torch.tensor(toks), 1
        device = head.weight.device
        hidden = model.get_decoder()(
            input_ids=ids.to(device), attention_mask=mask.to(device)
        ).last_hidden_state
        # the batch's completion rows in text order, so the head and the metrics run on few large chunks
        rows = torch.cat(
            [hidden[b, n_prompt - 1 : len(toks) - 1] for b, (toks, n_prompt) in enumerate(batch)]
        )
        for r in range(0, rows.shape[0], step):
            yield head(rows[r : r + step]).float().cpu()


def check_spill_space(base_dir: str | Path, tokens: int, spill_dir: str | Path | None) -> int:
    """The bytes the base's spilled logits take (``tokens`` rows of float32 over the vocabulary);
    raises ``OSError`` naming both numbers when ``spill_dir`` has less free space, before a model loads."""
    vocab = int(json.loads((Path(base_dir) / "config.json").read_text())["vocab_size"])
    need = tokens * vocab * 4
    where = Path(spill_dir) if spill_dir is not None else Path(tempfile.gettempdir())
    free = free_bytes(where)
    if free is not None and need > free:
        raise OSError(
            f"quality: the base model's logits for {tokens:,} tokens take {human_bytes(need)} under {where}, "
            f"which has {human_bytes(free)} free: free space there, or set quantize.quality.texts lower "
            "(0: weight errors only)"
        )
    return need


def _load_base(model_dir: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


def check_device_room(base_dir: str | Path, dtype: torch.dtype, device: str) -> int:
    """The bytes one model takes in ``dtype`` (every tensor of the source's safetensors); on a GPU,
    raises ``MemoryError`` naming both numbers and ``quantize.quality.dtype`` when the device has
    less free memory than that, before a model loads (the CPU's memory is not checked)."""
    numel = sum(math.prod(spec.shape) for spec in safetensors_index(base_dir).values())
    need = numel * torch.empty((), dtype=dtype).element_size()
    if device == "cuda":
        free = torch.cuda.mem_get_info()[0]
        if need > free:
            raise MemoryError(
                f"quality: the base model takes {human_bytes(need)} in {str(dtype).removeprefix('torch.')}, the "
                f"GPU has {human_bytes(free)} free: set quantize.quality.dtype: bfloat16 (half), "
                "quantize.quality.texts: 0 (weight errors only) or quantize.quality.enabled: false"
            )
    return need


def model_metrics(
    base_dir: str | Path,
    quant_dir: str | Path,
    items: list[dict[str, Any]],
    max_tokens: int,
    prompt: str = "plain",
    spill_dir: str | Path | None = None,
    dtype: str = "float32",
    *,
    load: Callable[..., torch.nn.Module],
) -> dict[str, Any]:
    """KL(base||quant) nats/token, top-1 agreement, both perplexities over the completion tokens of
    ``items``; one model resident at a time, in ``dtype``, the base's logits spilled under ``spill_dir``
    (None: the system's temporary folder; see the module docstring). ``load(dir, dtype=)``: the
    quantized checkpoint as a plain model with its dequantized weights (its scheme's)."""

    device = default_device()  # a GPU where there is one: two fp32 passes of a 7B model are hours of CPU
    encoded, truncated = encode_items(text_tokenizer(base_dir), items, max_tokens, prompt)
    targets = torch.tensor([t for ids, n in encoded for t in ids[n:]])
    check_spill_space(base_dir, len(targets), spill_dir)
    torch_dtype = getattr(torch, dtype)
    check_device_room(base_dir, torch_dtype, device)
    sums = dict.fromkeys(("kl", "agree", "nll_base", "nll_quant", "tokens"), 0.0)
    # both passes yield the same chunks in the same order, so the spill is written and read back
    # sequentially, with plain file I/O: mapped pages would count in the resident set (safetensors_io)
    with tempfile.TemporaryFile(prefix="qerl-quality-", dir=spill_dir) as spill:
        base = _load_base(Path(base_dir), torch_dtype).to(device)
        for chunk in _completion_logits(base, encoded):
            spill.write(chunk.numpy().tobytes())
        del base
        quant = load(quant_dir, dtype=torch_dtype).eval().to(device)
        spill.seek(0)
        row = 0
        for chunk in _completion_logits(quant, encoded):
            k = chunk.shape[0]
            buf = bytearray(chunk.numel() * 4)
            if spill.readinto(buf) != len(buf):
                raise RuntimeError("quality: the base logits spill file is shorter than the quantized pass")
            base_rows = torch.frombuffer(buf, dtype=torch.float32).reshape(chunk.shape)
            part = logit_metrics(base_rows, chunk, targets[row : row + k])
            sums = {key: sums[key] + part[key] for key in sums}
            row += k
        del quant
    tokens = int(sums["tokens"])
    return {
        "prompt": prompt,
        "truncated": truncated,
        "tokens": tokens,
        "kl": sums["kl"] / tokens,
        "top1": sums["agree"] / tokens,
        "ppl_base": math.exp(sums["nll_base"] / tokens),
        "ppl_quant": math.exp(sums["nll_quant"] / tokens),
    }


# --- the manifest section and its renderings --------------------------------------------------


def _r(x: float) -> float:
    return round(float(x), _ROUND)


def text_tokenizer(base_dir: str | Path) -> Any:
    """The source model's tokenizer, for the held-out texts. transformers builds an empty one from a
    config.json alone (it encodes every text to nothing), so a folder without tokenizer files is
    named here, not as an empty completion."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    if not tokenizer("The answer is 42.", add_special_tokens=False).input_ids:
        raise ValueError(
            f"{base_dir}: no tokenizer (no tokenizer files there: transformers built an empty one); the "
            "quality section's held-out texts need the model's tokenizer: add its files, or set "
            "quantize.quality.texts: 0 (weight errors only) or quantize.quality.enabled: false"
        )
    return tokenizer


def check_texts(
    cfg: QualityConfig, base_dir: str | Path, texts: tuple[str, list[dict[str, Any]], str] | None
) -> None:
    """Every rejection of the held-out texts (no tokenizer, no chat template, a prompt too long), made
    at the start of the quality build, before the weight errors stream every linear of the model."""
    if cfg.enabled and texts is not None and cfg.texts > 0:
        encode_items(text_tokenizer(base_dir), texts[1], cfg.max_tokens, cfg.prompt)


def quality_section(
    cfg: QualityConfig,
    src_dir: str | Path,
    ckpt_dir: str | Path,
    texts: tuple[str, list[dict[str, Any]], str] | None,
    spill_dir: str | Path | None,
    decoder: ModuleType,
) -> dict[str, Any]:
    """The quality section for checkpoint ``ckpt_dir`` quantized from ``src_dir``.

    ``texts``: (label, items, digest) of ``qerl.pipeline.data.heldout``; None (with ``cfg.texts ==
    0``) measures the weight errors only. ``spill_dir``: where the base's logits are spilled.
    ``decoder``: the checkpoint's scheme's decoding module (``qerl.pipeline.schemes``), which reads
    its linears for ``weight_errors`` and the whole model for ``model_metrics``."""
    errors = weight_errors(src_dir, ckpt_dir, lambda d: decoder.dequantized_linears(d, torch.float32))
    if not errors:
        raise ValueError(f"{ckpt_dir}: no quantized linears to measure")
    worst = max(errors, key=errors.__getitem__)  # the first in module order among equals
    section: dict[str, Any] = {}
    if texts is not None and cfg.texts > 0:
        label, items, digest = texts
        m = model_metrics(
            src_dir,
            ckpt_dir,
            items,
            cfg.max_tokens,
            cfg.prompt,
            spill_dir,
            cfg.dtype,
            load=decoder.load_dequantized,
        )
        section["texts"] = {"source": label, "count": len(items), "digest": digest, "prompt": m["prompt"],
                            "max_tokens": cfg.max_tokens, "truncated": m["truncated"]}  # fmt: skip
        if cfg.dtype != "float32":  # the measure of record is float32's; another says so
            section["texts"]["dtype"] = cfg.dtype
        section.update(tokens=m["tokens"], kl=_r(m["kl"]), top1=_r(m["top1"]),
                       ppl_base=_r(m["ppl_base"]), ppl_quant=_r(m["ppl_quant"]))  # fmt: skip
    section["weight_error"] = {
        "linears": len(errors),
        "mean": _r(sum(errors.values()) / len(errors)),
        "max": _r(errors[worst]),
        "worst": worst,
    }
    section["layers"] = {k: _r(v) for k, v in errors.items()}
    return section
