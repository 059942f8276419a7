"""AQN inside vLLM: a worker extension that rewrites the RMSNorm weights on every worker.

vLLM builds its workers (in the engine-core process, one per tensor/pipeline rank) from a class
name, so the code that touches the weights must live in an importable module: this one. It is
mixed into vLLM's worker class with ``LLM(..., worker_extension_cls="qerl.pipeline.rollout.aqn_vllm.
AQNWorkerExtension")`` and called with ``llm.collective_rpc("qerl_set_norm_noise", args=(sigma,
seed))``. The noise itself comes from ``qerl.pipeline.rollout.aqn`` (same seeds, same draws as the HF engine).

vLLM's norms are its own ``RMSNorm`` modules named ``model.layers.N.input_layernorm``; their
``weight`` is replicated (not sharded) under tensor parallelism, so every rank writes the full
vector, and under pipeline parallelism each rank only holds (and noises) its own layers, whose
global index is in the name. ``param.data`` is edited in place, so captured graphs and compiled
code see the new values. The caller must reset the prefix cache afterwards (KV computed under
the old weights is stale). The clean copy is taken once per worker: the engine never reloads its
base weights (a new adapter is a LoRARequest, not a weight reload), so it cannot go stale.
"""

from __future__ import annotations

from qerl.pipeline.rollout.aqn import apply_norm_noise, noise_targets

__all__ = ["AQNWorkerExtension"]


class AQNWorkerExtension:
    """Mixed into vLLM's worker class; method names are prefixed to avoid clashing with it."""

    def qerl_set_norm_noise(self, sigma: float, seed: int) -> int:
        """Set every layer's norm weights to clean + N(0, sigma^2); returns how many were written."""
        model = self.get_model()  # type: ignore[attr-defined]  (provided by vLLM's worker)
        clean = self.__dict__.setdefault("_qerl_clean_norms", {})
        targets = noise_targets(
            (name, module.weight.data)
            for name, module in model.named_modules()
            if getattr(module, "weight", None) is not None
        )
        return apply_norm_noise(targets, clean, float(sigma), int(seed))

    def qerl_norm_weights(self) -> dict[str, list[float]]:
        """The current norm weights (for tests: small models only)."""
        model = self.get_model()  # type: ignore[attr-defined]
        targets = noise_targets(
            (name, module.weight.data)
            for name, module in model.named_modules()
            if getattr(module, "weight", None) is not None
        )
        return {name: w.float().cpu().tolist() for name, (_, _, w) in targets.items()}

    def qerl_describe_quant(self) -> list[str]:
        """Class names of the linear methods / quantization schemes the model runs (for the manifest)."""
        model = self.get_model()  # type: ignore[attr-defined]
        names = set()
        for module in model.modules():
            method = getattr(module, "quant_method", None)
            if method is not None:
                scheme = getattr(module, "scheme", None)
                names.add(type(method).__name__ + (f"/{type(scheme).__name__}" if scheme is not None else ""))
        return sorted(names)
