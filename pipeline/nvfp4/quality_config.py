"""The quality stage's settings (``quantize.quality``): what it measures and on which texts.

A config and nothing else, apart from the report's code (``qerl.pipeline.nvfp4.quality``): the
quantize config holds it as a section, and the quantize key, the twin's key and the run id leave it
out (a resource field there: it changes a report, never a checkpoint or an adapter), so editing these
settings, or this module, re-measures and never re-quantizes. The quality stage keys the settings it
computes with.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from qerl.pipeline.config import StrictModel

__all__ = ["QualityConfig"]


class QualityConfig(StrictModel):
    """What the quality stage measures (``quantize.quality``)."""

    enabled: bool = Field(
        default=True,
        description="measure what quantization costs (per-linear weight error, and with texts > 0 KL, "
        "top-1 and perplexities) as the quality stage, after the checkpoint is written; false: not measured",
    )
    source: Literal["auto", "validation", "gsm8k", "arithmetic"] = Field(
        default="auto",
        description="held-out texts: validation (a run's validation split with reference completions: the "
        "arithmetic set's answers, GSM8K's worked solutions), gsm8k (GSM8K test problems with their "
        "reference solutions, from data_root or $QERL_DATA_DIR), arithmetic (the procedural set's test "
        "split); auto: validation in a run that has one and whose data has reference completions, else "
        "gsm8k when its test file is there, else arithmetic",
    )
    data_root: str | None = Field(
        default=None,
        description="data directory holding gsm8k/test.jsonl (None: a run's data.root, else $QERL_DATA_DIR)",
    )
    texts: int = Field(
        default=64,
        ge=0,
        description="held-out prompt + completion texts the model metrics are measured on; 0: weight "
        "errors only (no model is loaded)",
    )
    prompt: Literal["plain", "chat"] = Field(
        default="plain",
        description="how a text's question is put before its completion: plain (the question and a newline) "
        "or chat (the tokenizer's chat template, user turn, generation prompt added)",
    )
    max_tokens: int = Field(
        default=1024,
        ge=8,
        description="tokens of one text (prompt + completion) at most; a longer completion is cut at its end",
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        default="float32",
        description="what both models run in: float32 (the measure of record) or bfloat16 (half the memory, "
        "for a model whose float32 copy does not fit the GPU: from about 14B on 80 GB; a GPU without room "
        "for the model in this dtype is refused with the numbers before it loads)",
    )
