"""Prompt templates: a reasoning part, then a final answer in a form the reward extractor reads.

Templates are ours (not copied from a recipe). Each names the answer format it asks for, which is
the extraction mode the scorer should use (``boxed``, ``answer_tags``, ``gsm8k`` or
``last_number``), and how it is rendered: every template here is a chat template (``render:
chat``): its messages go through the tokenizer's own chat template (ChatML for Qwen and SmolLM2,
the tiny test models' too), with the generation prompt added. A tokenizer without a chat template
is an error naming the template, not a silent switch to plain text, which an instruct model would
read as a different task. The engines encode a chat-rendered prompt without adding special tokens
again (``qerl.pipeline.rollout.prompt_encoding.encode_prompt``).

``number`` is for small instruct models (SmolLM2-135M): they rarely follow a ``\boxed{}`` or
``####`` instruction, but do end with the number, so the scorer takes the last number.
"""

from __future__ import annotations

from typing import Any

TEMPLATES: dict[str, dict[str, str]] = {
    "boxed": {
        "system": "You are a careful math solver.",
        "user": "{question}\nThink step by step, then give the final answer as \\boxed{{...}}.",
        "answer_format": "boxed",
        "render": "chat",
    },
    "answer_tags": {
        "system": "You are a careful math solver.",
        "user": "{question}\nReason briefly, then write the final answer inside <answer></answer>.",
        "answer_format": "answer_tags",
        "render": "chat",
    },
    "gsm8k": {
        "system": "You are a careful math solver.",
        "user": "{question}\nShow your work and end with a line '#### <number>'.",
        "answer_format": "gsm8k",
        "render": "chat",
    },
    # a small instruct model's own system prompt (its chat template's default) and a plain request
    "number": {
        "system": "",
        "user": "{question}\nGive the final answer as a number at the end.",
        "answer_format": "last_number",
        "render": "chat",
    },
    # The embedded demo's tiny model: short, so a 128-wide model can learn it.
    "terse": {
        "system": "",
        "user": "{question}",
        "answer_format": "answer_tags",
        "render": "chat",
    },
}


def template_names() -> list[str]:
    return sorted(TEMPLATES)


def messages_for(question: str, template: str) -> list[dict[str, str]]:
    if template not in TEMPLATES:
        raise ValueError(f"unknown prompt template '{template}'; valid: {', '.join(template_names())}")
    spec = TEMPLATES[template]
    messages = [{"role": "system", "content": spec["system"]}] if spec["system"] else []
    messages.append({"role": "user", "content": spec["user"].format(question=question)})
    return messages


def render_prompt(tokenizer: Any, question: str, template: str) -> str:
    """The prompt text the model sees (chat template applied, generation prompt added)."""
    messages = messages_for(question, template)
    if TEMPLATES[template]["render"] != "chat":
        raise ValueError(f"template '{template}': unknown render mode '{TEMPLATES[template]['render']}'")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"prompt template '{template}' renders through the tokenizer's chat template, and this "
            f"tokenizer ({getattr(tokenizer, 'name_or_path', type(tokenizer).__name__)}) has none: use an "
            "instruct/chat model, or add a chat template (chat_template.jinja) to the model directory"
        )
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def answer_format(template: str) -> str:
    if template not in TEMPLATES:
        raise ValueError(f"unknown prompt template '{template}'; valid: {', '.join(template_names())}")
    return TEMPLATES[template]["answer_format"]


class Problem(dict):
    """One math problem: ``id``, ``question``, ``answer`` (gold, as text), ``source``, optional
    ``level`` and, where the data has one, ``group``: what makes two problems the same one for held-out
    splits (the arithmetic set's numbers, whatever the phrasing); without one, each problem is its own.

    A plain dict subclass so it round-trips through JSON/parquet rows without conversion code.
    """

    REQUIRED = ("id", "question", "answer")

    def __init__(
        self, id: str, question: str, answer: str, source: str = "", level: int | None = None,
        group: str | None = None,
    ):  # fmt: skip
        super().__init__(id=str(id), question=question, answer=str(answer), source=source, level=level)
        if group is not None:  # absent otherwise: the rows (and digests) of other data stay as they were
            self["group"] = group
