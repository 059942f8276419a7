"""GRPO math against values derived by hand (the derivation is in each test's comments)."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.config import ConfigError, load_config
from pipeline.grpo import (
    GRPOConfig,
    aggregate,
    clip_masks,
    entropy_from_logits,
    group_advantages,
    grpo_token_objective,
    k3_kl,
    per_token_loss,
    tis_weights,
)


def test_group_advantages_std_normalised():
    # one group [1, 0, 1, 0]: mean 0.5, sample std sqrt((4 * 0.25) / 3) = sqrt(1/3)
    adv = group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), [7, 7, 7, 7])
    a = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    assert torch.allclose(adv, torch.tensor([a, -a, a, -a]), atol=1e-6)


def test_group_advantages_two_groups_interleaved_and_mean_only():
    # group "a" = [3, 1] (mean 2, std sqrt(2)); group "b" = [2, 2, 2] (all equal -> 0)
    rewards = torch.tensor([3.0, 2.0, 1.0, 2.0, 2.0])
    groups = ["a", "b", "a", "b", "b"]
    a = 1.0 / (math.sqrt(2.0) + 1e-4)
    assert torch.allclose(group_advantages(rewards, groups), torch.tensor([a, 0.0, -a, 0.0, 0.0]), atol=1e-6)
    assert torch.equal(
        group_advantages(rewards, groups, scale="none"), torch.tensor([1.0, 0.0, -1.0, 0.0, 0.0])
    )


def test_group_advantages_singleton_and_bad_input():
    assert torch.equal(group_advantages(torch.tensor([5.0]), [0]), torch.tensor([0.0]))
    with pytest.raises(ValueError, match="2 group ids for 3 rewards"):
        group_advantages(torch.tensor([1.0, 2.0, 3.0]), [0, 0])
    with pytest.raises(ValueError, match="scale_rewards"):
        group_advantages(torch.tensor([1.0]), [0], scale="batch")


def test_per_token_loss_clipping_both_signs():
    # rho = [1.5, 0.5, 1.0]; clip to [0.8, 1.28]
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.0]])).requires_grad_()
    old = torch.zeros(1, 3)
    loss, ratio = per_token_loss(logp, old, torch.tensor([1.0]), 0.2, 0.28)
    # A=+1: -min(rho, clip(rho)) = -[1.28, 0.5, 1.0]
    assert torch.allclose(loss, -torch.tensor([[1.28, 0.5, 1.0]]))
    assert torch.allclose(ratio, torch.tensor([[1.5, 0.5, 1.0]]))
    loss.sum().backward()
    # d/dlogp of -rho*A = -rho*A where unclipped; 0 where the clipped branch is the min
    assert torch.allclose(logp.grad, torch.tensor([[0.0, -0.5, -1.0]]))
    # A=-1: -min(-rho, -clip(rho)) = max(rho, clip(rho)) = [1.5, 0.8, 1.0]
    loss_neg, _ = per_token_loss(logp.detach(), old, torch.tensor([-1.0]), 0.2, 0.28)
    assert torch.allclose(loss_neg, torch.tensor([[1.5, 0.8, 1.0]]))


def test_per_token_loss_weights_and_shape_check():
    logp = torch.zeros(1, 2)
    loss, _ = per_token_loss(
        logp, logp, torch.tensor([2.0]), 0.2, 0.28, is_weights=torch.tensor([[0.5, 2.0]])
    )
    assert torch.allclose(loss, torch.tensor([[-1.0, -4.0]]))
    with pytest.raises(ValueError, match="differ in shape"):
        per_token_loss(torch.zeros(1, 2), torch.zeros(1, 3), torch.tensor([1.0]), 0.2, 0.2)


def test_k3_kl_values():
    # pi = 0.5, ref = 0.25: d = ln 0.5; exp(d) - d - 1 = 0.5 + ln 2 - 1
    kl = k3_kl(torch.log(torch.tensor([0.5, 0.3])), torch.log(torch.tensor([0.25, 0.3])))
    assert torch.allclose(kl, torch.tensor([0.5 + math.log(2) - 1, 0.0]), atol=1e-7)


def test_tis_weights_are_capped_ratios():
    w = tis_weights(torch.log(torch.tensor([0.6, 0.2])), torch.log(torch.tensor([0.2, 0.4])), cap=2.0)
    assert torch.allclose(w, torch.tensor([2.0, 0.5]))


def test_aggregations():
    tok = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    # grpo: mean(6/3, 4/1) = 3; bnpo/dapo: 10/4; dr_grpo: 10/(2*3)
    assert aggregate(tok, mask, "grpo").item() == pytest.approx(3.0)
    assert aggregate(tok, mask, "bnpo").item() == pytest.approx(2.5)
    assert aggregate(tok, mask, "dapo").item() == pytest.approx(2.5)
    assert aggregate(tok, mask, "dr_grpo").item() == pytest.approx(10 / 6)
    # step-level normalisers (gradient accumulation): dapo over 8 tokens, grpo over 4 sequences
    assert aggregate(tok, mask, "dapo", num_tokens=8).item() == pytest.approx(1.25)
    assert aggregate(tok, mask, "grpo", num_sequences=4).item() == pytest.approx(1.5)
    assert aggregate(tok, mask, "dr_grpo", num_sequences=2, max_len=5).item() == pytest.approx(1.0)
    # bnpo ignores the step normaliser by definition
    assert aggregate(tok, mask, "bnpo", num_tokens=8).item() == pytest.approx(2.5)
    with pytest.raises(ValueError, match="unknown loss_type"):
        aggregate(tok, mask, "sum")


def test_entropy_from_logits():
    # uniform over 4 -> ln 4; probs (0.75, 0.25) -> -(0.75 ln 0.75 + 0.25 ln 0.25)
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [math.log(3.0), 0.0, -1e9, -1e9]]])
    ent = entropy_from_logits(logits, chunk=1)
    expected = torch.tensor([[math.log(4.0), -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))]])
    assert torch.allclose(ent, expected, atol=1e-6)


def test_clip_masks():
    ratio = torch.tensor([[0.7, 1.3, 1.0], [0.7, 1.3, 1.0]])
    low, high = clip_masks(ratio, torch.tensor([-1.0, 1.0]), 0.2, 0.28)
    assert low.tolist() == [[True, False, False], [False, False, False]]
    assert high.tolist() == [[False, False, False], [False, True, False]]


def test_objective_combines_kl_and_counts():
    cfg = GRPOConfig(beta=0.5, loss_type="bnpo")
    logp = torch.log(torch.tensor([[0.5, 0.5]]))
    sampler = torch.log(torch.tensor([[0.5, 0.25]]))  # rho = [1, 2]
    ref = torch.log(torch.tensor([[0.25, 0.5]]))
    mask = torch.tensor([[1, 1]])
    loss, stats = grpo_token_objective(logp, sampler, torch.tensor([1.0]), mask, cfg, ref_logp=ref)
    # surrogate: -[1, 1.28]; kl: [0.5 + ln 2 - 1, 0]; mean over 2 tokens
    kl0 = 0.5 + math.log(2) - 1
    assert loss.item() == pytest.approx((-1 - 1.28 + 0.5 * kl0) / 2, abs=1e-6)
    assert stats["tokens"] == 2 and stats["clip_high"] == 1 and stats["clip_low"] == 0
    assert stats["kl"] == pytest.approx(kl0, abs=1e-6)


def test_objective_tis_uses_old_logp():
    cfg = GRPOConfig(tis_cap=2.0, loss_type="bnpo")
    logp = torch.log(torch.tensor([[0.6]]))
    old = torch.log(torch.tensor([[0.6]]))  # rho = 1 against old
    sampler = torch.log(torch.tensor([[0.2]]))  # weight min(3, 2) = 2
    loss, _ = grpo_token_objective(logp, sampler, torch.tensor([1.0]), torch.ones(1, 1), cfg, old_logp=old)
    assert loss.item() == pytest.approx(-2.0)
    with pytest.raises(ValueError, match="old_logp"):
        grpo_token_objective(logp, sampler, torch.tensor([1.0]), torch.ones(1, 1), cfg)


def test_config_defaults_and_rejections():
    cfg = GRPOConfig()
    assert (cfg.eps_low, cfg.eps_high, cfg.beta, cfg.loss_type) == (0.2, 0.28, 0.0, "dapo")
    assert cfg.mask_truncated and cfg.tis_cap is None and cfg.scale_rewards == "group"
    with pytest.raises(ConfigError, match="valid keys"):
        load_config(GRPOConfig, overrides=["epsilon=0.1"])
    with pytest.raises(ConfigError, match="tis_cap"):
        load_config(GRPOConfig, overrides=["tis_cap=0.5"])
