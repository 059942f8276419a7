"""Whether a LoRA adapter was trained for this base: every LoRA pair must sit on a linear the base has,
with the base's input and output sizes, and every linear of the base of a kind the adapter targets
(``q_proj`` in any layer, say) must carry one. Read from the safetensors headers of both (no weights
loaded), so an adapter of another model is refused before an engine starts, naming what differs;
without it a smaller adapter loads into a larger model and gives a meaningless accuracy (a 2-layer
model's adapter on a 4-layer base of the same width fits every shape, and covers half the layers).
A quantized linear's shape is its scheme's to read (``qerl.pipeline.schemes``): NVFP4 packs two codes
a byte, and NF4 stores its codes flat, ``[numel/2, 1]``, with the shape in its quantization state."""

from __future__ import annotations

import re
from pathlib import Path

from qerl.pipeline.nvfp4.safetensors_io import safetensors_index
from qerl.pipeline.rollout.protocol import EngineError, check_adapter_dir
from qerl.pipeline.schemes import checkpoint_scheme, scheme_module

__all__ = ["adapter_mismatches", "check_adapter_fits", "linear_shapes"]

_LORA_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[\w-]+)?\.weight$")
_SHOWN = 5  # mismatches named in the error; the count says how many more
_LAYER_INDEX = re.compile(r"\.\d+\.")


def linear_shapes(base_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """Every linear-like weight of the base: module name -> its unquantized [out, in] shape."""
    specs = safetensors_index(base_dir)
    shapes = {
        n[: -len(".weight")]: s.shape for n, s in specs.items() if n.endswith(".weight") and len(s.shape) == 2
    }
    scheme = checkpoint_scheme(base_dir)
    if scheme != "none":
        shapes.update(scheme_module(scheme).quantized_linears(specs))
    return shapes


def adapter_mismatches(adapter_dir: str | Path, base_dir: str | Path) -> list[str]:
    """What does not fit, one line per LoRA tensor (empty when the adapter fits the base)."""
    base = linear_shapes(base_dir)
    problems = []
    adapter = safetensors_index(adapter_dir)
    for name, spec in sorted(adapter.items()):
        match = _LORA_KEY.match(name)
        if match is None:
            continue
        module, ab = match["module"], match["ab"]
        if module not in base:
            problems.append(f"{module}: the base has no such linear")
            continue
        out_features, in_features = base[module]
        if ab == "A" and spec.shape[1] != in_features:
            problems.append(f"{module}.lora_A: {spec.shape[1]} inputs, the base's linear has {in_features}")
        if ab == "B" and spec.shape[0] != out_features:
            problems.append(f"{module}.lora_B: {spec.shape[0]} outputs, the base's linear has {out_features}")
    covered = {m["module"] for name in adapter if (m := _LORA_KEY.match(name))}
    kinds = {_LAYER_INDEX.sub(".N.", module) for module in covered}
    for module in sorted(base):
        if module not in covered and _LAYER_INDEX.sub(".N.", module) in kinds:
            problems.append(f"{module}: the base's linear has no LoRA pair, as the adapter's other layers do")
    return problems


def check_adapter_fits(adapter_dir: str | Path, base_dir: str | Path) -> Path:
    """``adapter_dir`` if it is a peft adapter that fits the base in ``base_dir``, else an ``EngineError``
    naming the first mismatches."""
    adapter = check_adapter_dir(Path(adapter_dir))
    problems = adapter_mismatches(adapter, base_dir)
    if problems:
        more = f" (and {len(problems) - _SHOWN} more)" if len(problems) > _SHOWN else ""
        raise EngineError(
            f"the LoRA adapter {adapter} was not trained for the base {base_dir}: "
            + "; ".join(problems[:_SHOWN])
            + more
        )
    return adapter
