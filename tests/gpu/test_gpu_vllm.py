"""vLLM on the GPU (issue 23): the engine mode ``vllm-nvfp4-marlin``.

These tests run against vLLM 0.26.0, the release a GPU install gets (requirements/gpu.txt) and the
maintainers' transfer tools (tools/gpu_transfer/) carry (the CPU environment has 0.32; where the two APIs differ, they follow 0.26); what they
measured is in BENCHMARKS.md's GPU kit section. They are marked ``gpu`` and skip, with the reason,
without CUDA or without an importable vLLM. On a GPU machine, ``scripts/gpu/gpu_validate.sh`` runs
them through ``scripts/gpu/gpu_check.sh`` (``--vllm-only`` runs the vLLM files alone); a machine
without network installs the same set from a wheelhouse (docs/guide/gpu-offline.md).

The model: Qwen2-shaped with random weights, built there by ``build_tiny_model`` (no download), sized
for FP4 Marlin's tiles (every projection's output a multiple of 64 and input a multiple of 128:
hidden 512, 8 heads of 64, 2 KV heads, intermediate 1024, 2 layers) and FA3 (head size 64), and
quantized by the quantize stage on the GPU (Triton) into the compressed-tensors NVFP4A16 layout.

Checked, on one engine built by the project's factory (``build_engine``) with CUDA graphs on and LoRA
enabled, in-process (the worker is reachable through ``collective_rpc``):
- vLLM chose the compressed-tensors W4A16 FP4 scheme (``CompressedTensorsW4A4Fp4`` with ``use_a16``)
  on the Marlin kernel, not the emulation; CUDA graphs are on; attention is FlashAttention 3 (FA2 is
  not in the bundle);
- one LoRA adapter (the trainer's, with non-zero B) served through a LoRARequest changes the
  outputs, and dropping it gives back the base outputs exactly;
- AQN on an engine not built for it: ``set_noise`` writes clean + the noise
  ``qerl.pipeline.rollout.aqn`` draws (the same numbers the HF engine and the trainer get), rounded
  once to bf16, into the captured model, the logprobs move, and sigma 0 restores them bit for bit
  (an engine built for AQN, as a run with AQN builds it, is ``tests/gpu/test_gpu_vllm_aqn.py``'s: kept
  apart, so that a failure of its fp32 norms under CUDA graphs cannot take these checks with it);
- the sampler/trainer gap: mean |Δlogp| and the k3 KL between vLLM's Marlin logprobs and the Triton
  trainer's on the same sampled completions, recorded ($OUT/vllm-gap.json when OUT is set) and bounded;
  with AQN on, vLLM's noisy logprobs must sit as close to the trainer given the same noise as the clean
  ones do to the clean trainer (so the graphs replay the noised weights, by the realised amount).

Not here: tokens/s of Marlin NVFP4 vs bf16, and ``qerl plan``'s vLLM rows against what vLLM
reports, are ``benchmarks/bench_vllm.py``'s (the kit's third part).
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

CUDA = torch.cuda.is_available()
SIZES = {"hidden_size": 512, "num_heads": 8, "num_kv_heads": 2, "intermediate_size": 1024, "num_layers": 2}
PROMPTS = ["1 + 2 =", "What is 7 - 3?", "Name a colour.", "Count to five:"]
DIGEST = "ab" * 32  # the adapter's version (any 64 hex digits)
# the engine's RolloutConfig (tools/gpu_transfer/gpu_replica_check.py starts the same one on the CPU replica)
ENGINE = dict(
    engine="vllm",
    temperature=1.0,
    max_new_tokens=16,
    max_model_len=256,
    dtype="bfloat16",
    enable_lora=True,
    max_lora_rank=8,
    enforce_eager=False,  # CUDA graphs (and torch.compile) on, as in a run
    in_process=True,  # the worker lives here: collective_rpc can take a function
    gpu_memory_utilization=0.3,
    max_num_seqs=16,
)

# The sampler/trainer gap bound (per token, nats). Both sides hold the same NVFP4 weights and the same
# LoRA; they differ in bf16 activation rounding (2^-8 relative), accumulation order (Marlin vs our
# Triton dequant + GEMM, FA3 vs SDPA) and the LoRA kernels (punica vs peft, both bf16). On logits of
# order 1 (random weights, std 0.05) that is a few 1e-3 per logit, so per-token |Δlogp| of order 1e-2;
# k3 ~ E[Δ²]/2 ~ 1e-4. The bounds leave a 5x margin; the measured values are what matters (recorded).
MEAN_ABS_BOUND = 0.05
K3_BOUND = 2e-3


def _skip_unless_vllm_on_cuda() -> None:
    if not CUDA:
        pytest.skip("needs a CUDA GPU: run `bash scripts/gpu/gpu_validate.sh` on one")
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        pytest.fail("TRITON_INTERPRET=0 is needed: run the gpu tests through scripts/gpu/gpu_check.sh")
    if importlib.util.find_spec("vllm") is None:
        # what the caller that prepared the environment said of it (gpu_check.sh's QERL_GPU_ENV_NOTE)
        note = os.environ.get("QERL_GPU_ENV_NOTE", "").split("\n")[0]
        pytest.skip(
            f"vLLM is not importable here: {note or 'requirements/gpu.txt has it (QERL_ENV=gpu make venv)'}"
        )


def kit_dir(tmp_path_factory, name: str) -> Path:
    """A folder the kit's vLLM modules share when gpu_check.sh names one (``$QERL_GPU_KIT_DIR``), else a
    fresh one. Shared, the AQN module's engine serves the very checkpoint (same path, a cache hit in
    the same store) that this module's plain engine served, as a run with AQN after ``qerl eval`` does,
    with vLLM's compile cache in between (``qerl.pipeline.rollout.aqn_vllm``)."""
    shared = os.environ.get("QERL_GPU_KIT_DIR")
    if not shared:
        return tmp_path_factory.mktemp(name)
    path = Path(shared) / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def kit_checkpoint(
    tmp_path_factory, name: str = "marlin-qwen2", arch: str = "qwen2", sizes: dict | None = None
):
    """A kit model (default: the Marlin-sized Qwen2 model), quantized by the quantize stage (on the GPU
    where there is one)."""
    from qerl.pipeline.demo.tiny_model import build_tiny_model
    from qerl.pipeline.nvfp4.recipe import QuantizeConfig
    from qerl.pipeline.store.artifact_store import ArtifactStore
    from qerl.stages.quantize import run as quantize

    base = kit_dir(tmp_path_factory, name)
    if not (base / "kit-built").is_file():  # built by the other module's process (complete: the marker)
        build_tiny_model(base, arch=arch, norm_jitter=0.05, **(sizes or SIZES))
        (base / "kit-built").write_text("")
    return quantize(QuantizeConfig(), str(base), ArtifactStore(kit_dir(tmp_path_factory, "vllm-store")))


def lora_trainer(base, tmp_path_factory, device: str = "cuda"):
    """The Triton trainer on checkpoint ``base`` (a manifest), with a LoRA whose B is non-zero; the
    state and its adapter dir."""
    from qerl.pipeline.rl.policy import init_state
    from qerl.pipeline.rl.train_config import TrainConfig

    cfg = TrainConfig(lora_r=8, lora_alpha=16, seed=7)
    state = init_state(base.dir, cfg, device=device)
    assert state.base_format == "nvfp4"
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in state.model.named_parameters():
            if p.requires_grad and "lora_B" in name:
                p.normal_(0, 0.05, generator=gen)
    adapter = tmp_path_factory.mktemp("adapter") / "adapter"
    state.model.save_pretrained(adapter)
    state.model.eval()
    return state, adapter


@pytest.fixture(scope="module")
def marlin_base(tmp_path_factory):
    """The kit's checkpoint, quantized on the GPU: its manifest."""
    _skip_unless_vllm_on_cuda()
    manifest = kit_checkpoint(tmp_path_factory)
    qcfg = json.loads((manifest.dir / "config.json").read_text())["quantization_config"]
    assert qcfg["format"] == "nvfp4-pack-quantized"
    assert all(g.get("input_activations") is None for g in qcfg["config_groups"].values()), "W4A16"
    return manifest


@pytest.fixture(scope="module")
def trainer(marlin_base, tmp_path_factory):
    """The Triton trainer on the same checkpoint, with a LoRA whose B is non-zero; its adapter dir."""
    return lora_trainer(marlin_base, tmp_path_factory)


@pytest.fixture(scope="module")
def engine(marlin_base):
    from qerl.pipeline.rollout.config import RolloutConfig
    from qerl.pipeline.rollout.factory import build_engine

    eng = build_engine(RolloutConfig(**ENGINE), marlin_base, None)
    shared = os.environ.get("QERL_GPU_KIT_DIR")
    if shared:  # what the AQN module's engine on the same checkpoint must not share (its compile cache)
        from qerl.pipeline.store.files import atomic_write_json

        vcfg = eng.llm.llm_engine.vllm_config
        record = {"model": vcfg.model_config.model, "config_hash": vcfg.compute_hash()}
        atomic_write_json(Path(shared) / "plain-engine.json", record)
    yield eng
    eng.close()


def _probe(worker) -> dict:  # runs on the vLLM worker (in-process)
    from vllm.v1.attention.backends.fa_utils import get_flash_attn_version

    model = worker.get_model()
    schemes, kernels, a16, backends = set(), set(), set(), set()
    for module in model.modules():
        scheme = getattr(module, "scheme", None)
        if scheme is not None:
            schemes.add(type(scheme).__name__)
            kernels.add(type(getattr(scheme, "kernel", None)).__name__)
            a16.add(bool(getattr(scheme, "use_a16", False)))
        backend = getattr(module, "attn_backend", None)
        if backend is not None:
            backends.add(backend.get_name())
    return {
        "schemes": sorted(schemes),
        "kernels": sorted(kernels),
        "use_a16": sorted(a16),
        "attn_backends": sorted(backends),
        "fa_version": get_flash_attn_version(),
        # V2 (vllm.v1.worker.gpu) is what vLLM 0.26 chose on the CPU replica of the image
        "model_runner": type(getattr(worker, "model_runner", None)).__module__,
    }


def _greedy(engine):
    from qerl.pipeline.rollout.protocol import SamplingSpec

    spec = SamplingSpec(temperature=0.0, max_new_tokens=16)
    rows = engine.generate(PROMPTS, 1, spec, seed=0)
    return [c.completion_ids for row in rows for c in row], [c.logprobs for row in rows for c in row]


def test_engine_serves_nvfp4_through_fp4_marlin_with_cuda_graphs(engine):
    from vllm.config import CUDAGraphMode

    assert engine.mode == "vllm-nvfp4-marlin"
    info = engine.llm.collective_rpc(_probe)[0]
    assert info["schemes"] == ["CompressedTensorsW4A4Fp4"], info
    assert info["use_a16"] == [True], info  # W4A16: weight-only FP4
    assert info["kernels"] == ["MarlinNvFp4LinearKernel"], info  # not EmulationNvFp4LinearKernel
    assert info["attn_backends"] == ["FLASH_ATTN"] and info["fa_version"] == 3, info
    vcfg = engine.llm.llm_engine.vllm_config
    assert not vcfg.model_config.enforce_eager
    assert vcfg.compilation_config.cudagraph_mode != CUDAGraphMode.NONE
    assert vcfg.compilation_config.cudagraph_capture_sizes, "no CUDA graph was captured"
    print(f"vLLM engine: {info}, cudagraph_mode={vcfg.compilation_config.cudagraph_mode}")


def test_a_lora_request_changes_the_outputs_and_dropping_it_restores_them(engine, trainer):
    _, adapter = trainer
    engine.set_adapter(None, None)
    base_ids, base_lp = _greedy(engine)
    engine.set_adapter(adapter, DIGEST)
    lora_ids, lora_lp = _greedy(engine)
    engine.set_adapter(None, None)
    again_ids, again_lp = _greedy(engine)
    first_moved = [abs(a[0] - b[0]) for a, b in zip(base_lp, lora_lp, strict=True) if a and b]
    assert lora_ids != base_ids or max(first_moved) > 1e-2, (first_moved, base_ids, lora_ids)
    assert again_ids == base_ids and again_lp == base_lp


def test_aqn_moves_the_logprobs_under_cuda_graphs_and_sigma_zero_restores_them(engine):
    import re

    from qerl.pipeline.rollout.aqn import layer_noise

    engine.set_adapter(None, None)
    clean = engine.norm_weights()
    base_ids, base_lp = _greedy(engine)
    sigma, seed = 0.05, 11
    engine.set_noise(sigma, seed)
    noisy = engine.norm_weights()
    noisy_ids, noisy_lp = _greedy(engine)
    engine.set_noise(0.0, seed)
    back_ids, back_lp = _greedy(engine)
    # the realised weights are clean + the noise qerl.pipeline.rollout.aqn draws for (seed, layer),
    # added in fp32 and rounded once to the model's dtype (the engine was not built for AQN)
    assert len(noisy) == 2 * SIZES["num_layers"]
    for name, w in noisy.items():
        layer, kind = re.search(r"layers\.(\d+)\.(\w+)$", name).groups()
        z = layer_noise(seed, int(layer), SIZES["hidden_size"], sigma)[kind]
        want = (torch.tensor(clean[name]) + z).to(torch.bfloat16).float()
        assert torch.equal(torch.tensor(w), want), name
    moved = [abs(x[0] - y[0]) for x, y in zip(base_lp, noisy_lp, strict=True) if x and y]
    assert noisy_ids != base_ids or max(moved) > 1e-3, moved
    assert back_ids == base_ids and back_lp == base_lp, "sigma 0 must restore the clean model exactly"


def record_gap(key: str, record: dict) -> None:
    """Add ``record`` under ``key`` to $OUT/vllm-gap.json (when OUT is set), beside this module's own
    record: the device tool brings back at most 8 files."""
    out = os.environ.get("OUT")
    if out:
        path = Path(out) / "vllm-gap.json"
        merged = json.loads(path.read_text()) if path.is_file() else {}
        path.write_text(json.dumps({**merged, key: record}, indent=1) + "\n")


def _gap(engine, state, sigma: float) -> dict:
    """vLLM samples (T = 1, logprobs on) with the adapter; the trainer scores the same tokens."""
    from qerl.pipeline.rl.batch import RolloutBatch, collate
    from qerl.pipeline.rl.logprobs import completion_logprobs
    from qerl.pipeline.rollout.aqn import apply_to_hf_model
    from qerl.pipeline.rollout.protocol import SamplingSpec

    rows = engine.generate(PROMPTS, 4, SamplingSpec(temperature=1.0, max_new_tokens=16), seed=3)
    comps = [c for row in rows for c in row if c.completion_ids]
    batch = RolloutBatch(
        prompt_ids=[c.prompt_ids for c in comps],
        completion_ids=[c.completion_ids for c in comps],
        sampler_logprobs=[c.logprobs for c in comps],
        truncated=[c.finish_reason == "length" for c in comps],
        rewards=[0.0] * len(comps),
        group_ids=list(range(len(comps))),
    )
    pad = engine.tokenizer.pad_token_id or 0
    mb = collate(batch, list(range(len(comps))), torch.ones(len(comps)), pad_id=pad)
    apply_to_hf_model(state.model, sigma, engine.noise_seed)
    with torch.no_grad():
        trainer_lp, _ = completion_logprobs(state.model, mb, 1.0)
    apply_to_hf_model(state.model, 0.0, engine.noise_seed)
    mask = mb["mask"].to(trainer_lp.device) > 0
    delta = (trainer_lp - mb["sampler_logp"].to(trainer_lp.device))[mask].double()
    return {
        "sigma": sigma,
        "tokens": int(mask.sum()),
        "mean_abs_dlogp": float(delta.abs().mean()),
        "max_abs_dlogp": float(delta.abs().max()),
        "k3_kl": float((delta.exp() - delta - 1).mean()),  # KL(sampler || trainer), samples from the sampler
    }


def test_sampler_trainer_gap_is_recorded_and_small(engine, trainer):
    state, adapter = trainer
    engine.set_adapter(adapter, DIGEST)
    engine.set_noise(0.0, 0)
    clean = _gap(engine, state, 0.0)
    engine.set_noise(0.02, 5)
    noisy = _gap(engine, state, 0.02)  # the trainer given the same noise (same seed)
    crossed = _gap(engine, state, 0.0)  # the noisy sampler against the clean trainer
    engine.set_noise(0.0, 0)
    engine.set_adapter(None, None)
    record = {"clean": clean, "aqn": noisy, "aqn_sampler_vs_clean_trainer": crossed}
    print("sampler/trainer gap:", json.dumps(record))
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / "vllm-gap.json").write_text(json.dumps(record, indent=1) + "\n")
    for r in (clean, noisy):
        assert r["tokens"] > 0
        assert r["mean_abs_dlogp"] < MEAN_ABS_BOUND and r["k3_kl"] < K3_BOUND, r
    # the captured graphs replay the noised weights: vLLM's noisy logprobs sit much closer to the
    # trainer given the same noise than to the clean trainer
    assert noisy["mean_abs_dlogp"] < 0.5 * crossed["mean_abs_dlogp"], record
