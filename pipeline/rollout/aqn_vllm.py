"""AQN inside vLLM: a worker extension that sets the RMSNorm weights on every worker.

vLLM builds its workers (in the engine-core process, one per tensor/pipeline rank) from a class
name, so the code that touches the weights must live in an importable module: this one. It is
mixed into vLLM's worker class with ``LLM(..., worker_extension_cls="qerl.pipeline.rollout.aqn_vllm.
AQNWorkerExtension")`` and called with ``llm.collective_rpc("qerl_set_norm_noise", args=(sigma,
seed))``. The noise itself comes from ``qerl.pipeline.rollout.aqn`` (same seeds, same draws as the HF engine).

vLLM's norms are its own ``RMSNorm`` modules named ``model.layers.N.input_layernorm``; their
``weight`` is replicated (not sharded) under tensor parallelism, so every rank writes the full
vector, and under pipeline parallelism each rank only holds (and noises) its own layers, whose
global index is in the name. Each worker returns the sums of ``w_as_used - w_clean`` over its
channels, so the engine computes the realised sigma over all of them. The caller must reset the
prefix cache afterwards (KV computed under the old weights is stale). The clean copy is taken once
per worker: the engine never reloads its base weights (a new adapter is a LoRARequest, not a
weight reload), so it cannot go stale.

fp32 noisy weights (why: ``qerl.pipeline.rollout.aqn``). On an eager engine (no torch.compile,
no CUDA graphs) a noisy step replaces the two norms' bf16/fp16 ``weight`` by an fp32 parameter
holding clean + z. vLLM's ``RMSNorm`` then computes, through its native implementation,
``(x_hat_fp32 * w_fp32).to(x.dtype)`` and, for the fused residual-add variant, keeps the residual
in the input dtype (``x.to(orig_dtype)`` before normalising); the fused C kernels, which require
weight dtype == input dtype, decline the fp32 weight by their own ``supports_args`` check. Only the
AQN norms change, and only from the first noisy step: sigma = 0 puts the original bf16 parameter
back, so noise-free steps (and evaluation) run the fused kernels on the exact clean weights.

Engines with compiled graphs (``enforce_eager: false``: torch.compile with its guards dropped and
CUDA graphs that captured the weight's address and dtype) cannot have a parameter's dtype changed
after start-up: the compiled code would read the fp32 storage as bf16. So an engine that will run
AQN holds its AQN norms in fp32 from the moment its weights are loaded, before anything is compiled
or captured: it is started with ``load_format=FP32_NORMS_LOAD_FORMAT``, a model loader that is
vLLM's default one followed by ``hold_norms_fp32``. The noise is then written in place, in fp32, into
the storage the graphs read, and is exact; sigma 0 writes the clean values back (bf16 values held in
fp32). The price is in the noise-free steps too: such an engine computes its AQN norms as
``(x_hat_fp32 * w_fp32).to(x.dtype)`` throughout (vLLM's native norm; its fused C kernels decline a
weight whose dtype is not the input's), where a bf16 engine rounds ``x_hat`` to bf16 first, one
rounding apart, the same order as the difference between compiled and eager arithmetic. vLLM's
worker extension cannot hook the load (it is mixed in after the worker's own methods), hence the
loader, registered with vLLM by importing this module: vLLM imports it by name in every worker
process (the worker extension) before the worker loads the model, and the engine imports it before
it starts one. Such an engine also gets its own compile cache: vLLM keys its torch.compile cache
(``torch_compile_cache/<hash>``) by a hash of its config that leaves the load format out, and loads a
cached graph without checking it against the weights (guards off), so an engine built for AQN on the
same model and settings as a plain one would load the plain engine's graphs, compiled for 16-bit
norms, and read the fp32 storage as 16-bit (and the plain engine, started after it, the reverse).
``fp32_norms_engine_args`` therefore adds a key to vLLM's ``additional_config``, which that hash
includes. An engine compiled without the loader (``aqn`` not asked for) writes the noise in the
model's dtype, where most of late-stage sigma rounds away; the realised sigma says by how much and
the engine logs it at WARNING.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
from qerl.pipeline.rollout.aqn import noise_norm_modules, noise_targets

__all__ = [
    "FP32_NORMS_CACHE_KEY",
    "FP32_NORMS_LOAD_FORMAT",
    "AQNWorkerExtension",
    "fp32_norms_engine_args",
    "graphs_frozen",
    "hold_norms_fp32",
]

# vLLM's ``load_format`` of the loader that holds the AQN norms in fp32 from the start
FP32_NORMS_LOAD_FORMAT = "qerl-fp32-norms"
# the ``additional_config`` entry that gives such an engine a compile cache of its own
FP32_NORMS_CACHE_KEY = {"qerl_aqn_norms": "fp32"}


def fp32_norms_engine_args() -> dict[str, Any]:
    """``vllm.LLM``'s arguments for an engine that holds its AQN norms in fp32 from the load: the
    loader, and the config entry that keeps its compiled graphs apart from a plain engine's."""
    return {"load_format": FP32_NORMS_LOAD_FORMAT, "additional_config": dict(FP32_NORMS_CACHE_KEY)}


def hold_norms_fp32(model: Any) -> int:
    """Make the AQN norms' 16-bit weights fp32 parameters of the same values; how many it changed."""
    changed = 0
    targets = noise_targets(
        (name, module)
        for name, module in model.named_modules()
        if getattr(module, "weight", None) is not None
    )
    for _, _, module in targets.values():
        if module.weight.dtype in (torch.bfloat16, torch.float16):
            module.weight = torch.nn.Parameter(module.weight.data.float(), requires_grad=False)
            changed += 1
    return changed


def _register_fp32_norms_loader() -> None:
    """Register ``FP32_NORMS_LOAD_FORMAT`` with vLLM's model loaders (once a process; module docstring)."""
    import dataclasses

    from vllm.model_executor.model_loader import DefaultModelLoader, register_model_loader

    @register_model_loader(FP32_NORMS_LOAD_FORMAT)
    class FP32NormsLoader(DefaultModelLoader):
        """vLLM's default loader (load format ``auto``), then the AQN norms held in fp32."""

        def __init__(self, load_config: Any):
            super().__init__(dataclasses.replace(load_config, load_format="auto"))

        def load_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> Any:
            model = super().load_model(vllm_config, model_config, prefix)
            hold_norms_fp32(model)
            return model


if importlib.util.find_spec("vllm") is not None:
    _register_fp32_norms_loader()


def graphs_frozen(vllm_config: Any) -> bool:
    """Whether the model runs compiled or under CUDA graphs (its parameters' dtypes are baked in)."""
    compilation = vllm_config.compilation_config
    mode = getattr(compilation, "mode", 0)
    graphs = getattr(compilation, "cudagraph_mode", None)
    return int(mode or 0) != 0 or (graphs is not None and getattr(graphs, "name", "NONE") != "NONE")


class AQNWorkerExtension:
    """Mixed into vLLM's worker class; method names are prefixed to avoid clashing with it."""

    def _qerl_norm_modules(self) -> dict[str, tuple[int, str, Any]]:
        model = self.get_model()  # type: ignore[attr-defined]  (provided by vLLM's worker)
        return noise_targets(
            (name, module)
            for name, module in model.named_modules()
            if getattr(module, "weight", None) is not None
        )

    def qerl_set_norm_noise(self, sigma: float, seed: int) -> dict[str, float]:
        """Set every layer's norm weights to clean + N(0, sigma^2); returns the realised-noise sums
        (``noise_norm_modules``) and ``graphs_frozen`` (1.0: written in the model's dtype)."""
        frozen = graphs_frozen(self.vllm_config)  # type: ignore[attr-defined]
        state = self.__dict__.setdefault("_qerl_aqn_state", {})
        stats = noise_norm_modules(
            self._qerl_norm_modules(),
            state,
            float(sigma),
            int(seed),
            fp32_weights=not frozen,
            patch_forward=False,  # vLLM's native RMSNorm multiplies in the weight's dtype already
        )
        stats["graphs_frozen"] = float(frozen)
        return stats

    def qerl_norm_weights(self) -> dict[str, list[float]]:
        """The norm weights as the model uses them (for tests: small models only)."""
        return {
            name: module.weight.data.float().cpu().tolist()
            for name, (_, _, module) in self._qerl_norm_modules().items()
        }

    def qerl_norm_dtypes(self) -> dict[str, str]:
        """The dtype of every AQN norm weight (tests: fp32 while noisy on an eager 16-bit engine)."""
        return {name: str(module.weight.dtype) for name, (_, _, module) in self._qerl_norm_modules().items()}

    def qerl_describe_quant(self) -> list[str]:
        """What each linear runs, as ``method[/scheme[/kernel]]`` class names (for the manifest and for
        the engine's check that its FP4 layers run the kernel its mode names)."""
        model = self.get_model()  # type: ignore[attr-defined]
        names = set()
        for module in model.modules():
            method = getattr(module, "quant_method", None)
            if method is not None:
                scheme = getattr(module, "scheme", None)
                parts = [method, scheme, getattr(scheme, "kernel", None)]
                names.add("/".join(type(p).__name__ for p in parts if p is not None))
        return sorted(names)
