"""GRPO math against values derived by hand (the derivation is in each test's comments)."""

from __future__ import annotations

import math

import pytest
import torch
from qerl.pipeline.config import ConfigError, load_config
from qerl.pipeline.rl.objective import (
    GRPOConfig,
    aggregate,
    clip_masks,
    entropy_from_logits,
    group_advantages,
    grpo_token_objective,
    k3_kl,
    mismatch_sums,
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
    cfg = GRPOConfig(beta=0.5, loss_type="bnpo", anchor="sampler", tis_cap=None)
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
    assert cfg.mask_truncated and cfg.scale_rewards == "group"
    assert (cfg.anchor, cfg.tis_cap, cfg.dual_clip) == ("trainer", 2.0, 3.0)
    with pytest.raises(ConfigError, match="valid keys"):
        load_config(GRPOConfig, overrides=["epsilon=0.1"])
    with pytest.raises(ConfigError, match="tis_cap"):
        load_config(GRPOConfig, overrides=["tis_cap=0.5"])
    with pytest.raises(ConfigError, match="dual_clip"):
        load_config(GRPOConfig, overrides=["dual_clip=1.0"])
    # the sampler anchor has no trainer/sampler weight to truncate: the default cap must be turned off
    with pytest.raises(ConfigError, match=r"tis_cap=2.0 needs grpo.anchor: trainer"):
        load_config(GRPOConfig, overrides=["anchor=sampler"])
    old = load_config(GRPOConfig, overrides=["anchor=sampler", "tis_cap=null", "dual_clip=null"])
    assert (old.anchor, old.tis_cap, old.dual_clip) == ("sampler", None, None)
    plain_ppo = load_config(GRPOConfig, overrides=["tis_cap=null"])  # trainer anchor without TIS: allowed
    assert plain_ppo.anchor == "trainer" and plain_ppo.tis_cap is None


def test_aggregations_with_a_fully_masked_row():
    # rows: 3 tokens, 1 token, and a truncated row whose mask is all zero (its values must not matter)
    tok = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0], [5.0, 5.0, 5.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    # grpo: per-sequence means 6/3 = 2 and 4/1 = 4 over the 2 sequences that have tokens = 3
    # (dividing by all 3 rows would give 2: the masked row would dilute the others)
    assert aggregate(tok, mask, "grpo").item() == pytest.approx(3.0)
    # bnpo / dapo: token sum 1+2+3+4 = 10 over 4 unmasked tokens
    assert aggregate(tok, mask, "bnpo").item() == pytest.approx(2.5)
    assert aggregate(tok, mask, "dapo").item() == pytest.approx(2.5)
    # dr_grpo: token sum over the constant rows x max_len = 3 x 3 (every row counts, see the module notes)
    assert aggregate(tok, mask, "dr_grpo").item() == pytest.approx(10 / 9)
    # step-level normalisers: 4 contributing sequences; 8 tokens; 4 rows of budget 5
    assert aggregate(tok, mask, "grpo", num_sequences=4).item() == pytest.approx(6 / 4)
    assert aggregate(tok, mask, "dapo", num_tokens=8).item() == pytest.approx(10 / 8)
    assert aggregate(tok, mask, "dr_grpo", num_rows=4, max_len=5).item() == pytest.approx(10 / 20)
    # every row masked: a zero loss, not 0/0
    assert aggregate(tok, torch.zeros(3, 3), "grpo").item() == 0.0
    # grpo, bnpo and dapo equal the batch without the masked row (a dropped sample)
    for loss_type in ("grpo", "bnpo", "dapo"):
        assert aggregate(tok, mask, loss_type).item() == pytest.approx(
            aggregate(tok[:2], mask[:2], loss_type).item()
        )


def test_dual_clip_caps_negative_advantage_tokens():
    # rho = [5, 2, 0.5], clip range [0.8, 1.28], dual clip c = 3
    logp = torch.log(torch.tensor([[5.0, 2.0, 0.5]])).requires_grad_()
    old = torch.zeros(1, 3)
    # A = -1: ordinary clipped loss max(rho, clip(rho)) = [5, 2, 0.8]; dual clip min(., 3) = [3, 2, 0.8]
    loss, _ = per_token_loss(logp, old, torch.tensor([-1.0]), 0.2, 0.28, dual_clip=3.0)
    assert torch.allclose(loss, torch.tensor([[3.0, 2.0, 0.8]]))
    loss.sum().backward()
    # d/dlogp: 0 where the dual cap binds, rho * |A| = 2 where unclipped, 0 on the clipped branch
    assert torch.allclose(logp.grad, torch.tensor([[0.0, 2.0, 0.0]]))
    # without dual clip the first token's loss is 5 (unbounded in rho)
    plain, _ = per_token_loss(logp.detach(), old, torch.tensor([-1.0]), 0.2, 0.28)
    assert torch.allclose(plain, torch.tensor([[5.0, 2.0, 0.8]]))
    # A = +2: dual clip does not apply: -[1.28 * 2, 1.28 * 2, 0.5 * 2]
    pos, _ = per_token_loss(logp.detach(), old, torch.tensor([2.0]), 0.2, 0.28, dual_clip=3.0)
    assert torch.allclose(pos, -torch.tensor([[2.56, 2.56, 1.0]]))
    # the objective counts where it binds
    cfg = GRPOConfig(anchor="sampler", tis_cap=None)
    _, stats = grpo_token_objective(logp.detach(), old, torch.tensor([-1.0]), torch.ones(1, 3), cfg)
    assert stats["clip_dual"] == 1 and stats["clip_low"] == 1  # rho 5 (dual), rho 0.5 (low)


def _perturbed_tokens() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two rows of two tokens, the trainer at p = 0.5 everywhere. Row 0 (A = +1): the sampler put
    0.25 on its first token (trainer/sampler = 2 > 1.28); row 1 (A = -1): 0.8 (ratio 0.625 < 0.8):
    both beyond the clip range in the direction that clips, as AQN noise can. Second tokens agree."""
    logp = torch.log(torch.full((2, 2), 0.5))
    sampler = torch.log(torch.tensor([[0.25, 0.5], [0.8, 0.5]]))
    return logp, sampler, torch.tensor([1.0, -1.0])


def test_default_anchor_gives_perturbed_tokens_a_gradient():
    """Issue item 5: with the default config (trainer anchor, TIS 2, dual clip 3) the tokens the sampler
    disagrees on are trained; with the old sampler anchor their gradient is exactly zero."""
    logp0, sampler, adv = _perturbed_tokens()
    mask = torch.ones(2, 2)

    def grad(cfg: GRPOConfig) -> tuple[float, torch.Tensor]:
        logp = logp0.clone().requires_grad_()
        # first update of the step: old = this forward's own logprobs, so rho = 1
        loss, _ = grpo_token_objective(logp, sampler, adv, mask, cfg, old_logp=logp.detach())
        loss.backward()
        return loss.item(), logp.grad

    # default: per token -w * A * rho with w = min(trainer/sampler, 2) = [[2, 1], [0.625, 1]], dapo / 4
    loss, g = grad(GRPOConfig())
    assert loss == pytest.approx((-2 - 1 + 0.625 + 1) / 4, abs=1e-6)
    assert torch.allclose(g, torch.tensor([[-2.0, -1.0], [0.625, 1.0]]) / 4, atol=1e-6)
    # old behaviour: rho against the sampler = [[2, 1], [0.625, 1]]; row 0 token 0 takes the clipped
    # branch -1.28, row 1 token 0 takes 0.8 (A = -1): both constants. Loss (-1.28 - 1 + 0.8 + 1) / 4
    loss_s, g_s = grad(GRPOConfig(anchor="sampler", tis_cap=None))
    assert loss_s == pytest.approx((-1.28 - 1 + 0.8 + 1) / 4, abs=1e-6)
    assert torch.equal(g_s[:, 0], torch.zeros(2))
    assert torch.allclose(g_s[:, 1], torch.tensor([-1.0, 1.0]) / 4, atol=1e-6)


def test_mismatch_sums_by_hand():
    # trainer 0.5 on three tokens, sampler [0.25, 0.8, 0.5]: w = trainer/sampler = [2, 0.625, 1]
    old = torch.log(torch.full((3,), 0.5))
    sampler = torch.log(torch.tensor([0.25, 0.8, 0.5]))
    sums = mismatch_sums(old, sampler, 0.2, 0.28, tis_cap=1.5)
    d = [math.log(2.0), math.log(0.625), 0.0]
    assert sums["mismatch_tokens"] == 3
    # k3 of KL(sampler || trainer) per token: w - log w - 1
    assert sums["mismatch_k3"] == pytest.approx((2 - d[0] - 1) + (0.625 - d[1] - 1), abs=1e-6)
    assert sums["mismatch_abs"] == pytest.approx(abs(d[0]) + abs(d[1]), abs=1e-6)
    assert sums["mismatch_out"] == 2  # 2 > 1.28 and 0.625 < 0.8
    assert sums["tis_capped"] == 1  # only 2 > 1.5
    assert mismatch_sums(old, sampler, 0.2, 0.28, tis_cap=None)["tis_capped"] == 0
