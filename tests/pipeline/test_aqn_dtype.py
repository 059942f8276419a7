"""AQN on 16-bit engines: the noise the engine uses is the noise drawn, and it is measured and recorded.

On a bf16 model ``(clean + z).to(bf16)`` rounds z to the weight's ulp; ``qerl.pipeline.rollout.aqn``
keeps noisy norm weights in fp32 instead. Checked here against plain PyTorch references: the
realised sigma at every stage of the 7B preset's schedule (and that the old bf16 write misses it),
the norm's output against ``(x_hat_fp32 * (clean + z)).to(bf16)``, noise reaching the logits, sigma 0
giving bit-identical outputs to a never-noised model, a peft-wrapped trainer-style model (backward
through the fp32 norms), and the realised sigma's arithmetic and WARNING. The vLLM engine tests
(bf16, CPU, in-process) are in ``tests/gpu/test_aqn_dtype_vllm.py``.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from qerl.pipeline.rollout.aqn import (
    AQNConfig,
    apply_norm_noise,
    apply_to_hf_model,
    check_realised,
    layer_noise,
    noise_hf_model,
    noise_norm_modules,
    noise_targets,
    realised_sigma,
    sigma_schedule,
)

# the qwen2.5-7b-gsm8k preset's schedule: K = 10, 1e-2 -> 5e-4, one sigma per noisy stage
PRESET_SIGMAS = sorted({sigma_schedule(s, 10, AQNConfig()) for s in range(1, 10)}, reverse=True)
IDS = torch.tensor([[5, 17, 33, 40, 9, 61, 7]])


@pytest.fixture
def bf16_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).eval()
    assert model.dtype == torch.bfloat16
    return model


def _norms(model) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in model.named_modules() if n.endswith("layernorm")}


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def test_the_preset_schedule_is_the_one_the_issue_measured():
    assert len(PRESET_SIGMAS) == 9
    assert PRESET_SIGMAS[0] == pytest.approx(1e-2) and PRESET_SIGMAS[-1] == pytest.approx(5e-4)


def test_bf16_realised_sigma_is_the_requested_one_at_every_stage(bf16_model):
    norms = _norms(bf16_model)
    clean = {n: m.weight.detach().float().clone() for n, m in norms.items()}
    for sigma in PRESET_SIGMAS:
        stats = noise_hf_model(bf16_model, sigma, 5)
        # independent measure: std of (weight as used - clean) over all channels, from the modules
        delta = torch.cat([norms[n].weight.detach().float() - clean[n] for n in norms])
        assert realised_sigma([stats]) == pytest.approx(delta.std(correction=0).item(), rel=1e-6)
        assert abs(realised_sigma([stats]) / sigma - 1) < 0.10, sigma
        assert stats["fp32"] == 1.0 and stats["channels"] == delta.numel()
        for name, module in norms.items():
            layer, kind = int(name.split(".layers.")[1].split(".")[0]), name.split(".")[-1]
            z = layer_noise(5, layer, module.weight.numel(), sigma)[kind]
            assert torch.equal(module.weight.detach(), clean[name] + z), (sigma, name)


def test_the_old_bf16_write_misses_the_late_stages(bf16_model):
    """The dtype-preserving write (what every engine did before): the same check fails."""
    targets = noise_targets((n, p.data) for n, p in bf16_model.named_parameters())
    clean: dict[str, torch.Tensor] = {}
    ratios = []
    for sigma in PRESET_SIGMAS:
        apply_norm_noise(targets, clean, sigma, 5)
        delta = torch.cat([w.float() - clean[f"{layer}.{kind}"] for layer, kind, w in targets.values()])
        ratios.append(delta.std(correction=0).item() / sigma)
    assert max(abs(r - 1) for r in ratios) > 0.10, ratios
    assert ratios[-1] < 0.5, ratios  # sigma 5e-4 against a bf16 ulp of 2**-7 near 1.0: mostly gone


def test_the_fp32_norm_matches_a_plain_pytorch_reference(bf16_model):
    norm = bf16_model.model.layers[1].post_attention_layernorm
    clean = norm.weight.detach().float().clone()
    apply_to_hf_model(bf16_model, 3e-3, 9)
    x = torch.randn(3, 5, clean.numel(), generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    xf = x.float()
    x_hat = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    want = (x_hat * (clean + layer_noise(9, 1, clean.numel(), 3e-3)["post_attention_layernorm"])).to(x.dtype)
    with torch.no_grad():
        got = norm(x)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


def test_noise_reaches_the_logits_and_sigma_zero_is_bit_identical(bf16_model, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    never = _logits(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).eval())
    originals = {n: m.weight for n, m in _norms(bf16_model).items()}
    assert torch.equal(_logits(bf16_model), never)
    noise_hf_model(bf16_model, 1e-2, 1)
    a = _logits(bf16_model)
    noise_hf_model(bf16_model, 1e-2, 2)
    b = _logits(bf16_model)
    noise_hf_model(bf16_model, 1e-2, 1)
    again = _logits(bf16_model)
    assert a.dtype == torch.bfloat16
    assert not torch.equal(a, never) and not torch.equal(a, b)  # the draw moves the logits
    assert torch.equal(a, again)  # no accumulation: the same (sigma, seed) gives the same model
    stats = noise_hf_model(bf16_model, 0.0, 0)
    assert realised_sigma([stats]) == 0.0
    assert all(
        m.weight is originals[n] and m.weight.dtype == torch.bfloat16 for n, m in _norms(bf16_model).items()
    )
    assert torch.equal(_logits(bf16_model), never)


def test_a_peft_trainer_model_trains_through_the_fp32_norms(bf16_model):
    """The trainer's use (another objective applies AQN there): LoRA gradients flow, dtypes hold."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(bf16_model, LoraConfig(r=4, target_modules=["q_proj", "gate_proj"]))
    assert apply_to_hf_model(peft_model, 5e-4, 3) == 4
    loss = peft_model(IDS, labels=IDS).loss
    loss.backward()
    grads = [p.grad for n, p in peft_model.named_parameters() if "lora_B" in n]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    assert all(m.weight.grad is None for m in _norms(bf16_model).values())  # norms stay frozen
    apply_to_hf_model(peft_model, 0.0, 0)
    assert all(m.weight.dtype == torch.bfloat16 for m in _norms(bf16_model).values())


def test_an_fp32_model_is_written_in_place(tiny_model_factory):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_factory(dtype=torch.float32), dtype=torch.float32)
    originals = {n: m.weight for n, m in _norms(model).items()}
    stats = noise_hf_model(model, 5e-4, 4)
    assert all(m.weight is originals[n] and "forward" not in m.__dict__ for n, m in _norms(model).items())
    assert abs(realised_sigma([stats]) / 5e-4 - 1) < 0.10


def test_an_unknown_norm_class_is_refused_by_name():
    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.input_layernorm = torch.nn.LayerNorm(8).to(torch.bfloat16)

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([Layer()])
    with pytest.raises(ValueError, match=r"layers\.0\.input_layernorm is a LayerNorm"):
        noise_hf_model(model, 1e-3, 0)
    assert model.layers[0].input_layernorm.weight.dtype == torch.bfloat16  # nothing was changed
    with pytest.raises(ValueError, match="no layers"):
        noise_norm_modules({}, {}, 1e-3, 0, fp32_weights=True, patch_forward=False)


def test_realised_sigma_combines_workers_and_warns(caplog):
    deltas = [np.array([0.01, -0.02, 0.03]), np.array([0.0, 0.02])]  # two pipeline stages' channels
    stats = [{"channels": len(d), "sum": d.sum(), "sum_sq": (d**2).sum()} for d in deltas]
    assert realised_sigma(stats) == pytest.approx(np.concatenate(deltas).std(), rel=1e-12)
    with pytest.raises(ValueError, match="no noised channels"):
        realised_sigma([])
    with caplog.at_level(logging.WARNING, logger="qerl.aqn"):
        check_realised(1e-3, 1.05e-3, "engine A")
        check_realised(0.0, 0.0, "engine B")
        # a tiny model's draw: 256 channels are 4.4% a standard error, 0.89x is its own sampling (seen in CI)
        check_realised(1e-2, 0.89e-2, "tiny engine", channels=256)
        assert not caplog.records
        check_realised(1e-2, 0.89e-2, "7B engine", channels=2 * 28 * 3584)
        assert "7B engine" in caplog.text
        caplog.clear()
        check_realised(1e-3, 0.43e-3, "engine C")
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "engine C" in caplog.text and "0.43x" in caplog.text


def test_the_sigma_plot_takes_the_realised_sigma(tmp_path):
    from qerl.pipeline.registry import tracking

    history = [{"step": s, "sigma": 1e-3 / (s + 1), "aqn_sigma_realised": 0.9e-3 / (s + 1)} for s in range(4)]
    assert tracking.curve(history, ("aqn_sigma_realised",))[1][0] == (0, 0.9e-3)
    assert [p.name for p in tracking.write_plots(history, tmp_path)] == ["sigma.png"]


def test_the_rollout_stage_requires_the_realised_sigma_of_a_noisy_step():
    from types import SimpleNamespace

    from qerl.stages.rollout import _realised_sigma

    silent = SimpleNamespace(mode="fake-test-double")  # adds no noise, reports nothing
    assert _realised_sigma(silent, 0.0) == 0.0
    with pytest.raises(RuntimeError, match=r"fake-test-double.*sigma_realised"):
        _realised_sigma(silent, 1e-3)
    assert _realised_sigma(SimpleNamespace(mode="m", sigma_realised=9.7e-4), 1e-3) == 9.7e-4
