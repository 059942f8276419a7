"""The vLLM rollout engine: one in-process ``vllm.LLM`` that lives across RL steps.

- Adapter versions: each new adapter digest gets a new LoRARequest int id (vLLM caches adapters by
  id, so reusing an id would serve the old weights) and the prefix cache is reset.
- AQN: ``collective_rpc("qerl_set_norm_noise", (sigma, seed))`` on every worker through the
  worker extension ``qerl.pipeline.rollout.aqn_vllm.AQNWorkerExtension``, then the prefix cache is reset (KV of
  cached prefixes was computed under the old norm weights). The workers return what they wrote
  and ``set_noise`` returns (and keeps as ``sigma_realised``) the realised sigma; noisy norm
  weights are fp32 on an eager engine, and under compiled graphs on an engine built for AQN
  (``aqn=True``: its norms are fp32 from the load on, ``FP32_NORMS_LOAD_FORMAT``; see there).
- Requests: one request per (prompt, sample) with its own seed (``sample_seed``), prompts passed as
  token ids encoded exactly as the HF engine encodes them, detokenisation done here with the same
  tokenizer call, so the two engines are comparable token for token and string for string.
- Group prefill: vLLM's prefix cache only serves blocks computed in an earlier engine step, and the
  n requests of a GRPO group are scheduled in the same step, so each would prefill the whole prompt.
  With n > 1 every distinct prompt is first prefilled once (a 1-token greedy request, output
  dropped); the group's requests then reuse its full KV blocks and prefill only the partial last
  block. Without it, prefill is most of a CPU rollout batch at GRPO group sizes. On CPU the KV block
  is 32 tokens (``kv_block_size``) instead of vLLM's 128, which is longer than most prompts and so
  would share nothing.
- Logprobs: ``logprobs_mode`` chosen as described in ``qerl.pipeline.rollout.protocol`` (processed_logprobs when
  top-k/top-p are off, raw_logprobs at T = 1, otherwise an error).
- Mode: ``vllm-nvfp4-marlin`` asks vLLM for FP4 Marlin by name (``linear_backend="marlin"``), then
  reads back the scheme and kernel every linear was built with and refuses to call itself that mode
  unless every FP4 layer runs ``MarlinNvFp4LinearKernel``. vLLM's own choice for a weight-only NVFP4
  checkpoint depends on the release and the GPU: 0.26 takes Marlin everywhere, 0.32 (the GPU pin)
  takes Humming on SM90 (H100, H200) and FlashInfer's CuTe-DSL W4A16 on SM100/103 (B200). Marlin is
  what QeRL serves, what the GPU kit measured against the trainer, and what
  ``qerl.pipeline.nvfp4.marlin`` models; another kernel is a different sampler, unmeasured.
- Processes: ``rollout.in_process`` keeps the engine core in this process; otherwise, on CUDA, the
  engine core is spawned, never forked (``VLLM_WORKER_MULTIPROC_METHOD=spawn``): a process that has
  only asked ``torch.cuda.is_available()`` cannot fork a child that uses CUDA, and vLLM spawns on its
  own only once CUDA is initialised.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

from qerl.pipeline.rollout.aqn import check_realised, realised_sigma
from qerl.pipeline.rollout.config import RolloutConfig
from qerl.pipeline.rollout.prompt_encoding import encode_prompt
from qerl.pipeline.rollout.protocol import (
    Completion,
    EngineError,
    SamplingSpec,
    check_adapter_dir,
    sample_seed,
)
from qerl.pipeline.runtime.device import cuda_available
from qerl.pipeline.runtime.threads import restore, snapshot
from qerl.pipeline.schemes import MARLIN_MODE, NF4_CUDA_MODE

log = logging.getLogger("qerl.engines.vllm")

EXTENSION = "qerl.pipeline.rollout.aqn_vllm.AQNWorkerExtension"
MARLIN_KERNEL = "MarlinNvFp4LinearKernel"  # vLLM's weight-only FP4 Marlin linear (0.26 and 0.32)
# vLLM 0.32 would take Humming on SM90 and FlashInfer's CuTe-DSL W4A16 on SM100/103
FP4_MARLIN_ARGS = {"linear_backend": "marlin"}


def logprobs_mode_for(sampling: SamplingSpec) -> str:
    """The vLLM logprobs_mode that records log_softmax(logits / T) for this sampling, or an error.

    Without logprobs (evaluation) nothing is recorded and any sampling is allowed; the mode is then
    the one that is exact for untruncated sampling, and ``generate`` still refuses a later request
    for logprobs that it could not record exactly.
    """
    if not sampling.logprobs or not sampling.truncates:
        return "processed_logprobs"
    if sampling.temperature == 1.0:
        return "raw_logprobs"
    raise EngineError(
        f"temperature {sampling.temperature} with top_p={sampling.top_p}/top_k={sampling.top_k}: vLLM cannot "
        "return log_softmax(logits/T) un-renormalised by top-k/top-p; use temperature 1 or turn top-k/top-p off"
    )


def _compatible(mode: str, sampling: SamplingSpec) -> bool:
    if mode == "processed_logprobs":
        return not sampling.truncates
    return sampling.greedy or sampling.temperature == 1.0


def _shield_llvmlite_from_vllm_scan() -> None:
    """Let an in-process vLLM start in a process that has loaded numba (our NVFP4 CPU kernels).

    vLLM 0.32's CPU start-up rebinds Triton kernels by scanning every module global and calling
    ``vars(value).get(...)`` on anything with a ``__dict__``. llvmlite's ``ffi.lib`` resolves every
    unknown attribute to an LLVM C function, ``__dict__`` included, so the scan crashes. LLVM's C
    API has no dunder names (its functions are ``LLVMPY_*``), so answering AttributeError for
    dunders is exact; everything else still resolves as before.
    """
    ffi = sys.modules.get("llvmlite.binding.ffi")
    if ffi is None:
        return
    cls = type(ffi.lib)
    original = cls.__getattr__
    if getattr(original, "_qerl_shielded", False):
        return

    def __getattr__(self: Any, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return original(self, name)

    __getattr__._qerl_shielded = True  # type: ignore[attr-defined]
    cls.__getattr__ = __getattr__
    log.info("in-process vLLM: llvmlite's ffi.lib no longer resolves dunder names (vLLM scan)")


# vLLM 0.32's own default step budget for LLM() on CPU (EngineArgs); kept when chunked prefill is off
VLLM_CPU_DEFAULT_BATCHED_TOKENS = 4096
# KV block on CPU: the smallest multiple of 32 (vLLM's CPU attention kernel block) so that prompts of
# a few dozen tokens have full blocks for their group to share (vLLM's CPU default is 128)
CPU_KV_BLOCK = 32


def fp32_norms(cfg: RolloutConfig, aqn: bool) -> bool:
    """Whether an engine for ``cfg`` holds its AQN norms in fp32 from the load on: one that will run
    AQN under compiled graphs (an eager engine makes them fp32 at the first noisy step instead)."""
    return aqn and not cfg.enforce_eager


def _aqn_norms(cfg: RolloutConfig, aqn: bool) -> str:
    """How the engine holds AQN's noisy norm weights (its ``info``, so every rollout manifest says)."""
    if fp32_norms(cfg, aqn):
        return "fp32 from load"
    return "fp32 per noisy step" if cfg.enforce_eager else "model dtype (compiled, not built for AQN)"


def linears_error(mode: str, linear_methods: list[str]) -> str | None:
    """Why an engine whose linears run ``linear_methods`` (``method/scheme/kernel`` names, as the
    workers report them) is not ``mode``, or None: in ``vllm-nvfp4-marlin`` there must be an FP4
    scheme, and every FP4 layer must run FP4 Marlin; in ``vllm-nf4-bitsandbytes`` the linears must
    run vLLM's bitsandbytes method."""
    if mode == NF4_CUDA_MODE:
        if any(m.startswith("BitsAndBytes") for m in linear_methods):
            return None
        return f"vLLM on CUDA did not load the NF4 checkpoint's linears with bitsandbytes: {linear_methods}"
    if mode != MARLIN_MODE:
        return None
    fp4 = [m for m in linear_methods if "Fp4" in m or "FP4" in m]
    if not fp4:
        return f"vLLM on CUDA did not load an NVFP4 scheme: {linear_methods}"
    other = [m for m in fp4 if m.rsplit("/", 1)[-1] != MARLIN_KERNEL]
    if other:
        return (
            f"engine mode {mode} needs vLLM's {MARLIN_KERNEL} on every FP4 layer (asked for with "
            f"linear_backend='marlin'), but vLLM {_vllm_version()} built {other}"
        )
    return None


def _llm_kwargs(
    cfg: RolloutConfig,
    model_dir: Path,
    logprobs_mode: str,
    cuda: bool,
    aqn: bool = False,
    fp4_marlin: bool = False,
) -> dict[str, Any]:
    """``vllm.LLM``'s arguments for ``cfg`` on this machine (sets vLLM's multiprocessing switch);
    ``fp4_marlin``: serve the NVFP4 checkpoint on FP4 Marlin whatever vLLM would pick on this GPU."""
    kwargs: dict[str, Any] = {
        "model": str(model_dir),
        "tokenizer": str(model_dir),
        "dtype": cfg.dtype,
        "seed": cfg.seed,
        "max_model_len": cfg.max_model_len,
        "max_num_seqs": cfg.max_num_seqs,
        "enable_prefix_caching": True,
        "enable_lora": cfg.enable_lora,
        "logprobs_mode": logprobs_mode,
        "worker_extension_cls": EXTENSION,
        "enforce_eager": cfg.enforce_eager,
        # checked against the model's heads and the device by qerl.pipeline.planning.run_checks.check_parallelism
        "tensor_parallel_size": cfg.tensor_parallel_size,
    }
    # vLLM reads this switch from the environment only; set it both ways so one in-process
    # engine does not silently turn every later engine in this process in-process too.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if cfg.in_process else "1"
    if cfg.in_process:
        _shield_llvmlite_from_vllm_scan()
        # Engine core and worker in this process: no subprocess re-importing torch and vLLM,
        # which is most of a CPU startup.
        kwargs["distributed_executor_backend"] = "uni"
        log.info("vLLM engine in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0, uni executor, no thread binding)")
    elif cuda:
        # torch.cuda.is_available() alone arms torch's fork guard without initialising CUDA, and
        # vLLM forces spawn only once CUDA is initialised: it would fork an engine core that then
        # fails with "Cannot re-initialize CUDA in forked subprocess".
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
        log.info("vLLM engine core in a spawned process (VLLM_WORKER_MULTIPROC_METHOD=spawn)")
    else:
        log.info(
            "vLLM engine in worker processes: VLLM_CPU_OMP_THREADS_BIND=%s pins the worker's OpenMP "
            "threads ('auto': one NUMA node, one core left to the engine process); this process's "
            "threads keep their affinity",
            os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
        )
    if fp4_marlin:
        kwargs.update(FP4_MARLIN_ARGS)
    if cfg.kv_block_size or not cuda:
        kwargs["block_size"] = cfg.kv_block_size or CPU_KV_BLOCK
    if cfg.enable_lora:
        kwargs.update(max_loras=1, max_lora_rank=cfg.max_lora_rank)
    if cfg.enforce_eager:
        kwargs["compilation_config"] = {"mode": 0}  # no torch.compile: a fast startup
    if fp32_norms(cfg, aqn):
        from qerl.pipeline.rollout.aqn_vllm import fp32_norms_engine_args  # registers the loader here

        kwargs.update(fp32_norms_engine_args())
    kwargs.update(_memory_kwargs(cfg, cuda))
    return kwargs


def _memory_kwargs(cfg: RolloutConfig, cuda: bool) -> dict[str, Any]:
    """The KV cache and step-budget arguments: a share of the GPU, or a fixed CPU cache."""
    if cuda:
        kwargs: dict[str, Any] = {"gpu_memory_utilization": cfg.gpu_memory_utilization}
        if cfg.max_num_batched_tokens:
            kwargs["max_num_batched_tokens"] = cfg.max_num_batched_tokens
        return kwargs
    kwargs = {"kv_cache_memory_bytes": int(cfg.kv_cache_gib * (1 << 30))}
    # Every request is seeded. When chunked prefill splits a prompt, vLLM discards that
    # step's sample and rewinds the request's generator by its offset, which only CUDA
    # (Philox) generators have: on CPU the engine dies with "CPU Generator does not use
    # offset" as soon as a batch's prompts exceed one step's token budget. So prompts are
    # never split on CPU; a step takes whole prompts up to the budget.
    kwargs["enable_chunked_prefill"] = False
    kwargs["max_num_batched_tokens"] = max(
        cfg.max_model_len, cfg.max_num_batched_tokens or VLLM_CPU_DEFAULT_BATCHED_TOKENS
    )
    log.info(
        "vLLM on CPU: chunked prefill off (seeded CPU generators cannot rewind), max_num_batched_tokens=%d",
        kwargs["max_num_batched_tokens"],
    )
    if os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        log.info("VLLM_CPU_KVCACHE_SPACE=%s GiB overrides kv_cache_gib", os.environ["VLLM_CPU_KVCACHE_SPACE"])
    return kwargs


class VLLMEngine:
    """``vllm.LLM`` + LoRARequest per adapter version + AQN via the worker extension."""

    def __init__(self, cfg: RolloutConfig, model_dir: Path, mode: str, aqn: bool = False):
        # vLLM's import and start write this process's environment (LD_PRELOAD, NUMEXPR_MAX_THREADS,
        # ... meant for its own processes) and, in-process, replace torch.set_num_threads with a
        # no-op: all put back once it is up, so the trainer and later child processes keep their own
        # thread settings (qerl.pipeline.runtime.threads)
        threads_before = snapshot()
        from transformers import AutoTokenizer
        from vllm import LLM

        self.cfg, self.mode, self.model_dir = cfg, mode, Path(model_dir)
        self.logprobs_mode = logprobs_mode_for(cfg.sampling())
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        marlin = mode == MARLIN_MODE
        kwargs = _llm_kwargs(cfg, self.model_dir, self.logprobs_mode, cuda_available(), aqn, marlin)
        if mode == NF4_CUDA_MODE:  # the NF4 checkpoint through vLLM's bitsandbytes linears
            kwargs["quantization"] = "bitsandbytes"
        try:
            self.llm = LLM(**kwargs)
        finally:
            restore(threads_before, "vLLM engine start")
        self.block_size = self.llm.llm_engine.vllm_config.cache_config.block_size
        self.last_prefix_stats: dict[str, int] = {}
        self._lora_ids: dict[str, int] = {}
        self._lora: Any = None
        self.sigma, self.noise_seed, self.sigma_realised = 0.0, 0, 0.0
        self._warned_frozen = False
        schemes = sorted(set().union(*self.llm.collective_rpc("qerl_describe_quant")))
        self.info: dict[str, Any] = {
            "model_dir": str(self.model_dir),
            "logprobs_mode": self.logprobs_mode,
            "linear_methods": schemes,
            "vllm_version": _vllm_version(),
            "dtype": str(self.llm.llm_engine.vllm_config.model_config.dtype),
            "built_for_aqn": aqn,
            "aqn_norms": _aqn_norms(cfg, aqn),
        }
        problem = linears_error(mode, schemes)
        if problem:
            self.close()
            raise EngineError(f"{problem} ({self.model_dir})")
        log.info("vLLM engine up: mode=%s logprobs_mode=%s linear=%s", mode, self.logprobs_mode, schemes)

    def set_adapter(self, path: Path | None, digest: str | None) -> None:
        from vllm.lora.request import LoRARequest

        if path is None:
            if self._lora is not None:
                self.llm.reset_prefix_cache()
            self._lora = None
            return
        if not self.cfg.enable_lora:
            raise EngineError(f"adapter {path} given but the engine was built with enable_lora=False")
        if not digest:
            raise EngineError(f"adapter {path} given without its digest")
        if self._lora is not None and self._lora.lora_name == f"qerl-{digest[:16]}":
            return
        check_adapter_dir(Path(path))
        if digest not in self._lora_ids:
            self._lora_ids[digest] = len(self._lora_ids) + 1  # ids start at 1; a new one per version
        self._lora = LoRARequest(f"qerl-{digest[:16]}", self._lora_ids[digest], str(path))
        self.llm.reset_prefix_cache()
        log.info("vLLM engine: adapter %s -> lora id %d", digest[:12], self._lora_ids[digest])

    def set_noise(self, sigma: float, seed: int) -> float:
        """AQN on every worker; returns the realised sigma over all workers' norm weights."""
        stats = self.llm.collective_rpc("qerl_set_norm_noise", args=(float(sigma), int(seed)))
        if not stats or min(s["weights"] for s in stats) <= 0:
            raise EngineError(f"AQN reached no norm weights on the vLLM workers ({stats})")
        if not self.llm.reset_prefix_cache():
            raise EngineError("vLLM refused to reset its prefix cache after AQN")
        self.sigma, self.noise_seed = float(sigma), int(seed)
        self.sigma_realised = realised_sigma(stats)
        # compiled graphs on a 16-bit model: the noisy weights could not become fp32 (aqn_vllm)
        if sigma > 0 and any(s["graphs_frozen"] and not s["fp32"] for s in stats) and not self._warned_frozen:
            self._warned_frozen = True
            log.warning(
                "vLLM engine with compiled graphs (enforce_eager: false) not built for AQN: it writes "
                "the noisy norm weights in the model's dtype %s, where small sigmas round away; see the "
                "realised sigma (an engine built with aqn=True, or rollout.enforce_eager: true, keeps "
                "them in fp32 and exact)",
                self.info.get("dtype"),
            )
        check_realised(
            float(sigma), self.sigma_realised, f"vLLM engine ({self.mode})", sum(s["channels"] for s in stats)
        )
        log.debug(
            "vLLM engine: AQN sigma=%g (realised %.4g) seed=%d on %s norm weights per worker",
            sigma,
            self.sigma_realised,
            seed,
            [int(s["weights"]) for s in stats],
        )
        return self.sigma_realised

    def norm_weights(self) -> dict[str, list[float]]:
        """The norm weights as worker 0 holds them (tests)."""
        return self.llm.collective_rpc("qerl_norm_weights")[0]

    def norm_dtypes(self) -> dict[str, str]:
        """The norm weights' dtypes on worker 0 (tests)."""
        return self.llm.collective_rpc("qerl_norm_dtypes")[0]

    def generate(
        self, prompts: list[str], n: int, sampling: SamplingSpec, seed: int
    ) -> list[list[Completion]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if sampling.logprobs and not _compatible(self.logprobs_mode, sampling):
            raise EngineError(
                f"engine built with logprobs_mode={self.logprobs_mode} cannot record log_softmax(logits/T) "
                f"for {sampling}; build the engine with this sampling"
            )
        encoded = [encode_prompt(self.tokenizer, p) for p in prompts]
        for i, ids in enumerate(encoded):
            if len(ids) + sampling.max_new_tokens > self.cfg.max_model_len:
                raise EngineError(
                    f"prompt {i} has {len(ids)} tokens: with max_new_tokens {sampling.max_new_tokens} it "
                    f"exceeds max_model_len {self.cfg.max_model_len}"
                )
        requests, params = [], []
        for i, ids in enumerate(encoded):
            for j in range(n):
                requests.append(TokensPrompt(prompt_token_ids=ids))
                params.append(
                    SamplingParams(
                        n=1,
                        temperature=sampling.temperature,
                        top_p=sampling.top_p,
                        top_k=max(sampling.top_k, 0),
                        max_tokens=sampling.max_new_tokens,
                        seed=sample_seed(seed, i, j),
                        logprobs=0 if sampling.logprobs else None,
                        detokenize=False,
                    )
                )
        if n > 1:
            self._prefill_prompts_once(encoded)
        outputs = self.llm.generate(requests, params, use_tqdm=False, lora_request=self._lora)
        self.last_prefix_stats = {
            "prompt_tokens": sum(len(r["prompt_token_ids"]) for r in requests),
            "cached_prompt_tokens": sum(out.num_cached_tokens or 0 for out in outputs),
        }
        log.info("vLLM generate: %d requests, prefix cache %s", len(requests), self.last_prefix_stats)
        results: list[list[Completion]] = [[] for _ in prompts]
        for k, out in enumerate(outputs):
            i = k // n
            results[i].append(self._completion(encoded[i], out.outputs[0], k, sampling.logprobs))
        return results

    def _prefill_prompts_once(self, encoded: list[list[int]]) -> None:
        """Prefill each distinct prompt with a full KV block once, so its group's requests reuse it."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        distinct = list(dict.fromkeys(tuple(ids) for ids in encoded if len(ids) >= self.block_size))
        if distinct:
            self.llm.generate(
                [TokensPrompt(prompt_token_ids=list(ids)) for ids in distinct],
                SamplingParams(max_tokens=1, temperature=0.0, detokenize=False),
                use_tqdm=False,
                lora_request=self._lora,
            )

    def _completion(
        self, prompt_ids: list[int], output: Any, k: int, want_logprobs: bool = True
    ) -> Completion:
        tokens = list(output.token_ids)
        if output.finish_reason not in ("stop", "length"):
            raise EngineError(f"request {k} finished with {output.finish_reason!r}")
        if not want_logprobs:  # evaluation: not requested, recorded as NaN so nothing can use them
            logprobs = [float("nan")] * len(tokens)
        elif output.logprobs is None or len(output.logprobs) != len(tokens):
            raise EngineError(
                f"request {k}: vLLM returned logprobs for {len(output.logprobs or [])} of {len(tokens)} tokens"
            )
        else:
            logprobs = [float(step[tok].logprob) for step, tok in zip(output.logprobs, tokens, strict=True)]
        return Completion(
            prompt_ids=list(prompt_ids),
            completion_ids=tokens,
            completion_text=self.tokenizer.decode(tokens, skip_special_tokens=True),
            logprobs=logprobs,
            finish_reason=output.finish_reason,
        )

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            shutdown = getattr(llm.llm_engine, "shutdown", None)
            if callable(shutdown):
                shutdown()
            del llm
            if self.cfg.in_process:
                # the in-process worker's gloo groups keep dozens of threads polling in this process
                # after shutdown; the trainer's threads would share the cores with them
                from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

                cleanup_dist_env_and_memory()
                log.info("in-process vLLM closed: distributed groups destroyed")


def _vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")
