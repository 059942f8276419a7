"""Prompt templates: a reasoning part, then a final answer in a form the reward extractor reads.

Templates are ours (not copied from a recipe). Each names the answer format it asks for, which is
the extraction mode the scorer should use (``boxed``, ``answer_tags`` or ``gsm8k``). They are
rendered through the tokenizer's chat template when it has one, else as plain text.
"""

from __future__ import annotations

from typing import Any

TEMPLATES: dict[str, dict[str, str]] = {
    "boxed": {
        "system": "You are a careful math solver.",
        "user": "{question}\nThink step by step, then give the final answer as \\boxed{{...}}.",
        "answer_format": "boxed",
    },
    "answer_tags": {
        "system": "You are a careful math solver.",
        "user": "{question}\nReason briefly, then write the final answer inside <answer></answer>.",
        "answer_format": "answer_tags",
    },
    "gsm8k": {
        "system": "You are a careful math solver.",
        "user": "{question}\nShow your work and end with a line '#### <number>'.",
        "answer_format": "gsm8k",
    },
    # The embedded demo's tiny model: short, so a 128-wide model can learn it.
    "terse": {
        "system": "",
        "user": "{question}",
        "answer_format": "answer_tags",
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
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "\n\n".join(m["content"] for m in messages) + "\n"


def answer_format(template: str) -> str:
    if template not in TEMPLATES:
        raise ValueError(f"unknown prompt template '{template}'; valid: {', '.join(template_names())}")
    return TEMPLATES[template]["answer_format"]


class Problem(dict):
    """One math problem: ``id``, ``question``, ``answer`` (gold, as text), ``source`` and optional ``level``.

    A plain dict subclass so it round-trips through JSON/parquet rows without conversion code.
    """

    REQUIRED = ("id", "question", "answer")

    def __init__(self, id: str, question: str, answer: str, source: str = "", level: int | None = None):
        super().__init__(id=str(id), question=question, answer=str(answer), source=source, level=level)
