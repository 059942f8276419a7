"""NVFP4Linear and the quantized training model against a bf16 model holding the dequantized weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from qerl.kernels.nvfp4_reference import dequantize_nvfp4, quantize_nvfp4
from qerl.pipeline.nvfp4.linear import NVFP4Linear
from qerl.pipeline.nvfp4.loading import load_dequantized, load_for_training
from qerl.pipeline.rl.checkpoint import save_checkpoint
from qerl.pipeline.rl.logprobs import completion_logprobs
from qerl.pipeline.rl.policy import init_state
from qerl.pipeline.rl.train_config import TrainConfig
from torch import nn


@pytest.fixture(scope="module")
def quantized(tiny_model_dir, tmp_path_factory):
    """(quantize manifest, dequantized-twin manifest) of the tiny model, from the real quantize stage."""
    from qerl.pipeline.nvfp4.recipe import QuantizeConfig
    from qerl.pipeline.store.artifact_store import ArtifactStore
    from qerl.stages.dequantize import run as run_twin
    from qerl.stages.quantize import run as quantize

    store = ArtifactStore(tmp_path_factory.mktemp("store"))
    manifest = quantize(QuantizeConfig(), str(tiny_model_dir), store)
    # an fp32 twin, so that an fp32 training model and the twin hold the very same weight values
    return manifest, run_twin(QuantizeConfig(twin_dtype="float32"), manifest, store)


@pytest.fixture(scope="module")
def nvfp4_ckpt(quantized) -> Path:
    return quantized[0].dir


def _layer_pair(out_f=48, in_f=64, bias=True, dtype=torch.bfloat16):
    torch.manual_seed(0)
    w = torch.randn(out_f, in_f) * 0.1
    packed, scale, gs = quantize_nvfp4(w)
    b = torch.randn(out_f).to(dtype) if bias else None
    q = NVFP4Linear.from_tensors(packed, scale, gs, b, dtype=dtype)
    ref = nn.Linear(in_f, out_f, bias=bias, dtype=dtype)
    with torch.no_grad():
        ref.weight.copy_(dequantize_nvfp4(packed, scale, gs, dtype=dtype))
        if bias:
            ref.bias.copy_(b)
    return q, ref


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_linear_forward_backward_match_dense(dtype):
    q, ref = _layer_pair(dtype=dtype)
    x = torch.randn(3, 5, 64, dtype=dtype)
    xq, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    yq, yr = q(xq), ref(xr)
    assert torch.equal(yq, yr)
    g = torch.randn_like(yq)
    yq.backward(g)
    yr.backward(g)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert torch.allclose(xq.grad, xr.grad, rtol=tol, atol=tol)
    assert list(q.parameters()) == []  # the base has nothing to train


def test_linear_saves_only_packed_tensors():
    q, _ = _layer_pair(out_f=64, in_f=128, bias=False)
    saved: list[torch.Tensor] = []

    def pack(t):
        saved.append(t)
        return t

    x = torch.randn(4, 128, dtype=torch.bfloat16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = q(x)
    assert {t.dtype for t in saved} == {torch.uint8, torch.float8_e4m3fn, torch.float32}
    assert sum(t.numel() * t.element_size() for t in saved) == 64 * 64 + 64 * 8 + 4  # 4.5 bits/weight
    y.sum().backward()
    assert x.grad is not None


def test_linear_rejects_bad_shapes():
    packed, scale, gs = quantize_nvfp4(torch.randn(8, 32))
    with pytest.raises(ValueError, match=r"layers\.0\.q_proj\.weight_scale"):
        NVFP4Linear.from_tensors(packed, scale[:, :1], gs, name="layers.0.q_proj")
    with pytest.raises(ValueError, match="divisible by 16"):
        NVFP4Linear(40, 8)


def test_quantized_model_matches_dequantized_reference(nvfp4_ckpt):
    qmodel = load_for_training(nvfp4_ckpt, dtype=torch.bfloat16)
    ref = load_dequantized(nvfp4_ckpt, dtype=torch.bfloat16)
    n_q = sum(isinstance(m, NVFP4Linear) for m in qmodel.modules())
    assert n_q == 7 * qmodel.config.num_hidden_layers
    assert not any(isinstance(m, nn.Linear) for n, m in qmodel.named_modules() if ".layers." in n)
    ids = torch.tensor([[3, 50, 7, 99, 12, 4]])
    assert torch.equal(qmodel(input_ids=ids).logits, ref(input_ids=ids).logits)


def _lora_grads(model, mb, temperature=1.0):
    model.zero_grad(set_to_none=True)
    logp, _ = completion_logprobs(model, mb, temperature)
    (logp * torch.linspace(-1, 1, logp.numel()).reshape(logp.shape)).sum().backward()
    return {
        n.replace(".base_layer", ""): p.grad.clone() for n, p in model.named_parameters() if p.requires_grad
    }


def _minibatch():
    from qerl.pipeline.rl.batch import RolloutBatch, collate

    batch = RolloutBatch(
        prompt_ids=[[5, 6, 7, 8], [9, 10]],
        completion_ids=[[11, 12, 13], [14, 15, 16, 17, 18]],
        sampler_logprobs=[[0.0] * 3, [0.0] * 5],
        truncated=[False, False],
        rewards=[1.0, 0.0],
        group_ids=[0, 0],
    )
    return collate(batch, [0, 1], torch.ones(2), pad_id=0)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_lora_gradients_equal_dense_bf16_model(nvfp4_ckpt, tmp_path, checkpointing):
    """Same LoRA init on (a) our packed model and (b) an HF model holding dequant(W): same grads."""
    import shutil

    from qerl.pipeline.nvfp4.loading import load_dequantized

    cfg = TrainConfig(lora_r=4, lora_alpha=8, seed=5, gradient_checkpointing=checkpointing)
    ours = init_state(nvfp4_ckpt, cfg)
    # a plain HF checkpoint of the dequantized weights, trained by the same code path (base_format "hf")
    dense_dir = tmp_path / "dense"
    load_dequantized(nvfp4_ckpt).save_pretrained(dense_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (nvfp4_ckpt / name).is_file():
            shutil.copy(nvfp4_ckpt / name, dense_dir / name)
    dense = init_state(dense_dir, cfg)
    assert ours.base_format == "nvfp4" and dense.base_format == "hf"
    gen = torch.Generator().manual_seed(0)
    dense_params = dict(dense.model.named_parameters())
    with torch.no_grad():  # non-zero lora_B so lora_A gets gradient too; identical LoRA in both
        for name, p in ours.model.named_parameters():
            if p.requires_grad:
                if "lora_B" in name:
                    p.normal_(0, 0.1, generator=gen)
                dense_params[name].copy_(p)
    mb = _minibatch()
    g_ours, g_dense = _lora_grads(ours.model, mb), _lora_grads(dense.model, mb)
    assert g_ours.keys() == g_dense.keys() and len(g_ours) == 2 * 7 * 2
    for name in g_ours:
        scale = float(g_dense[name].abs().max())
        assert scale > 0, name
        # same bf16 weight values, same ops (F.linear forward, grad_out @ W backward): bit-identical
        assert torch.equal(g_ours[name], g_dense[name]), name


def test_saved_adapter_loads_in_peft_on_dense_model(nvfp4_ckpt, quantized, tmp_path):
    """peft on the quantize stage's dequantized twin (what vLLM serves on CPU) gives our logprobs."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg = TrainConfig(lora_r=4, lora_alpha=8, seed=5, dtype="float32")
    state = init_state(nvfp4_ckpt, cfg)
    with torch.no_grad():
        for n, p in state.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)
    save_checkpoint(state, tmp_path / "ckpt")
    adapter = tmp_path / "ckpt" / "adapter"
    import json

    adapter_cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert adapter_cfg["base_model_name_or_path"] == str(nvfp4_ckpt)
    assert sorted(adapter_cfg["target_modules"]) == sorted(cfg.target_modules)
    twin = quantized[1].dir
    dense = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32), adapter
    )
    mb = _minibatch()
    state.model.eval()
    with torch.no_grad():
        ours, _ = completion_logprobs(state.model, mb, 0.7)
        theirs, _ = completion_logprobs(dense, mb, 0.7)
        base, _ = completion_logprobs(load_dequantized(nvfp4_ckpt, dtype=torch.float32), mb, 0.7)
    assert torch.allclose(ours, theirs, atol=1e-5)
    assert float((ours - base).abs().max()) > 1e-3  # the adapter changes the model


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sliced_decode_matches_single_gemm(monkeypatch, bias, dtype):
    """A layer above CHUNK_ELEMENTS is decoded and multiplied in slices (rows in forward, 16-aligned
    columns in backward): same outputs and input gradients as the single-GEMM path, and the dense
    weight is only ever a slice."""
    import qerl.pipeline.nvfp4.linear as qlinear

    q, ref = _layer_pair(out_f=96, in_f=160, bias=bias, dtype=dtype)
    x = torch.randn(2, 7, 160, dtype=dtype)
    g = torch.randn(2, 7, 96, dtype=dtype)

    def run(chunk):
        monkeypatch.setattr(qlinear, "CHUNK_ELEMENTS", chunk)
        xi = x.clone().requires_grad_()
        y = q(xi)
        y.backward(g)
        return y, xi.grad

    y_one, gx_one = run(1 << 30)
    y_ref = ref(x)
    assert torch.equal(y_one, y_ref)
    for chunk in (96 * 48, 5000, 40 * 16):  # even slices, uneven slices, the 16-column minimum
        y, gx = run(chunk)
        tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
        assert torch.allclose(y, y_one, rtol=tol, atol=tol) and torch.allclose(gx, gx_one, rtol=tol, atol=tol)
