"""Which prompts fit the rollout engine: those whose rendered prompt leaves room for the completion.

A prompt whose rendered token count (the model's tokenizer, the rollout template) exceeds
``rollout.max_model_len - rollout.max_new_tokens`` is dropped when the data is loaded, and counted
in the run record. Departure from "truncate": a cut math question is a different question with the
same gold answer, so dropping is the honest choice; and a prompt that does not fit would otherwise
fail its whole step mid-run.

Evaluation items are fitted the same way against ``rollout.max_model_len - eval.max_new_tokens`` (the
evaluate stage, on the items it loads): the dropped ones are counted in the evaluation's summary
(``prompts``), and the benchmark id names the items actually evaluated. ``eval.max_new_tokens`` that
alone fills the context is refused when the config is loaded (``run_checks``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qerl.pipeline.data.prompts import render_prompt
from qerl.pipeline.planning.errors import RunPlanError
from qerl.pipeline.rollout.config import RolloutConfig
from qerl.pipeline.rollout.prompt_encoding import encode_prompt

log = logging.getLogger("qerl.runplan")


@dataclass
class PromptFit:
    """The problems whose prompts fit the engine, and the ones dropped (id, prompt tokens)."""

    kept: list[Any]
    dropped: list[tuple[str, int]]
    limit: int

    def report(self) -> dict[str, Any]:
        return {
            "loaded": len(self.kept) + len(self.dropped),
            "kept": len(self.kept),
            "dropped_too_long": len(self.dropped),
            "prompt_token_limit": self.limit,
            "dropped_examples": [{"id": i, "tokens": n} for i, n in self.dropped[:5]],
        }


TRAIN_LIMIT = "rollout.max_model_len - rollout.max_new_tokens"
EVAL_LIMIT = "rollout.max_model_len - eval.max_new_tokens"


def prompt_token_limit(rollout: RolloutConfig) -> int:
    return rollout.max_model_len - rollout.max_new_tokens


def fit_prompts(
    problems: Sequence[Any], tokenizer: Any, template: str, limit: int, setting: str = TRAIN_LIMIT
) -> PromptFit:
    """Split ``problems`` by whether their rendered prompt has at most ``limit`` tokens (``setting``:
    where the limit comes from, for the messages)."""
    kept, dropped = [], []
    for problem in problems:
        n = len(encode_prompt(tokenizer, render_prompt(tokenizer, problem["question"], template)))
        if n <= limit:
            kept.append(problem)
        else:
            dropped.append((str(problem["id"]), n))
    if dropped:
        log.warning(
            "%d of %d prompts are longer than %d tokens (%s) and were dropped, e.g. %s",
            len(dropped), len(problems), limit, setting, ", ".join(f"{i} ({n})" for i, n in dropped[:3]),
        )  # fmt: skip
    if not kept:
        raise RunPlanError(
            f"no prompt fits: all {len(problems)} rendered prompts are longer than {limit} tokens "
            f"({setting}); raise rollout.max_model_len"
        )
    return PromptFit(kept, dropped, limit)


def load_tokenizer(model_dir: str | Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))
