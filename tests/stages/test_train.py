"""LoRA GRPO training: gradient properties, accumulation, bit-exact resume, skipping, learning."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from qerl.pipeline.rl.batch import RolloutBatch, load_rollout_batch
from qerl.pipeline.rl.checkpoint import load_checkpoint, save_checkpoint
from qerl.pipeline.rl.policy import init_state
from qerl.pipeline.rl.step import accumulate_gradients, step_context, train_step
from qerl.pipeline.rl.train_config import TrainConfig
from safetensors.torch import load_file

TINY = dict(lora_r=4, lora_alpha=8, dtype="float32", max_grad_norm=1.0, seed=3)


@pytest.fixture(scope="module")
def nvfp4_base(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model quantized by the real quantize stage: training runs on packed NVFP4 weights."""
    from qerl.pipeline.nvfp4.recipe import QuantizeConfig
    from qerl.pipeline.store.artifact_store import ArtifactStore
    from qerl.stages.quantize import run as quantize

    store = ArtifactStore(tmp_path_factory.mktemp("store"))
    return quantize(QuantizeConfig(), str(tiny_model_dir), store).dir


@torch.no_grad()
def sample_batch(model, prompts, group, max_new, seed, reward_fn, temperature=1.0, eos=None) -> RolloutBatch:
    """Plain torch ancestral sampling, a prompt's group in one batch; records log_softmax(logits/T)."""
    gen = torch.Generator().manual_seed(seed)
    model.eval()
    out = dict(prompt_ids=[], completion_ids=[], sampler_logprobs=[], truncated=[], rewards=[], group_ids=[])
    for g, prompt in enumerate(prompts):
        ids = torch.tensor([prompt] * group)
        comps, lps = [[] for _ in range(group)], [[] for _ in range(group)]
        done = [False] * group
        for _ in range(max_new):
            logp = torch.log_softmax(model(input_ids=ids).logits[:, -1].float() / temperature, -1)
            tok = torch.multinomial(logp.exp(), 1, generator=gen)
            ids = torch.cat([ids, tok], dim=1)
            for r in range(group):
                if not done[r]:
                    comps[r].append(int(tok[r]))
                    lps[r].append(float(logp[r, tok[r]]))
                    done[r] = int(tok[r]) == eos
            if all(done):
                break
        for r in range(group):
            out["prompt_ids"].append(list(prompt))
            out["completion_ids"].append(comps[r])
            out["sampler_logprobs"].append(lps[r])
            out["truncated"].append(not done[r] and eos is not None)
            out["rewards"].append(float(reward_fn(comps[r])))
            out["group_ids"].append(g)
    model.train()
    return RolloutBatch(**out)


def lora_tensors(state) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in state.model.named_parameters() if p.requires_grad}


PROMPTS = [[5, 17, 33, 40], [8, 9, 100]]


def test_equal_rewards_give_zero_gradient(nvfp4_base):
    cfg = TrainConfig(**TINY)
    state = init_state(nvfp4_base, cfg)
    batch = sample_batch(state.model, PROMPTS, 3, 4, 0, lambda c: 1.0)
    # make lora_B non-zero so a non-zero advantage would reach every LoRA tensor
    with torch.no_grad():
        for n, p in state.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    ctx = step_context(state, batch, cfg)
    accumulate_gradients(
        state.model,
        ctx,
        [list(range(len(batch)))],
        cfg,
        dict.fromkeys(["tokens", "clip_low", "clip_high", "kl", "ratio", "entropy"], 0.0),
    )
    grads = [p.grad for p in state.model.parameters() if p.requires_grad]
    assert grads and all(g is not None and torch.count_nonzero(g) == 0 for g in grads)
    before = lora_tensors(state)
    state.model.zero_grad(set_to_none=True)
    metrics = train_step(state, batch, cfg)
    assert metrics["grad_norm"] == 0.0 and not metrics["skipped"]
    # advantage 0 everywhere still trains tokens (with zero weight): entropy and mismatch are measured
    assert metrics["tokens_trained"] > 0 and metrics["entropy"] > 0.0 and metrics["mismatch_kl"] is not None
    assert all(torch.equal(before[n], p) for n, p in lora_tensors(state).items())
    # and a non-equal group does produce gradient (the test above can fail)
    batch.rewards[0] = 0.0
    state.model.zero_grad(set_to_none=True)
    accumulate_gradients(
        state.model,
        step_context(state, batch, cfg),
        [list(range(len(batch)))],
        cfg,
        dict.fromkeys(["tokens", "clip_low", "clip_high", "kl", "ratio", "entropy"], 0.0),
    )
    assert any(torch.count_nonzero(p.grad) > 0 for p in state.model.parameters() if p.requires_grad)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_batch_times_accumulation_equivalence(nvfp4_base, loss_type):
    base_cfg = TrainConfig(**TINY, grpo={"loss_type": loss_type})
    state = init_state(nvfp4_base, base_cfg)
    with torch.no_grad():
        for n, p in state.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    batch = sample_batch(state.model, PROMPTS, 3, 5, 1, lambda c: c[0] % 3)
    ctx = step_context(state, batch, base_cfg)
    rows = list(range(len(batch)))

    def grads(split):
        state.model.zero_grad(set_to_none=True)
        sums = dict.fromkeys(["tokens", "clip_low", "clip_high", "kl", "ratio", "entropy"], 0.0)
        loss, _ = accumulate_gradients(state.model, ctx, split, base_cfg, sums)
        return loss, [p.grad.clone() for p in state.model.parameters() if p.requires_grad]

    loss_one, g_one = grads([rows])
    loss_acc, g_acc = grads([rows[:2], rows[2:4], rows[4:]])
    assert loss_one == pytest.approx(loss_acc, abs=1e-6)
    assert max(float((a - b).abs().max()) for a, b in zip(g_one, g_acc, strict=True)) < 1e-6
    assert max(float(a.abs().max()) for a in g_one) > 1e-4  # a non-trivial gradient was compared


def test_resume_is_bit_identical(nvfp4_base, tmp_path):
    check_resume_is_bit_identical(nvfp4_base, nvfp4_base, tmp_path)


def check_resume_is_bit_identical(base: Path, sampler_base: Path, tmp_path: Path) -> None:
    """Four steps in one go and two + checkpoint + two on ``base`` give the same bytes (adapter,
    optimizer, schedule, RNG); the batches are sampled from ``sampler_base``."""
    # dropout on so the restored RNG state matters; mu 2 over minibatches of 3 (four updates per step,
    # so half the samples take their old logprobs from the no-grad pass before the first update, which
    # draws dropout masks too), warmup + cosine
    cfg = TrainConfig(
        **TINY, lora_dropout=0.1, lr=5e-3, minibatch_size=3, mu=2, warmup_steps=2, total_steps=16
    )
    sampler = init_state(sampler_base, cfg)
    batches = [sample_batch(sampler.model, PROMPTS, 3, 4, s, lambda c: c[-1] % 2) for s in range(4)]
    nvfp4_base = base

    one_go = init_state(nvfp4_base, cfg)
    for b in batches:
        train_step(one_go, b, cfg)
    save_checkpoint(one_go, tmp_path / "a")

    first = init_state(nvfp4_base, cfg)
    for b in batches[:2]:
        train_step(first, b, cfg)
    save_checkpoint(first, tmp_path / "mid")
    del first
    resumed = load_checkpoint(nvfp4_base, cfg, tmp_path / "mid")
    assert resumed.step == 2 and resumed.updates == 8 and resumed.scheduler.last_epoch == 8
    for b in batches[2:]:
        train_step(resumed, b, cfg)
    save_checkpoint(resumed, tmp_path / "b")

    a = load_file(tmp_path / "a" / "adapter" / "adapter_model.safetensors")
    b = load_file(tmp_path / "b" / "adapter" / "adapter_model.safetensors")
    mid = load_file(tmp_path / "mid" / "adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], mid[k]) for k in a)  # steps 3-4 did change the adapter
    oa, ob = (load_file(tmp_path / d / "optimizer.safetensors") for d in ("a", "b"))
    assert all(torch.equal(oa[k], ob[k]) for k in oa)
    sa, sb = (json.loads((tmp_path / d / "trainer_state.json").read_text()) for d in ("a", "b"))
    assert sa["scheduler"] == sb["scheduler"] and sa["rng"] == sb["rng"] and sa["step"] == 4


def test_non_finite_update_is_skipped(nvfp4_base):
    cfg = TrainConfig(**TINY, lr=1e-2)
    state = init_state(nvfp4_base, cfg)
    batch = sample_batch(state.model, PROMPTS, 3, 3, 2, lambda c: c[0] % 2)
    batch.rewards[1] = float("nan")
    before = lora_tensors(state)
    metrics = train_step(state, batch, cfg)
    assert metrics["skipped"] and metrics["skipped_updates"] == 1 and metrics["updates"] == 0
    assert all(torch.equal(before[n], p) for n, p in lora_tensors(state).items())
    assert not state.optimizer.state and state.scheduler.last_epoch == 0
    batch.rewards[1] = 1.0
    metrics = train_step(state, batch, cfg)
    assert not metrics["skipped"] and metrics["updates"] == 1


def test_truncated_completions_are_masked(nvfp4_base):
    cfg = TrainConfig(**TINY)
    state = init_state(nvfp4_base, cfg)
    batch = sample_batch(state.model, PROMPTS[:1], 4, 3, 4, lambda c: c[0] % 2)
    batch.truncated = [True, True, True, True]
    metrics = train_step(state, batch, cfg)
    assert metrics["tokens_trained"] == 0 and metrics["grad_norm"] == 0.0 and metrics["frac_truncated"] == 1.0
    # no token trained: the per-token means are undefined (None, JSON null), not a placeholder 0 that a
    # curve or an ablation's early-entropy average would read as a collapsed policy (issue 13)
    from qerl.pipeline.rl.step import TOKEN_MEAN_METRICS

    assert {k: metrics[k] for k in TOKEN_MEAN_METRICS} == dict.fromkeys(TOKEN_MEAN_METRICS)
    assert "entropy" in TOKEN_MEAN_METRICS and "mismatch_kl" in TOKEN_MEAN_METRICS


@pytest.mark.slow  # ~15 s on an idle 2-core machine, over a minute under load
def test_reward_rises_on_a_tiny_task(nvfp4_base):
    # reward: the first completion token has an even id. The exact expected reward is the policy's
    # probability mass on even ids at the first position, computed from the logits (no sampling noise).
    # The random tiny model's small lm_head caps it near 0.64 (|h| ~ 11 after the final norm times the
    # 0.05-scale even-minus-odd mean row), so a rise of 0.05 from 0.5 is a good part of what is reachable.
    cfg = TrainConfig(**{**TINY, "lr": 5e-2, "lora_r": 8, "minibatch_size": 8, "total_steps": 100})
    state = init_state(nvfp4_base, cfg)

    @torch.no_grad()
    def expected_reward():
        state.model.eval()
        p = [
            torch.softmax(state.model(input_ids=torch.tensor([q])).logits[0, -1].float(), -1)[0::2].sum()
            for q in PROMPTS
        ]
        state.model.train()
        return float(sum(p) / len(p))

    start = expected_reward()
    for step in range(8):
        batch = sample_batch(state.model, PROMPTS, 8, 1, 100 + step, lambda c: float(c[0] % 2 == 0))
        metrics = train_step(state, batch, cfg)
        assert not metrics["skipped"]
    end = expected_reward()
    assert end > start + 0.05, (start, end)


def test_load_rollout_batch_checks_rows(tmp_path):
    rows = {
        "group_id": [0, 0],
        "prompt_ids": [[1, 2], [1, 2]],
        "completion_ids": [[3, 4], [5]],
        "logprobs": [[-0.1, -0.2], [-0.3, -0.4]],
        "finish_reason": ["stop", "length"],
        "reward": [1.0, 0.0],
        "temperature": [1.0, 1.0],
    }
    path = tmp_path / "scored.parquet"
    pq.write_table(pa.table(rows), path)
    with pytest.raises(ValueError, match="row 1 has 1 completion ids but 2 logprobs"):
        load_rollout_batch(path)
    rows["logprobs"][1] = [-0.3]
    pq.write_table(pa.table(rows), path)
    batch = load_rollout_batch(path, temperature=1.0)
    assert batch.truncated == [False, True] and len(batch) == 2
    with pytest.raises(ValueError, match="temperature"):
        load_rollout_batch(path, temperature=0.7)


def _scored_manifest(store, batch: RolloutBatch, tag: str):
    """A 'score' artifact holding ``batch`` as scored.parquet (the columns the train stage reads)."""
    from qerl.pipeline.store.manifest import BuildResult

    def build(tmp):
        n = len(batch)
        table = {
            "prompt_id": [f"p{g}" for g in batch.group_ids],
            "group_id": batch.group_ids,
            "sample_idx": list(range(n)),
            "prompt_ids": batch.prompt_ids,
            "completion_ids": batch.completion_ids,
            "logprobs": batch.sampler_logprobs,
            "finish_reason": ["length" if t else "stop" for t in batch.truncated],
            "reward": batch.rewards,
            "temperature": [1.0] * n,
        }
        pq.write_table(pa.table(table), tmp / "scored.parquet")
        return BuildResult()

    return store.produce("score", {"tag": tag}, {}, "test", build)[0]


def test_train_stage_chains_and_caches(nvfp4_base, tmp_path):
    from qerl.pipeline.store.artifact_store import ArtifactStore
    from qerl.pipeline.store.manifest import ArtifactError, Manifest
    from qerl.stages.train import run

    store = ArtifactStore(tmp_path / "store")
    base = Manifest.load(nvfp4_base)
    cfg = TrainConfig(**TINY, lr=1e-2)
    sampler = init_state(nvfp4_base, cfg)
    batches = [sample_batch(sampler.model, PROMPTS, 3, 3, 10 + s, lambda c: c[0] % 2) for s in range(2)]
    scored = [_scored_manifest(store, b, f"s{i}") for i, b in enumerate(batches)]

    m0 = run(cfg=cfg, base=base, scored=scored[0], prev=None, step=0, store=store)
    m1 = run(cfg=cfg, base=base, scored=scored[1], prev=m0, step=1, store=store)
    assert m1.mode == "nvfp4-torch-reference" and m1.extra["steps_done"] == 2
    assert {
        "adapter/adapter_config.json",
        "adapter/adapter_model.safetensors",
        "optimizer.safetensors",
        "trainer_state.json",
    } <= set(m1.files)
    for key in (
        "loss",
        "grad_norm",
        "clip_frac_low",
        "clip_frac_high",
        "entropy",
        "kl",
        "reward_mean",
        "tokens",
        "lr",
        "skipped",
        "step_time_s",
    ):
        assert key in m1.metrics, key
    assert (
        run(cfg=cfg, base=base, scored=scored[1], prev=m0, step=1, store=store).path == m1.path
    )  # cached: same artifact
    with pytest.raises(ArtifactError, match="after 1 steps"):
        run(cfg=cfg, base=base, scored=scored[1], prev=m0, step=2, store=store)

    # the stage's chained checkpoints equal two steps in one process
    from qerl.pipeline.runtime.threads import trainer_threads
    from qerl.stages.train import _pad_id

    direct = init_state(nvfp4_base, cfg)
    # the stage's threading (MKL/OpenMP as in a fresh process): MKL's thread split changes the bits,
    # and this test process may have called torch.set_num_threads before
    with trainer_threads("cpu"):
        for b in batches:
            train_step(direct, b, cfg, pad_id=_pad_id(nvfp4_base))
    save_checkpoint(direct, tmp_path / "direct")
    a = load_file(m1.file("adapter/adapter_model.safetensors"))
    b = load_file(tmp_path / "direct" / "adapter" / "adapter_model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_token_logprobs_equal_plain_log_softmax(dtype, bias):
    """The slab-wise lm_head + logprob/entropy Function gives the plain expression's values and gradients."""
    from qerl.pipeline.rl.logprobs import _TokenLogprobs

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 11, 16, generator=g).to(dtype)
    weight = (torch.randn(300, 16, generator=g) * 0.8).to(dtype)
    b_ = (torch.randn(300, generator=g) * 0.1).to(dtype) if bias else None
    targets = torch.randint(0, 300, (3, 11), generator=g)
    weights = torch.randn(3, 11, generator=g)
    a, b = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    lsm = torch.log_softmax(torch.nn.functional.linear(a, weight, b_).float() / 0.7, dim=-1)
    lp_ref = lsm.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent_ref = -(lsm.detach().exp() * lsm.detach()).sum(-1)
    (lp_ref * weights).sum().backward()
    lp, ent = _TokenLogprobs.apply(b, weight, b_, targets, 0.7, True, 300 * 4)  # slabs of 4 positions
    (lp * weights).sum().backward()
    assert torch.equal(lp, lp_ref)
    if dtype == torch.bfloat16:  # the gradient's rounding to bf16 absorbs the matmul's blocking
        assert torch.equal(a.grad, b.grad)
    else:
        assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-7)
    # entropy is a metric: the float32 reduction over a slab may differ from the whole tensor's in the last bit
    assert torch.allclose(ent, ent_ref, rtol=1e-6, atol=0) and not ent.requires_grad


def _two_sample_minibatch() -> dict[str, torch.Tensor]:
    """Two samples with prompts and completions of different lengths, collated with padding."""
    from qerl.pipeline.rl.batch import collate

    batch = RolloutBatch(
        prompt_ids=[[5, 6, 7], [8, 9]],
        completion_ids=[[10, 11, 12, 13], [14, 15]],
        sampler_logprobs=[[0.0] * 4, [0.0] * 2],
        truncated=[False, False],
        rewards=[1.0, 0.0],
        group_ids=[0, 0],
    )
    return collate(batch, [0, 1], torch.ones(2), 0)


def test_completion_logprobs_equal_the_full_logits_path(tiny_model_dir):
    """Decoder + fused head give what ``model(...).logits`` gives: values and every gradient."""
    from qerl.pipeline.rl.logprobs import completion_logprobs
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    mb = _two_sample_minibatch()
    logp, _ = completion_logprobs(model, mb, 0.7)
    (logp * torch.linspace(-1, 1, logp.numel()).view(logp.shape)).sum().backward()
    ours = {n: p.grad for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    full = model(
        input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], position_ids=mb["position_ids"]
    ).logits
    ref = torch.log_softmax(full[:, -5:-1].float() / 0.7, -1).gather(-1, mb["completion_ids"].unsqueeze(-1))
    (ref.squeeze(-1) * torch.linspace(-1, 1, logp.numel()).view(logp.shape)).sum().backward()
    assert torch.allclose(logp, ref.squeeze(-1), atol=1e-6)
    # every parameter, the (trainable, here) lm_head and the layers below it alike
    for name, p in model.named_parameters():
        assert torch.allclose(ours[name], p.grad, rtol=1e-4, atol=1e-6), name


def test_lora_on_lm_head_or_embeddings_is_rejected():
    for module in ("lm_head", "embed_tokens"):
        with pytest.raises(ValueError, match=module):
            TrainConfig(target_modules=("q_proj", module))


def test_lora_autocast_computes_the_adapter_in_the_base_dtype(tiny_model_dir):
    """Autocast LoRA gives exactly what the same adapter stored in bf16 gives (vLLM's precision), and
    its fp32 master weights still receive fp32 gradients; ``lora_autocast=False`` is peft's fp32 path."""
    import copy

    from peft import LoraConfig, get_peft_model
    from qerl.pipeline.rl.logprobs import completion_logprobs
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).requires_grad_(False)
    torch.manual_seed(0)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"], init_lora_weights=False)
    model = get_peft_model(base, lora)  # LoRA weights in fp32 (peft upcasts adapters)
    stored_bf16 = copy.deepcopy(model)
    for name, p in stored_bf16.named_parameters():
        if "lora_" in name:
            p.data = p.data.to(torch.bfloat16)
    mb = _two_sample_minibatch()
    mixed, _ = completion_logprobs(model, mb, 0.7)
    mixed.sum().backward()
    with torch.no_grad():
        reference, _ = completion_logprobs(stored_bf16, mb, 0.7, lora_autocast=False)
        full_fp32, _ = completion_logprobs(model, mb, 0.7, lora_autocast=False)
    assert torch.equal(mixed, reference)
    assert not torch.equal(mixed, full_fp32)
    assert torch.allclose(mixed, full_fp32, atol=0.1)
    grads = [p.grad for n, p in model.named_parameters() if "lora_" in n]
    assert grads and all(g is not None and g.dtype == torch.float32 and g.abs().sum() > 0 for g in grads)


# -- old logprobs, the trainer anchor, masked rows, device settings (issue 15: items 3, 5, 8, 10) -----


def _handmade_batch(state, lengths, rewards, groups=None, shift=None, truncated=None) -> RolloutBatch:
    """Completions of the given lengths (fixed ids); the sampler's logprobs are the policy's own (each
    row computed alone) plus ``shift(row, token)``, the way a noisy (AQN) sampler would differ."""
    from qerl.pipeline.rl.batch import collate
    from qerl.pipeline.rl.logprobs import completion_logprobs

    gen = torch.Generator().manual_seed(7)
    n = len(lengths)
    batch = RolloutBatch(
        prompt_ids=[PROMPTS[i % 2] for i in range(n)],
        completion_ids=[torch.randint(3, 200, (k,), generator=gen).tolist() for k in lengths],
        sampler_logprobs=[[0.0] * k for k in lengths],
        truncated=list(truncated or [False] * n),
        rewards=list(rewards),
        group_ids=list(groups or [0] * n),
    )
    with torch.no_grad():
        for r in range(n):
            lp, _ = completion_logprobs(state.model, collate(batch, [r], torch.ones(n), 0), 1.0)
            batch.sampler_logprobs[r] = [
                float(lp[0, t]) + (shift(r, t) if shift else 0.0) for t in range(lengths[r])
            ]
    return batch


def _nonzero_lora_b(state) -> None:
    with torch.no_grad():
        for n, p in state.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(n)))


def test_tis_with_reshuffled_minibatches_of_other_widths(nvfp4_base, monkeypatch):
    """Issue item 3: 4 rows of different lengths in minibatches of 2 over mu = 2 passes (reshuffled, so
    a row lands in minibatches of other padded widths); with TIS on (the default). Every minibatch's
    old logprobs must be the step-start policy's, row by row, not the current one's."""
    import qerl.pipeline.rl.step as rl_step

    cfg = TrainConfig(**TINY, lr=5e-2, minibatch_size=2, mu=2, grpo={"tis_cap": 2.0})
    state = init_state(nvfp4_base, cfg)
    _nonzero_lora_b(state)
    batch = _handmade_batch(state, [5, 1, 4, 2], [1.0, 0.0, 0.0, 1.0], shift=lambda r, t: 0.05 * (t - 1))
    start = [
        torch.tensor(lp) - torch.tensor([0.05 * (t - 1) for t in range(len(lp))])
        for lp in batch.sampler_logprobs
    ]

    seen = []
    original = rl_step._scatter_old

    def spy(ctx, rows, logp):
        old = original(ctx, rows, logp)
        seen.append((list(rows), old.detach().clone(), logp.detach().clone()))
        return old

    monkeypatch.setattr(rl_step, "_scatter_old", spy)
    metrics = train_step(state, batch, cfg)
    assert metrics["updates"] == 4 and not metrics["skipped"]
    assert len(seen) == 4 and {len({*r}) for r, _, _ in seen} == {2}
    for rows, old, _ in seen:
        for b, r in enumerate(rows):
            k = len(batch.completion_ids[r])
            assert torch.allclose(old[b, :k], start[r], atol=1e-5), (r, old[b, :k], start[r])
    # the later minibatches ran on moved parameters: their own logprobs differ from the anchor
    rows, old, logp = seen[-1]
    k = [len(batch.completion_ids[r]) for r in rows]
    assert max(float((old[b, : k[b]] - logp[b, : k[b]]).abs().max()) for b in range(len(rows))) > 1e-3
    # the mismatch metrics see the 0.05 * (t - 1) shifts: mean |shift| over the 12 tokens
    shifts = [abs(0.05 * (t - 1)) for k in (5, 1, 4, 2) for t in range(k)]
    assert metrics["mismatch_abs"] == pytest.approx(sum(shifts) / 12, abs=1e-5)


def test_default_anchor_trains_tokens_an_aqn_sampler_disagrees_on(nvfp4_base):
    """Issue item 5: the sampler's logprobs are off by 1 nat on every token, in the direction the
    clip cuts (lower where A > 0: trainer/sampler = e > 1.28; higher where A < 0: 1/e < 0.8). With the
    default config those tokens are trained (TIS-weighted); with the old sampler anchor the whole
    gradient is exactly zero, so the noise acted as clipping."""
    cfg = TrainConfig(**TINY)
    state = init_state(nvfp4_base, cfg)
    _nonzero_lora_b(state)
    rewards = [1.0, 0.0, 1.0, 0.0]
    batch = _handmade_batch(state, [3, 4, 2, 3], rewards, shift=lambda r, t: -1.0 if rewards[r] else 1.0)
    totals: dict[str, float] = {}

    def grads(c: TrainConfig) -> list[torch.Tensor]:
        state.model.zero_grad(set_to_none=True)
        accumulate_gradients(state.model, step_context(state, batch, c), [list(range(4))], c, totals)
        return [p.grad for p in state.model.parameters() if p.requires_grad]

    old = grads(TrainConfig(**TINY, grpo={"anchor": "sampler", "tis_cap": None, "dual_clip": None}))
    assert all(g is not None and torch.count_nonzero(g) == 0 for g in old)
    new = grads(cfg)
    assert max(float(g.abs().max()) for g in new) > 1e-4

    before = lora_tensors(state)
    metrics = train_step(state, batch, cfg)
    assert metrics["grad_norm"] > 0 and any(
        not torch.equal(before[n], p) for n, p in lora_tensors(state).items()
    )
    # mismatch over the 12 tokens: |delta| = 1 everywhere, all outside the clip range; TIS binds where
    # trainer/sampler = e > 2 (the 5 tokens of the A > 0 rows); k3 = e^d - d - 1: e - 2 (5) and 1/e (7)
    assert metrics["mismatch_abs"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["mismatch_out"] == 1.0 and metrics["tis_capped"] == pytest.approx(5 / 12)
    assert metrics["mismatch_kl"] == pytest.approx((5 * (math.e - 2) + 7 / math.e) / 12, abs=1e-4)
    assert metrics["clip_frac_high"] == 0.0 and metrics["clip_frac_low"] == 0.0  # rho = 1 on the first update


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "bnpo", "dr_grpo"])
def test_a_truncated_row_is_a_dropped_sample(nvfp4_base, loss_type):
    """Issue item 8: adding a truncated (fully masked) row, in a group of its own, leaves the grpo,
    dapo and bnpo gradients as they were; dr_grpo's constant normaliser counts it (rows x max_len)."""
    cfg = TrainConfig(**TINY, grpo={"loss_type": loss_type, "max_completion_length": 6})
    state = init_state(nvfp4_base, cfg)
    _nonzero_lora_b(state)
    kept = _handmade_batch(state, [3, 4, 2, 5], [1.0, 0.0, 0.0, 1.0], shift=lambda r, t: 0.1)
    extra = _handmade_batch(
        state,
        [3, 4, 2, 5, 6],
        [1.0, 0.0, 0.0, 1.0, 1.0],
        [0, 0, 0, 0, 9],
        lambda r, t: 0.1,
        [False] * 4 + [True],
    )

    def grads(batch: RolloutBatch) -> list[torch.Tensor]:
        state.model.zero_grad(set_to_none=True)
        ctx = step_context(state, batch, cfg)
        accumulate_gradients(state.model, ctx, [list(range(len(batch)))], cfg, {})
        return [p.grad.clone() for p in state.model.parameters() if p.requires_grad]

    g4, g5 = grads(kept), grads(extra)
    scale = 4 / 5 if loss_type == "dr_grpo" else 1.0
    assert max(float(a.abs().max()) for a in g4) > 1e-4
    assert max(float((b - scale * a).abs().max()) for a, b in zip(g4, g5, strict=True)) < 1e-6


def test_device_settings_are_chosen_by_device_type():
    """Issue item 10: the CPU keeps its memory-bounding settings; CUDA gets large slabs, whole-layer
    decode and fused AdamW (the CUDA path itself runs in tests/gpu/test_gpu.py on a GPU machine)."""
    from qerl.pipeline.nvfp4.linear import CHUNK_ELEMENTS, CHUNK_ELEMENTS_CUDA, slice_elements
    from qerl.pipeline.rl.checkpoint import _with_impl
    from qerl.pipeline.rl.logprobs import (
        LOGPROB_CHUNK_ELEMENTS,
        LOGPROB_CHUNK_ELEMENTS_CUDA,
        logprob_chunk_elements,
    )
    from qerl.pipeline.rl.policy import optimizer_impl

    assert logprob_chunk_elements("cpu") == LOGPROB_CHUNK_ELEMENTS == 1 << 21
    assert logprob_chunk_elements(torch.device("cuda", 1)) == LOGPROB_CHUNK_ELEMENTS_CUDA == 1 << 26
    assert slice_elements("cpu") == CHUNK_ELEMENTS and slice_elements("cuda:0") == CHUNK_ELEMENTS_CUDA
    # every projection of a 72B Qwen2.5 decodes in one piece on CUDA
    assert 29568 * 8192 <= CHUNK_ELEMENTS_CUDA and 18944 * 3584 > CHUNK_ELEMENTS
    assert optimizer_impl("cpu") == {"foreach": False} and optimizer_impl("cuda") == {"fused": True}
    # a checkpoint's param groups take the loading device's switches
    saved = [{"lr": 1e-5, "fused": True, "foreach": None, "params": [0]}]
    assert _with_impl(saved, "cpu") == [{"lr": 1e-5, "fused": None, "foreach": False, "params": [0]}]
    assert _with_impl(saved, "cuda")[0]["fused"] is True


def test_cpu_policy_uses_the_cpu_settings(nvfp4_base, monkeypatch):
    import qerl.pipeline.rl.batch as rl_batch
    import qerl.pipeline.rl.logprobs as logprobs

    cfg = TrainConfig(**TINY)
    state = init_state(nvfp4_base, cfg)
    group = state.optimizer.param_groups[0]
    assert group["foreach"] is False and not group["fused"]
    mb = rl_batch.collate(_handmade_batch(state, [2], [1.0]), [0], torch.ones(1), 0)
    asked = []

    def chunk(device):
        asked.append(torch.device(device).type)
        return 1 << 21

    monkeypatch.setattr(logprobs, "logprob_chunk_elements", chunk)
    logprobs.completion_logprobs(state.model, mb, 1.0)
    assert asked == ["cpu"]


def test_the_no_grad_passes_measure_without_dropout(nvfp4_base):
    """Old logprobs and the reference pass run in eval mode: with LoRA dropout on they are the same
    on every call (a dropout mask would make each differ), leave the global RNG alone, and the model
    is back in train mode after them."""
    from qerl.pipeline.rl.step import _old_logprobs

    cfg = TrainConfig(**{**TINY, "lora_dropout": 0.5})
    state = init_state(nvfp4_base, cfg)
    with torch.no_grad():
        for n, p in state.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)  # the adapter path (where dropout acts) changes the logits
    batch = sample_batch(state.model, PROMPTS, 2, 4, 0, lambda c: 1.0)
    rows, mask = list(range(len(batch))), torch.ones(len(batch))
    rng = torch.get_rng_state()
    first = _old_logprobs(state.model, batch, rows, cfg, 0, mask)
    again = _old_logprobs(state.model, batch, rows, cfg, 0, mask)
    assert torch.equal(torch.get_rng_state(), rng) and state.model.training
    assert all(torch.equal(first[r], again[r]) for r in rows)
