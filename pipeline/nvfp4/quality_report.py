"""The quality stage's section, for people and trackers: one line, a table, flat metrics.

``qerl.pipeline.nvfp4.quality`` measures the section; this module only reads it (a section is a plain
dict in the manifest, so an artifact from an older version, or none at all, prints as "not measured").
"""

from __future__ import annotations

from typing import Any

__all__ = ["quality_brief", "quality_line", "quality_metrics", "quality_table"]


def _short(name: str) -> str:
    return name.removeprefix("model.")


_SOURCE_WORDS = {"gsm8k/test": "GSM8K test solutions", "arithmetic/test": "arithmetic test answers"}


def quality_line(section: dict[str, Any] | None) -> str:
    """One line: KL, top-1, perplexities (texts, tokens) and the worst linear's relative error."""
    if not section:
        return "quality: not measured (quantize.quality.enabled is false, or the artifact predates it)"
    w = section["weight_error"]
    worst = f"worst linear {_short(w['worst'])} {100 * w['max']:.1f}%"
    if "kl" not in section:
        return f"quality: weight error mean {100 * w['mean']:.1f}% over {w['linears']} linears; {worst}"
    t = section["texts"]
    what = _SOURCE_WORDS.get(t["source"], t["source"])
    if t["source"].startswith("validation:"):
        what = f"{t['source'].removeprefix('validation:')} validation texts"
    return (
        f"quality: KL {section['kl']:.3f} nats/token, top-1 {section['top1']:.3f}, "
        f"ppl {section['ppl_base']:.2f} -> {section['ppl_quant']:.2f} "
        f"({t['count']} {what}, {section['tokens']:,} tokens); {worst}"
    )


def quality_brief(section: dict[str, Any] | None) -> str:
    """What quantization cost, short enough for a console's stage line (``quality_line`` has it all):
    ", KL ... nats/token, top-1 ..." or ", weight error ...%"; empty without a section."""
    if not section:
        return ""
    if "kl" in section:
        return f", KL {section['kl']:.3f} nats/token, top-1 {section['top1']:.3f}"
    return f", weight error {100 * section['weight_error']['mean']:.1f}%"


def quality_metrics(section: dict[str, Any] | None) -> dict[str, float]:
    """The section's numbers as flat metrics for a tracker: ``quantize_kl``, ``quantize_top1``,
    ``quantize_ppl_base``, ``quantize_ppl_quant`` (when measured on texts) and
    ``quantize_weight_error_mean`` / ``_max``; empty without a section."""
    if not section:
        return {}
    out = {
        f"quantize_{k}": float(section[k]) for k in ("kl", "top1", "ppl_base", "ppl_quant") if k in section
    }
    w = section["weight_error"]
    out.update(quantize_weight_error_mean=float(w["mean"]), quantize_weight_error_max=float(w["max"]))
    return out


def quality_table(section: dict[str, Any] | None) -> str:
    """The per-linear relative weight errors, worst first (ties in module order)."""
    if not section:
        return quality_line(section) + "\n"
    layers = section["layers"]
    order = sorted(layers, key=lambda k: -layers[k])  # stable: module order among equals
    width = max(len(_short(k)) for k in order)
    lines = [f"{'linear':<{width}}  rel. weight error", f"{'-' * width}  -----------------"]
    lines += [f"{_short(k):<{width}}  {100 * layers[k]:16.2f}%" for k in order]
    return "\n".join(lines) + "\n"
