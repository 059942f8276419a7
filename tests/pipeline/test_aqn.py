"""AQN: the schedule against its formula, the noise draw, and the norm edit on a transformers model."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from qerl.pipeline.rollout.aqn import (
    AQNConfig,
    apply_to_hf_model,
    layer_generator,
    layer_noise,
    noise_targets,
    norm_noise,
    sigma_schedule,
    stage_of,
)


def test_schedule_matches_the_paper_formula():
    cfg = AQNConfig()  # K=10, 1e-2 -> 5e-4
    total = 100
    # Independent formulation: a geometric sequence of K-1 values from sigma_start to sigma_end.
    expected_stage_sigma = [0.0, *np.geomspace(1e-2, 5e-4, 9).tolist()]
    for step in range(total):
        assert sigma_schedule(step, total, cfg) == pytest.approx(expected_stage_sigma[step // 10], rel=1e-12)
    assert sigma_schedule(10, total, cfg) == pytest.approx(1e-2)
    assert sigma_schedule(99, total, cfg) == pytest.approx(5e-4)
    j = 4
    assert sigma_schedule(j * 10, total, cfg) == pytest.approx(1e-2 * (5e-4 / 1e-2) ** ((j - 1) / 8))


def test_schedule_edge_cases():
    assert all(sigma_schedule(s, 7, AQNConfig(num_stages=1)) == 0.0 for s in range(7))
    two = AQNConfig(num_stages=2, sigma_start=3e-3)
    assert [sigma_schedule(s, 4, two) for s in range(4)] == [0.0, 0.0, 3e-3, 3e-3]
    # Fewer steps than stages: the curve is sampled at coarser points, stage 0 still noise-free.
    assert [stage_of(s, 3, 10) for s in range(3)] == [0, 3, 6]
    assert sigma_schedule(0, 3, AQNConfig()) == 0.0
    assert sigma_schedule(1, 3, AQNConfig()) == pytest.approx(1e-2 * 0.05 ** (2 / 8))
    assert all(sigma_schedule(s, 50, AQNConfig(enabled=False)) == 0.0 for s in range(50))
    # Uneven split: stages cover the run, the last step is in the last stage.
    assert stage_of(12, 13, 10) == 9 and stage_of(0, 13, 10) == 0
    with pytest.raises(ValueError, match="step 5 outside"):
        sigma_schedule(5, 5, AQNConfig())
    with pytest.raises(ValueError, match="total_steps"):
        sigma_schedule(0, 0, AQNConfig())
    with pytest.raises(ValueError, match="sigma_start and sigma_end"):
        AQNConfig(sigma_start=0.0, sigma_end=1e-3)
    with pytest.raises(ValueError):
        AQNConfig(num_stages=10, bogus=1)


@pytest.mark.parametrize(
    "cfg",
    [AQNConfig(), AQNConfig(num_stages=1), AQNConfig(enabled=False), AQNConfig(sigma_start=0.0, sigma_end=0.0),
     AQNConfig(num_stages=2, sigma_start=3e-3), AQNConfig(num_stages=2, sigma_start=0.0)],
)  # fmt: skip
def test_active_says_whether_any_step_of_a_run_gets_noise(cfg):
    """What a run tells its engine (an AQN engine holds its norms in fp32 from the load on)."""
    noisy = any(sigma_schedule(s, 40, cfg) > 0 for s in range(40))
    assert cfg.active == noisy


def test_noise_is_seeded_fp32_and_has_the_right_scale():
    a = norm_noise(200_000, 0.01, layer_generator(7, 3))
    b = norm_noise(200_000, 0.01, layer_generator(7, 3))
    c = norm_noise(200_000, 0.01, layer_generator(7, 4))
    assert a.dtype == torch.float32 and torch.equal(a, b) and not torch.equal(a, c)
    assert a.std().item() == pytest.approx(0.01, rel=0.01)
    assert abs(a.mean().item()) < 1e-4
    both = layer_noise(7, 3, 64, 0.02)
    assert set(both) == {"input_layernorm", "post_attention_layernorm"}
    assert not torch.equal(both["input_layernorm"], both["post_attention_layernorm"])
    with pytest.raises(ValueError, match="sigma"):
        norm_noise(4, -1.0, layer_generator(0, 0))


def test_targets_match_hf_and_vllm_names_only():
    names = [
        "model.layers.0.input_layernorm.weight",  # transformers parameter
        "model.layers.11.post_attention_layernorm",  # vLLM module
        "base_model.model.model.layers.2.input_layernorm.weight",  # peft-wrapped
        "model.layers.0.self_attn.q_norm.weight",
        "model.norm.weight",
        "model.layers.0.mlp.gate_proj.weight",
    ]
    found = noise_targets((n, torch.ones(1)) for n in names)
    assert {k: v[:2] for k, v in found.items()} == {
        names[0]: (0, "input_layernorm"),
        names[1]: (11, "post_attention_layernorm"),
        names[2]: (2, "input_layernorm"),
    }


def test_hf_model_noise_exact_restorable_and_not_accumulating(tiny_model_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)  # bf16: the case fp32 weights matter for
    modules = {n: m for n, m in model.named_modules() if n.endswith("layernorm")}
    assert len(modules) == 2 * model.config.num_hidden_layers
    originals = {n: m.weight for n, m in modules.items()}
    clean = {n: p.detach().clone() for n, p in originals.items()}
    others = {n: p.detach().clone() for n, p in model.named_parameters() if "layernorm" not in n}

    sigma, seed = 2e-3, 11
    assert apply_to_hf_model(model, sigma, seed) == len(modules)
    for name, module in modules.items():
        layer = int(name.split(".layers.")[1].split(".")[0])
        kind = name.split(".")[-1]
        z = layer_noise(seed, layer, module.weight.numel(), sigma)[kind]
        # the module uses clean + z in fp32 (no bf16 rounding); the bf16 original is untouched
        assert module.weight.dtype == torch.float32 and not module.weight.requires_grad
        assert torch.equal(module.weight, clean[name].float() + z), name
        assert torch.equal(originals[name], clean[name])
    after_once = {n: m.weight.detach().clone() for n, m in modules.items()}
    apply_to_hf_model(model, sigma, seed)
    assert all(torch.equal(modules[n].weight, after_once[n]) for n in modules)  # no accumulation

    # A peft wrapper renames the parameters; the clean copy must still be the original weights.
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"]))
    apply_to_hf_model(peft_model, 0.0, 0)
    assert all(modules[n].weight is originals[n] and torch.equal(originals[n], clean[n]) for n in modules)
    assert all("forward" not in m.__dict__ for m in modules.values())  # the class forward again
    assert all(torch.equal(p, others[n]) for n, p in model.named_parameters() if n in others)
    assert math.isfinite(sum(p.float().sum().item() for p in originals.values()))
