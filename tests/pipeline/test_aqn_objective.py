"""grpo.aqn_objective: how the GRPO objective treats the rollout's AQN noise (qerl.pipeline.rl.objective).

Hand-derived weights and losses for on_policy and noisy_trainer, the trainer really running with the
rollout's noise (equal to a separately noised copy), sigma 0 making the three choices one, clean_is
untouched, the model clean again after every step (resident state and saved adapter), the config
checks, and the train stage's key and manifest."""

from __future__ import annotations

import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from qerl.pipeline.config import ConfigError, load_config
from qerl.pipeline.rl.batch import RolloutBatch, collate, load_rollout_batch
from qerl.pipeline.rl.checkpoint import load_checkpoint, save_checkpoint
from qerl.pipeline.rl.logprobs import completion_logprobs
from qerl.pipeline.rl.objective import GRPOConfig, grpo_token_objective
from qerl.pipeline.rl.policy import init_state
from qerl.pipeline.rl.step import accumulate_gradients, step_context, train_step
from qerl.pipeline.rl.train_config import TrainConfig
from qerl.pipeline.rollout.aqn import apply_to_hf_model

TINY = dict(lora_r=4, lora_alpha=8, dtype="float32", max_grad_norm=1.0, seed=3)
PROMPTS = [[5, 17, 33, 40], [8, 9, 100]]
SIGMA, SEED = 0.05, 1234
CHOICES = ("clean_is", "on_policy", "noisy_trainer")


def _cfg(choice: str, train: dict | None = None, **grpo) -> TrainConfig:
    return TrainConfig(**{**TINY, **(train or {})}, grpo={"aqn_objective": choice, **grpo})


# ---------------------------------------------------------------- the objective on hand-made tensors


def test_on_policy_weights_by_the_noisy_reference_and_ratios_against_the_clean_one():
    """(a) One sequence, A = 1, dapo over 3 tokens. Clean old logprobs ``old``, the noisy trainer's
    ``noisy``, the sampler's ``s``; the live policy ``logp`` = old + log(1, 1.5, 0.9).
    rho = (1, 1.5, 0.9): token 1 is clipped at 1.28. TIS weight = min(noisy / s, 2) = (1.5, 2, 0.5),
    so the per-token losses are -(1 * 1.5, 1.28 * 2, 0.9 * 0.5) = -(1.5, 2.56, 0.45), mean -1.50333.
    The clean_is weight is min(old / s, 2) = (0.5, 2, 1): loss -(0.5 + 2.56 + 0.9) / 3 = -1.32."""
    old = torch.log(torch.tensor([[0.2, 0.4, 0.5]]))
    s = torch.log(torch.tensor([[0.4, 0.1, 0.5]]))
    noisy = torch.log(torch.tensor([[0.6, 0.3, 0.25]]))  # noisy / s = 1.5, 3 (capped at 2), 0.5
    logp = (old + torch.log(torch.tensor([[1.0, 1.5, 0.9]])).clone()).requires_grad_(True)
    mask, adv = torch.ones(1, 3), torch.tensor([1.0])
    cfg = GRPOConfig(aqn_objective="on_policy", dual_clip=None)
    loss, stats = grpo_token_objective(logp, s, adv, mask, cfg, old_logp=old, noisy_old_logp=noisy)
    assert loss.item() == pytest.approx(-(1.5 + 2.56 + 0.45) / 3, abs=1e-6)
    assert stats["ratio"] == pytest.approx(1 + 1.5 + 0.9, abs=1e-6) and stats["clip_high"] == 1
    # gradient: d/dlogp of -rho * A * w / 3 = -rho * w / 3 where unclipped, 0 where the clip binds
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-1.5 / 3, 0.0, -0.9 * 0.5 / 3]]), atol=1e-6)
    clean, _ = grpo_token_objective(logp, s, adv, mask, GRPOConfig(dual_clip=None), old_logp=old)
    assert clean.item() == pytest.approx(-(1 * 0.5 + 1.28 * 2 + 0.9 * 1) / 3, abs=1e-6)
    # the noisy reference is on_policy's only: elsewhere passing one is an error, not silently used
    with pytest.raises(ValueError, match="only used by grpo.aqn_objective=on_policy"):
        grpo_token_objective(logp, s, adv, mask, GRPOConfig(), old_logp=old, noisy_old_logp=noisy)


def test_config_checks_and_defaults():
    assert GRPOConfig().aqn_objective == "clean_is"
    with pytest.raises(ConfigError, match="aqn_objective=on_policy needs grpo.anchor: trainer"):
        load_config(GRPOConfig, overrides=["anchor=sampler", "tis_cap=null", "aqn_objective=on_policy"])
    with pytest.raises(ConfigError, match="aqn_objective"):
        load_config(GRPOConfig, overrides=["aqn_objective=noisy"])
    # noisy_trainer against the sampler: the noise is on both sides of the ratio, a coherent objective
    ok = load_config(GRPOConfig, overrides=["anchor=sampler", "tis_cap=null", "aqn_objective=noisy_trainer"])
    assert ok.aqn_objective == "noisy_trainer"
    # the paper's objective exactly: noisy samples on-policy, no correction at all
    assert GRPOConfig(aqn_objective="on_policy", tis_cap=None).tis_cap is None


# ---------------------------------------------------------------- one RL step on the tiny NVFP4 model


@pytest.fixture(scope="module")
def nvfp4_base(tiny_model_dir, tmp_path_factory) -> Path:
    from qerl.pipeline.nvfp4.recipe import QuantizeConfig
    from qerl.pipeline.store.artifact_store import ArtifactStore
    from qerl.stages.quantize import run as quantize

    return quantize(
        QuantizeConfig(), str(tiny_model_dir), ArtifactStore(tmp_path_factory.mktemp("store"))
    ).dir


def _nonzero_lora_b(state) -> None:
    with torch.no_grad():
        for n, p in state.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(n)))


def _norms(state) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in state.model.named_parameters() if "layernorm" in n}


def _lora(state) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in state.model.named_parameters() if p.requires_grad}


@torch.no_grad()
def _row_logprobs(model, batch: RolloutBatch) -> list[torch.Tensor]:
    """Each row's completion logprobs, the row alone in its minibatch."""
    n = len(batch)
    return [
        completion_logprobs(model, collate(batch, [r], torch.ones(n), 0), 1.0)[0][0, : len(c)]
        for r, c in enumerate(batch.completion_ids)
    ]


@torch.no_grad()
def _batch_logprobs(model, batch: RolloutBatch) -> list[torch.Tensor]:
    """Each row's completion logprobs from one minibatch of all rows (as ``step_context`` runs them)."""
    n = len(batch)
    lp, _ = completion_logprobs(model, collate(batch, list(range(n)), torch.ones(n), 0), 1.0)
    return [lp[r, : len(c)].clone() for r, c in enumerate(batch.completion_ids)]


def _batch(state, rewards, shift, sigma=SIGMA, lengths=(3, 4, 2, 3)) -> RolloutBatch:
    """Fixed completions; the sampler's logprobs are the trainer's *with the rollout's noise* plus
    ``shift(row, token)`` (what the engine's numerics add), recorded with sigma and the noise seed."""
    gen = torch.Generator().manual_seed(7)
    n = len(lengths)
    batch = RolloutBatch(
        prompt_ids=[PROMPTS[i % 2] for i in range(n)],
        completion_ids=[torch.randint(3, 200, (k,), generator=gen).tolist() for k in lengths],
        sampler_logprobs=[[0.0] * k for k in lengths],
        truncated=[False] * n,
        rewards=list(rewards),
        group_ids=[0] * n,
        sigma=sigma,
        noise_seed=SEED,
    )
    apply_to_hf_model(state.model, sigma, SEED)
    noisy = _row_logprobs(state.model, batch)
    apply_to_hf_model(state.model, 0.0, SEED)
    batch.sampler_logprobs = [
        [float(v) + shift(r, t) for t, v in enumerate(lp)] for r, lp in enumerate(noisy)
    ]
    return batch


REWARDS = [1.0, 0.0, 1.0, 0.0]


def _shift(r: int, t: int) -> float:
    return 0.3 * (t - 1) * (1 if r % 2 else -1)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_noisy_trainer_sees_the_rollouts_noise(nvfp4_base, dtype):
    """(c) The old logprobs are a separately noised copy's (same seed and sigma), not the clean
    trainer's, and so is the gradient; the model is clean again afterwards. On a bf16 trainer too
    (where the noise must not round away)."""
    cfg = _cfg("noisy_trainer", {"dtype": dtype})
    state = init_state(nvfp4_base, cfg)
    _nonzero_lora_b(state)
    batch = _batch(state, REWARDS, _shift)
    rows = list(range(len(batch)))
    clean_norms, clean_lp = _norms(state), _batch_logprobs(state.model, batch)
    ctx = step_context(state, batch, cfg, noise_fn=apply_to_hf_model)  # all rows in one no-grad pass
    assert all(torch.equal(p, clean_norms[n]) for n, p in _norms(state).items())  # noise removed

    copy = init_state(nvfp4_base, cfg)  # the same LoRA (seeded), noised for good
    _nonzero_lora_b(copy)
    apply_to_hf_model(copy.model, SIGMA, SEED)
    copy_lp = _batch_logprobs(copy.model, batch)
    for r in rows:
        assert torch.equal(ctx.old_logp[r], copy_lp[r]), r
    gap = max(float((ctx.old_logp[r] - clean_lp[r]).abs().max()) for r in rows)
    assert gap > 1e-3, f"the noise must move the trainer's logprobs (max |gap| {gap})"

    # its gradient is the noisy policy's: that of clean_is on the permanently noised copy
    def grads(s, c, fn):
        s.model.zero_grad(set_to_none=True)
        accumulate_gradients(s.model, step_context(s, batch, c, noise_fn=fn), [rows], c, {})
        return [p.grad.clone() for p in s.model.parameters() if p.requires_grad]

    noisy_g = grads(state, cfg, apply_to_hf_model)
    copy_g = grads(copy, _cfg("clean_is", {"dtype": dtype}), None)
    clean_g = grads(state, _cfg("clean_is", {"dtype": dtype}), None)
    assert all(torch.equal(a, b) for a, b in zip(noisy_g, copy_g, strict=True))
    assert max(float((a - b).abs().max()) for a, b in zip(noisy_g, clean_g, strict=True)) > 1e-5
    assert all(torch.equal(p, clean_norms[n]) for n, p in _norms(state).items())


def test_noisy_trainer_keeps_the_noise_through_a_recomputing_backward(nvfp4_base):
    """With gradient checkpointing the backward reruns the forward: it must see the same noise, so the
    gradient equals the one without checkpointing (and differs from the clean trainer's)."""

    def grads(checkpointing: bool, choice: str) -> list[torch.Tensor]:
        cfg = _cfg(choice, {"gradient_checkpointing": checkpointing})
        state = init_state(nvfp4_base, cfg)
        _nonzero_lora_b(state)
        batch = _batch(state, REWARDS, _shift)
        ctx = step_context(state, batch, cfg, noise_fn=apply_to_hf_model)
        accumulate_gradients(state.model, ctx, [list(range(len(batch)))], cfg, {})
        return [p.grad.clone() for p in state.model.parameters() if p.requires_grad]

    plain, recomputed = grads(False, "noisy_trainer"), grads(True, "noisy_trainer")
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(plain, recomputed, strict=True))
    clean = grads(True, "clean_is")
    assert max(float((a - b).abs().max()) for a, b in zip(recomputed, clean, strict=True)) > 1e-5


@pytest.mark.parametrize("choice", ["on_policy", "noisy_trainer"])
def test_tis_and_mismatch_measure_only_the_engine(nvfp4_base, choice):
    """(a) and (c): the sampler is the noisy trainer plus a known engine shift d(r, t). With one update
    the ratio is 1, so the dapo loss is -sum_r A_r sum_t min(exp(-d), 2) / tokens, and the mismatch
    metrics are those of d alone: hand-computed from d, independent of the noise. clean_is (b) sees
    the noise in both (its TIS reference is the clean trainer)."""
    cfg = _cfg(choice)
    state = init_state(nvfp4_base, cfg)
    _nonzero_lora_b(state)
    batch = _batch(state, REWARDS, _shift)
    a = 0.5 / (math.sqrt(1 / 3) + 1e-4)  # group [1, 0, 1, 0]: sample std sqrt(1/3)
    adv = [a if r else -a for r in REWARDS]
    d = [[_shift(r, t) for t in range(len(c))] for r, c in enumerate(batch.completion_ids)]
    flat = [x for row in d for x in row]
    want_loss = -sum(adv[r] * min(math.exp(-x), 2.0) for r, row in enumerate(d) for x in row) / len(flat)
    metrics = train_step(state, batch, cfg, noise_fn=apply_to_hf_model)
    assert metrics["updates"] == 1 and metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert metrics["loss"] == pytest.approx(want_loss, abs=1e-5)
    assert metrics["mismatch_abs"] == pytest.approx(sum(abs(x) for x in flat) / len(flat), abs=1e-5)
    k3 = sum(math.exp(-x) + x - 1 for x in flat) / len(flat)  # e^delta - delta - 1 with delta = -d
    assert metrics["mismatch_kl"] == pytest.approx(k3, abs=1e-5)
    assert metrics["tis_capped"] == pytest.approx(sum(math.exp(-x) > 2 for x in flat) / len(flat))

    clean = init_state(nvfp4_base, _cfg("clean_is"))
    _nonzero_lora_b(clean)
    b_metrics = train_step(clean, batch, _cfg("clean_is"), noise_fn=apply_to_hf_model)
    assert abs(b_metrics["mismatch_abs"] - metrics["mismatch_abs"]) > 1e-3
    assert abs(b_metrics["loss"] - want_loss) > 1e-4


def test_on_policy_gradient_is_the_clean_policys_with_an_engine_only_weight(nvfp4_base):
    """(a) equals clean_is on a sampler re-referenced by the noise's logprob shift: with
    s' = s - (noisy_old - clean_old), clean_is's weight old / s' is on_policy's noisy_old / s, and
    the ratio and gradient are the clean policy's in both."""
    cfg = _cfg("on_policy")
    state = init_state(nvfp4_base, cfg)
    _nonzero_lora_b(state)
    batch = _batch(state, REWARDS, _shift)
    clean_lp = _row_logprobs(state.model, batch)
    apply_to_hf_model(state.model, SIGMA, SEED)
    noisy_lp = _row_logprobs(state.model, batch)
    apply_to_hf_model(state.model, 0.0, SEED)
    shifted = RolloutBatch(**{**batch.__dict__, "sampler_logprobs": [
        [s - float(n - c) for s, n, c in zip(row, noisy_lp[r], clean_lp[r], strict=True)]
        for r, row in enumerate(batch.sampler_logprobs)
    ]})  # fmt: skip

    def grads(b, c):
        state.model.zero_grad(set_to_none=True)
        ctx = step_context(state, b, c, noise_fn=apply_to_hf_model)
        accumulate_gradients(state.model, ctx, [list(range(4))], c, {})
        return [p.grad.clone() for p in state.model.parameters() if p.requires_grad]

    a_g, ref_g = grads(batch, cfg), grads(shifted, _cfg("clean_is"))
    assert all(torch.allclose(x, y, atol=1e-6) for x, y in zip(a_g, ref_g, strict=True))
    b_g = grads(batch, _cfg("clean_is"))
    assert max(float((x - y).abs().max()) for x, y in zip(a_g, b_g, strict=True)) > 1e-5


def test_sigma_zero_makes_the_three_choices_one(nvfp4_base):
    """No noise: the same adapter bit for bit and the same metrics, and no norm weight is touched."""
    calls = []

    def spy(model, sigma, seed):
        calls.append(sigma)
        return apply_to_hf_model(model, sigma, seed)

    results = {}
    for choice in CHOICES:
        cfg = _cfg(choice, beta=0.05)  # the reference-KL pass too
        state = init_state(nvfp4_base, cfg)
        _nonzero_lora_b(state)
        batch = _batch(state, REWARDS, _shift, sigma=0.0)
        calls.clear()
        metrics = train_step(state, batch, cfg, noise_fn=spy)
        assert calls == [], choice
        metrics.pop("step_time_s")
        results[choice] = (_lora(state), metrics)
    base_lora, base_metrics = results["clean_is"]
    for choice in CHOICES[1:]:
        lora, metrics = results[choice]
        assert metrics == base_metrics, choice
        assert all(torch.equal(base_lora[n], p) for n, p in lora.items()), choice


def test_clean_is_never_touches_the_noise(nvfp4_base):
    """(b) is today's objective: on a noisy step it neither calls noise_fn nor needs a noise seed."""
    cfg = _cfg("clean_is")
    runs = []
    for fn in (None, lambda *a: pytest.fail("clean_is applied noise")):
        state = init_state(nvfp4_base, cfg)
        _nonzero_lora_b(state)
        batch = _batch(state, REWARDS, _shift)
        batch.noise_seed = None
        metrics = train_step(state, batch, cfg, noise_fn=fn)
        metrics.pop("step_time_s")
        runs.append((_lora(state), metrics))
    assert runs[0][1] == runs[1][1]
    assert all(torch.equal(runs[0][0][n], p) for n, p in runs[1][0].items())


def test_a_noisy_step_without_the_noise_is_an_error(nvfp4_base):
    state = init_state(nvfp4_base, _cfg("on_policy"))
    batch = _batch(state, REWARDS, _shift)
    with pytest.raises(ValueError, match="needs noise_fn"):
        train_step(state, batch, _cfg("on_policy"))
    batch.noise_seed = None
    with pytest.raises(ValueError, match="do not record one"):
        train_step(state, batch, _cfg("noisy_trainer"), noise_fn=apply_to_hf_model)


def _leaky(model, sigma, seed):
    """A broken noise function: applies noise but never restores (sigma 0 is ignored)."""
    if sigma > 0:
        apply_to_hf_model(model, sigma, seed)


@pytest.mark.parametrize("choice", ["on_policy", "noisy_trainer"])
def test_no_noise_survives_the_step(nvfp4_base, tmp_path, choice):
    """Two noisy steps in one process equal the first step, saved and reloaded, then the second: any
    noise left on the resident model would change the second step's adapter bytes. The norm check
    fails for a noise function that does not restore (so it can fail)."""
    # four updates a step (mu 2, minibatches of 2): old logprobs from the pre-update pass as well
    cfg = _cfg(choice, {"mu": 2, "minibatch_size": 2, "lr": 1e-2}, beta=0.05)
    state = init_state(nvfp4_base, cfg)
    clean_norms = _norms(state)
    first = _batch(state, REWARDS, _shift)
    second = _batch(state, [0.0, 1.0, 1.0, 0.0], _shift)
    second.noise_seed = SEED + 1
    train_step(state, first, cfg, noise_fn=apply_to_hf_model)
    assert all(torch.equal(p, clean_norms[n]) for n, p in _norms(state).items())
    save_checkpoint(state, tmp_path / "after-0")
    train_step(state, second, cfg, noise_fn=apply_to_hf_model)
    save_checkpoint(state, tmp_path / "resident")

    reloaded = load_checkpoint(nvfp4_base, cfg, tmp_path / "after-0")
    train_step(reloaded, second, cfg, noise_fn=apply_to_hf_model)
    save_checkpoint(reloaded, tmp_path / "reloaded")
    name = "adapter/adapter_model.safetensors"
    assert (tmp_path / "resident" / name).read_bytes() == (tmp_path / "reloaded" / name).read_bytes()

    leaky = init_state(nvfp4_base, cfg)
    train_step(leaky, first, cfg, noise_fn=_leaky)
    assert any(not torch.equal(p, clean_norms[n]) for n, p in _norms(leaky).items())


# ---------------------------------------------------------------- the rollouts table and the stage


def _table(batch: RolloutBatch, sigma, noise_seed) -> dict[str, list]:
    n = len(batch)
    return {
        "group_id": batch.group_ids,
        "prompt_ids": batch.prompt_ids,
        "completion_ids": batch.completion_ids,
        "logprobs": batch.sampler_logprobs,
        "finish_reason": ["stop"] * n,
        "reward": batch.rewards,
        "temperature": [1.0] * n,
        "sigma": sigma if isinstance(sigma, list) else [sigma] * n,
        "noise_seed": noise_seed if isinstance(noise_seed, list) else [noise_seed] * n,
    }


def test_load_rollout_batch_reads_the_steps_noise(tmp_path):
    batch = RolloutBatch([[1, 2]] * 2, [[3], [4, 5]], [[-0.1], [-0.2, -0.3]], [False] * 2, [1.0, 0.0], [0, 0])
    path = tmp_path / "scored.parquet"
    pq.write_table(pa.table(_table(batch, 0.01, 99)), path)
    got = load_rollout_batch(path)
    assert (got.sigma, got.noise_seed) == (0.01, 99)
    pq.write_table(pa.table(_table(batch, [0.01, 0.02], 99)), path)
    with pytest.raises(ValueError, match="different AQN sigmas"):
        load_rollout_batch(path)
    pq.write_table(pa.table(_table(batch, 0.01, [1, 2])), path)
    with pytest.raises(ValueError, match="different AQN noise_seeds"):
        load_rollout_batch(path)
    pq.write_table(
        pa.table({k: v for k, v in _table(batch, 0.0, 1).items() if k not in ("sigma", "noise_seed")}), path
    )
    got = load_rollout_batch(path)
    assert (got.sigma, got.noise_seed) == (0.0, None)


def test_the_rollout_table_records_the_noise_seed():
    from qerl.stages import rollout

    assert rollout.SCHEMA.field("noise_seed").type == pa.int64()


def test_train_stage_keys_and_records_the_choice(nvfp4_base, tmp_path):
    from qerl.pipeline.store.artifact_store import ArtifactStore
    from qerl.pipeline.store.manifest import BuildResult, Manifest
    from qerl.stages.train import drop_resident_policy, run

    store = ArtifactStore(tmp_path / "store")
    base = Manifest.load(nvfp4_base)
    state = init_state(nvfp4_base, _cfg("clean_is"))
    batch = _batch(state, REWARDS, _shift)

    def build(tmp):
        pq.write_table(pa.table(_table(batch, SIGMA, SEED)), tmp / "scored.parquet")
        return BuildResult()

    scored = store.produce("score", {"tag": "aqn"}, {}, "test", build)[0]
    made = {}
    try:
        for choice in CHOICES:
            made[choice] = run(cfg=_cfg(choice), base=base, scored=scored, prev=None, step=0, store=store)
    finally:
        drop_resident_policy()
    assert len({m.key for m in made.values()}) == 3
    where = {"clean_is": "none", "on_policy": "tis-reference", "noisy_trainer": "forward"}
    for choice, m in made.items():
        assert m.extra["aqn"] == {
            "objective": choice, "sigma": SIGMA, "noise_seed": SEED, "trainer_noise": where[choice]
        }  # fmt: skip
        assert m.config["train"]["grpo"]["aqn_objective"] == choice


def test_a_noise_free_step_is_one_checkpoint_for_every_choice(nvfp4_base, tmp_path):
    """Keyed by the scored rollouts' ``aqn_sigma``: at 0 the three choices are one update, so arms
    that differ only in the objective share AQN's noise-free stage; a noisy step keeps them apart."""
    from qerl.pipeline.store.artifact_store import ArtifactStore
    from qerl.pipeline.store.manifest import BuildResult, Manifest
    from qerl.stages.train import drop_resident_policy, run

    store = ArtifactStore(tmp_path / "store")
    base = Manifest.load(nvfp4_base)
    batch = _batch(init_state(nvfp4_base, _cfg("clean_is")), REWARDS, _shift, sigma=0.0)

    def build(tmp):
        pq.write_table(pa.table(_table(batch, 0.0, SEED)), tmp / "scored.parquet")
        return BuildResult(metrics={"aqn_sigma": 0.0})

    scored = store.produce("score", {"tag": "noise-free"}, {}, "test", build)[0]
    try:
        made = [run(cfg=_cfg(c), base=base, scored=scored, prev=None, step=0, store=store) for c in CHOICES]
    finally:
        drop_resident_policy()
    assert len({m.key for m in made}) == 1
