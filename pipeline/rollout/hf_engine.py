"""The transformers ``generate`` rollout engine: the reference the vLLM engine is tested against.

It runs the dequantized twin (mode ``hf-nvfp4-emulated``) with the LoRA adapter applied by peft and
AQN applied to the norm weights by ``qerl.pipeline.rollout.aqn.noise_hf_model`` (same noise as vLLM's;
while noisy the norm weights are fp32 and the norms multiply in fp32, so a bf16 model gets the noise
drawn, not its bf16 rounding).
Sampling goes through ``generate`` itself (its temperature/top-k/top-p warpers); the recorded
logprob is recomputed from the raw logits ``generate`` returns as ``log_softmax(logits / T)`` at the
sampled token (see ``qerl.pipeline.rollout.protocol`` for why this and not the warped distribution).

Batches are left-padded (the only padding that decoder-only generation supports); a row stops at
its first EOS, which is kept in the completion together with its logprob (the policy chose to
stop, so training needs that token). Slow on CPU: it is a reference and a fallback, not the path
the pipeline is meant to run on.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

import torch
from qerl.pipeline.rollout.aqn import check_realised, noise_hf_model, realised_sigma
from qerl.pipeline.rollout.config import RolloutConfig
from qerl.pipeline.rollout.prompt_encoding import encode_prompt, eos_token_ids
from qerl.pipeline.rollout.protocol import (
    Completion,
    EngineError,
    SamplingSpec,
    check_adapter_dir,
    sample_seed,
)

log = logging.getLogger("qerl.engines.hf")

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class HFEngine:
    """transformers generate + peft LoRA + AQN on the norm weights."""

    def __init__(self, cfg: RolloutConfig, model_dir: Path, mode: str = "hf-nvfp4-emulated"):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.cfg, self.mode, self.model_dir = cfg, mode, Path(model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        dtype: Any = "auto" if cfg.dtype == "auto" else _DTYPES[cfg.dtype]
        from qerl.pipeline.runtime.device import default_device

        # on the GPU where there is one: transformers' from_pretrained alone loads onto the CPU
        self.device = default_device()
        self.base = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=dtype).to(self.device).eval()
        self.eos_ids = eos_token_ids(self.model_dir, self.tokenizer)
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.eos_ids[0]
        self._peft: Any = None
        self._adapter: str | None = None  # active adapter name, None = base model
        self.sigma, self.noise_seed, self.sigma_realised = 0.0, 0, 0.0
        self.info: dict[str, Any] = {
            "model_dir": str(self.model_dir),
            "dtype": str(self.base.dtype),
            "device": self.device,
        }

    # adapter / noise --------------------------------------------------------------------------
    def set_adapter(self, path: Path | None, digest: str | None) -> None:
        if path is None:
            self._adapter = None
            return
        if not digest:
            raise EngineError(f"adapter {path} given without its digest")
        name = f"a{digest[:16]}"
        if name == self._adapter:
            return
        check_adapter_dir(Path(path))
        from peft import PeftModel

        if self._peft is None:
            self._peft = PeftModel.from_pretrained(
                self.base, str(path), adapter_name=name, is_trainable=False
            )
        elif name not in self._peft.peft_config:
            self._peft.load_adapter(str(path), adapter_name=name, is_trainable=False)
        self._peft.set_adapter(name)
        # Drop the other versions: one adapter at a time, as in vLLM with max_loras=1.
        for old in [a for a in self._peft.peft_config if a != name]:
            self._peft.delete_adapter(old)
        self._peft.eval()
        self._adapter = name
        log.info("HF engine: adapter %s (%s) active", digest[:12], path)

    def set_noise(self, sigma: float, seed: int) -> float:
        """AQN on the norm weights (fp32 while noisy); returns the realised sigma."""
        stats = noise_hf_model(self.base, float(sigma), int(seed))
        self.sigma, self.noise_seed = float(sigma), int(seed)
        self.sigma_realised = realised_sigma([stats])
        check_realised(self.sigma, self.sigma_realised, f"HF engine ({self.mode})", stats["channels"])
        log.debug(
            "HF engine: AQN sigma=%g (realised %.4g) seed=%d on %d norm weights",
            sigma,
            self.sigma_realised,
            seed,
            int(stats["weights"]),
        )
        return self.sigma_realised

    def _model(self) -> tuple[Any, contextlib.AbstractContextManager]:
        if self._peft is None:
            return self.base, contextlib.nullcontext()
        if self._adapter is None:
            return self._peft, self._peft.disable_adapter()
        return self._peft, contextlib.nullcontext()

    # generation -------------------------------------------------------------------------------
    def generate(
        self, prompts: list[str], n: int, sampling: SamplingSpec, seed: int
    ) -> list[list[Completion]]:
        encoded = [encode_prompt(self.tokenizer, p) for p in prompts]
        jobs = [(i, j) for i in range(len(prompts)) for j in range(n)]
        results: list[list[Completion | None]] = [[None] * n for _ in prompts]
        size = self.cfg.hf_batch_size
        for b in range(0, len(jobs), size):
            batch = jobs[b : b + size]
            # No per-request generator in generate: seed the (forked) global RNG per batch; on a GPU
            # the CUDA generator samples, so it is forked too (manual_seed reseeds every device).
            cuda_rng = [torch.cuda.current_device()] if self.device == "cuda" else []
            with torch.random.fork_rng(devices=cuda_rng):
                torch.manual_seed(sample_seed(seed, b // size, -1))
                outs = self._generate_batch([encoded[i] for i, _ in batch], sampling)
            for (i, j), completion in zip(batch, outs, strict=True):
                results[i][j] = completion
        return [[c for c in row if c is not None] for row in results]

    def _generate_batch(self, prompt_ids: list[list[int]], sampling: SamplingSpec) -> list[Completion]:
        from transformers import GenerationConfig

        width = max(len(p) for p in prompt_ids)
        input_ids = torch.full((len(prompt_ids), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros_like(input_ids)
        for row, ids in enumerate(prompt_ids):
            input_ids[row, width - len(ids) :] = torch.tensor(ids)
            attention[row, width - len(ids) :] = 1
        warpers = (
            {}
            if sampling.greedy
            else {
                "temperature": sampling.temperature,
                "top_p": sampling.top_p,
                "top_k": max(sampling.top_k, 0),
            }
        )
        gen_cfg = GenerationConfig(
            do_sample=not sampling.greedy,
            **warpers,
            max_new_tokens=sampling.max_new_tokens,
            eos_token_id=self.eos_ids,
            pad_token_id=self.pad_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
        model, context = self._model()
        with torch.inference_mode(), context:
            out = model.generate(
                input_ids=input_ids.to(self.device),
                attention_mask=attention.to(self.device),
                generation_config=gen_cfg,
            )
        generated = out.sequences[:, width:]
        temperature = 1.0 if sampling.greedy else sampling.temperature
        logits = torch.stack(out.logits, dim=1).float()  # [B, L, V], before any warper
        logprobs = torch.log_softmax(logits / temperature, dim=-1)
        chosen = logprobs.gather(-1, generated.unsqueeze(-1)).squeeze(-1)
        completions = []
        for row, ids in enumerate(prompt_ids):
            tokens = generated[row].tolist()
            stop = next((k for k, t in enumerate(tokens) if t in self.eos_ids), None)
            length = len(tokens) if stop is None else stop + 1
            tokens = tokens[:length]
            completions.append(
                Completion(
                    prompt_ids=list(ids),
                    completion_ids=tokens,
                    completion_text=self.tokenizer.decode(tokens, skip_special_tokens=True),
                    logprobs=chosen[row, :length].tolist(),
                    finish_reason="stop" if stop is not None else "length",
                )
            )
        return completions

    def close(self) -> None:
        self._peft = None
        self.base = None
