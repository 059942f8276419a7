"""quantize.method rtn | mse | gptq: scale search against a slow reference, GPTQ against RTN and a plain
column-by-column GPTQ, sequential calibration through the stage, cache keys and calibration errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from qerl.kernels.nvfp4_reference import dequantize_nvfp4, global_scale, quantize_nvfp4
from qerl.pipeline.data.calibration_text import CalibrationDataError, calibration_pairs, calibration_questions
from qerl.pipeline.data.calibration_tokens import calibration_tokens
from qerl.pipeline.data.datasets import DataConfig
from qerl.pipeline.nvfp4.gptq import gptq_nvfp4
from qerl.pipeline.nvfp4.recipe import QuantizeConfig
from qerl.pipeline.nvfp4.safetensors_io import iter_quantized_linears
from qerl.pipeline.nvfp4.scale_search import decode, quantize_mse, search_block_scales
from qerl.pipeline.store.artifact_store import ArtifactStore
from qerl.stages import quantize as stage
from shared_data import SHARED_DATA, needs_shared

FP4 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
# every finite positive FP8 E4M3 value, ascending (bit patterns 0x01..0x7E)
E4M3 = [float(torch.tensor([b], dtype=torch.uint8).view(torch.float8_e4m3fn).float()) for b in range(1, 0x7F)]


def _fp8(v: float) -> float:
    """torch's own cast (round to nearest even), saturating at 448."""
    return float(torch.tensor(min(v, 448.0)).to(torch.float8_e4m3fn).float())


def _fp4(y: float) -> float:
    """Nearest E2M1 value, ties to the even code, clamped to +-6."""
    a = min(abs(y), 6.0)
    best = min(range(8), key=lambda i: (abs(a - FP4[i]), i % 2))
    return FP4[best] if y >= 0 else -FP4[best]


def _block_error(x: list[float], s: float, gs: float) -> float:
    m = s / gs
    return sum((v - _fp4(v / m) * m) ** 2 for v in x)


def _slow_candidates(x: list[float], gs: float, sweep: int) -> list[float]:
    amax = max(abs(v) for v in x)
    absmax = _fp8(gs * (amax / 6)) or 0.125
    four = max(_fp8(gs * (amax / 4)), E4M3[0])
    out = [absmax, four]
    for k in range(1, sweep + 1):
        for base in (absmax, four):
            i = E4M3.index(base)
            out += [E4M3[max(i - k, 0)], E4M3[min(i + k, len(E4M3) - 1)]]
    return out


def _weights(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(12, 64, generator=g) * torch.rand(12, 1, generator=g) * 0.1
    w[0, :16] = 0.0  # an all-zero block keeps RTN's 0.125
    w[1, 16:32] = torch.randn(16, generator=g) * 1e-3
    w[1, 20] = 0.3  # an outlier block
    w[2] = torch.distributions.StudentT(2.0).sample((64,)) * 0.02  # heavy tails
    return w


def test_mse_scales_match_a_slow_per_block_reference():
    w = _weights()
    gs = global_scale(w.abs().max())
    x = w.reshape(12, 4, 16)
    got = search_block_scales(x, gs, sweep=2)
    g = float(gs)
    for r in range(12):
        for b in range(4):
            block = x[r, b].tolist()
            cands = _slow_candidates(block, g, 2)
            errs = [_block_error(block, s, g) for s in cands]
            chosen = float(got[r, b])
            assert chosen in cands, (r, b, chosen, cands)
            assert _block_error(block, chosen, g) <= min(errs) * (1 + 1e-5) + 1e-30, (r, b)
    assert float(got[0, 0]) == 0.125


def test_mse_error_never_above_rtn_per_block_and_lower_overall():
    w = torch.cat([_weights(s) for s in range(4)])
    p, s, g = quantize_nvfp4(w)
    rtn = dequantize_nvfp4(p, s, g, dtype=torch.float32)
    p2, s2, g2 = quantize_mse(w)
    assert torch.equal(g2, g)  # the global scale is RTN's
    mse = dequantize_nvfp4(p2, s2, g2, dtype=torch.float32)
    err_rtn = ((w.double() - rtn.double()) ** 2).reshape(-1, 16).sum(-1)
    err_mse = ((w.double() - mse.double()) ** 2).reshape(-1, 16).sum(-1)
    assert (err_mse <= err_rtn * (1 + 1e-6)).all()
    assert err_mse.sum() < 0.9 * err_rtn.sum()
    # where the absmax scale wins, the codes are RTN's exactly
    same = s2.float() == s.float()
    assert same.any() and torch.equal(
        mse.reshape(-1, 16)[same.reshape(-1)], rtn.reshape(-1, 16)[same.reshape(-1)]
    )


def _problem(seed: int = 0, out_f: int = 24, in_f: int = 128, n: int = 1024):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g)
    mix = torch.randn(in_f, in_f, generator=g) * 0.3 + torch.eye(in_f)
    x = torch.randn(n, in_f, generator=g) @ mix  # correlated inputs: where GPTQ helps
    return w, x, 2 * x.T @ x / n


def _out_err(x: torch.Tensor, w: torch.Tensor, q: torch.Tensor) -> float:
    return float(((x @ (w - q).T) ** 2).mean())


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("rule", ["absmax", "mse", "hessian"])
def test_gptq_reduces_output_error_and_its_codes_decode_to_the_chosen_values(rule, act_order):
    w, x, h = _problem()
    gs = global_scale(w.abs().max())
    p, s, g = quantize_nvfp4(w)
    rtn = dequantize_nvfp4(p, s, g, dtype=torch.float32)
    codes, scales = gptq_nvfp4(w, h, gs, damp=0.01, act_order=act_order, scale_rule=rule)
    chosen = decode(codes.reshape(24, -1, 16), scales, gs).reshape(24, 128)
    assert _out_err(x, w, chosen) < 0.7 * _out_err(x, w, rtn)
    # the packed checkpoint tensors decode, with the project's dequantizer, to exactly these values
    from qerl.kernels.nvfp4_reference import pack_codes

    deq = dequantize_nvfp4(pack_codes(codes), scales.to(torch.float8_e4m3fn), gs, dtype=torch.float32)
    assert torch.equal(deq, chosen)


def _plain_gptq(w: torch.Tensor, h: torch.Tensor, gs: torch.Tensor, damp: float) -> torch.Tensor:
    """Textbook GPTQ, one column at a time, no lazy batches, absmax block scales at each block start."""
    w = w.double().clone()
    h = h.double() + damp * torch.diagonal(h).mean() * torch.eye(h.shape[0], dtype=torch.float64)
    u = torch.linalg.cholesky(torch.linalg.inv(h), upper=True)
    q = torch.zeros_like(w)
    m = None
    for j in range(w.shape[1]):
        if j % 16 == 0:
            amax = w[:, j : j + 16].abs().amax(dim=1)
            m = torch.tensor([(_fp8(float(gs) * (float(a) / 6)) or 0.125) / float(gs) for a in amax.float()])
        q[:, j] = torch.tensor(
            [_fp4(float(v) / float(mm)) * float(mm) for v, mm in zip(w[:, j], m, strict=True)]
        )
        e = (w[:, j] - q[:, j]) / u[j, j]
        w[:, j:] -= e.unsqueeze(1) * u[j, j:].unsqueeze(0)
    return q.float()


def test_gptq_matches_a_plain_column_by_column_reference():
    w, x, h = _problem(seed=1, out_f=6, in_f=64, n=512)
    gs = global_scale(w.abs().max())
    codes, scales = gptq_nvfp4(w, h, gs, damp=0.01, scale_rule="absmax", block=32)
    ours = decode(codes.reshape(6, -1, 16), scales, gs).reshape(6, 64)
    ref = _plain_gptq(w, h, gs, 0.01)
    # float32 lazy batches vs float64 direct updates: a rare value near a rounding boundary may flip
    assert (ours == ref).float().mean() > 0.98
    assert abs(_out_err(x, w, ours) - _out_err(x, w, ref)) < 0.05 * _out_err(x, w, ref)


def test_inverse_hessian_factor_is_the_upper_cholesky_factor_of_the_damped_inverse():
    """Against the textbook steps (float64, dead inputs set to 1, damping by the mean diagonal): the
    same bits, so freeing intermediates early changed nothing; and U^T U is the damped inverse."""
    from qerl.pipeline.nvfp4.gptq import inverse_hessian_factor

    _, _, h = _problem(seed=3, out_f=4, in_f=48, n=256)
    h[:, 5] = 0.0
    h[5, :] = 0.0  # a dead input
    ref = h.double().clone()
    ref.diagonal()[5] = 1.0
    ref.diagonal().add_(0.01 * ref.diagonal().mean())
    expected = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(ref)), upper=True).float()
    u = inverse_hessian_factor(h, 0.01)
    assert torch.equal(u, expected) and torch.equal(u, u.triu())
    torch.testing.assert_close(u.double().T @ u.double(), torch.linalg.inv(ref), rtol=1e-5, atol=1e-8)


# --- through the stage -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_dir(tiny_model_factory) -> Path:
    return tiny_model_factory(arch="llama", norm_jitter=0.05)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> ArtifactStore:
    return ArtifactStore(tmp_path_factory.mktemp("store-methods"))


GPTQ = {"method": "gptq", "calibration": {"source": "train", "count": 24, "max_tokens": 48}}


def test_layer_by_layer_forward_equals_the_model(llama_dir):
    """The skeleton + per-layer loading + sdpa with no mask reproduces transformers' own forward."""
    from qerl.pipeline.nvfp4 import calibration as cal
    from qerl.pipeline.nvfp4.safetensors_io import read_tensor, safetensors_index
    from transformers import AutoModelForCausalLM

    ids = [5, 17, 42, 99, 7, 250, 11, 3, 64]
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    with torch.no_grad():
        want = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    specs = safetensors_index(llama_dir)
    skel = cal.model_skeleton(llama_dir)
    rotary = type(skel.model.rotary_emb)(skel.model.config)
    hidden = [read_tensor(specs["model.embed_tokens.weight"]).float()[torch.tensor(ids)].unsqueeze(0)]
    with torch.no_grad():
        for i in range(len(skel.model.layers)):
            hidden = cal._run_layer(cal._load_layer(skel, i, specs, torch.device("cpu")), rotary, hidden)
            if i + 1 < len(skel.model.layers):  # the last entry of hidden_states is after the final norm
                torch.testing.assert_close(hidden[0], want[i + 1], rtol=1e-5, atol=1e-5)


def _kl_on(src: Path, ckpt: Path, texts: list[list[int]]) -> float:
    from qerl.pipeline.nvfp4.loading import load_dequantized
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    quant = load_dequantized(ckpt, dtype=torch.float32)
    total = 0.0
    with torch.no_grad():
        for ids in texts:
            lp = base(torch.tensor([ids])).logits.log_softmax(-1)
            lq = quant(torch.tensor([ids])).logits.log_softmax(-1)
            total += float((lp.exp() * (lp - lq)).sum(-1).mean())
    return total / len(texts)


def test_gptq_through_the_stage_gives_a_loadable_checkpoint_closer_to_the_base(llama_dir, store):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data = DataConfig()
    rtn = stage.run(QuantizeConfig(), llama_dir, store, data)
    gptq = stage.run(QuantizeConfig.model_validate(GPTQ), llama_dir, store, data)
    assert gptq.mode == "nvfp4/torch" and gptq.extra["method"] == "gptq"
    cal = gptq.extra["calibration"]
    assert cal["source"] == "arithmetic/train" and cal["sequences"] == 24 and len(cal["digest"]) == 64
    assert rtn.extra["method"] == "rtn" and "calibration" not in rtn.extra
    cfg = json.loads((gptq.dir / "config.json").read_text())
    assert cfg["quantization_config"]["format"] == "nvfp4-pack-quantized"
    # same format, other codes; fused groups keep one global scale
    ours = dict(iter_quantized_linears(gptq.dir))
    theirs = dict(iter_quantized_linears(rtn.dir))
    assert ours.keys() == theirs.keys()
    assert any(not torch.equal(ours[k][0], theirs[k][0]) for k in ours)
    for k in ours:
        assert torch.equal(ours[k][2], theirs[k][2]), k  # the global scales are RTN's
    layer0 = [ours[f"model.layers.0.self_attn.{p}"][2] for p in ("q_proj", "k_proj", "v_proj")]
    assert torch.equal(layer0[0], layer0[1]) and torch.equal(layer0[0], layer0[2])
    AutoModelForCausalLM.from_pretrained(gptq.dir)  # compressed-tensors loads it
    # closer to the base than RTN on text like the calibration's (held-out arithmetic test problems)
    tok = AutoTokenizer.from_pretrained(llama_dir)
    pairs, _ = calibration_pairs("train", 8, 99, DataConfig(seed=7))
    texts = [tok(q + " " + a, add_special_tokens=False)["input_ids"] for q, a in pairs]
    assert _kl_on(llama_dir, gptq.dir, texts) < _kl_on(llama_dir, rtn.dir, texts)
    # a second run is a cache hit
    assert stage.run_with_status(QuantizeConfig.model_validate(GPTQ), llama_dir, store, data)[1]


def test_mse_through_the_stage(llama_dir, store):
    rtn = stage.run(QuantizeConfig(), llama_dir, store)
    mse = stage.run(QuantizeConfig(method="mse"), llama_dir, store)
    assert mse.extra["method"] == "mse" and mse.key != rtn.key
    src = dict(iter_quantized_linears(rtn.dir))
    got = dict(iter_quantized_linears(mse.dir))
    for name, (_, _, g) in got.items():
        assert torch.equal(g, src[name][2])  # the global scales (fused groups too) are RTN's
    # the stage's mse checkpoint is quantize_mse of the source weights
    from qerl.pipeline.nvfp4.safetensors_io import read_tensor, safetensors_index

    specs = safetensors_index(llama_dir)
    name = "model.layers.1.mlp.down_proj"
    p, s, g = quantize_mse(read_tensor(specs[name + ".weight"]))
    assert torch.equal(p, got[name][0]) and torch.equal(s.view(torch.uint8), got[name][1].view(torch.uint8))


def test_cache_key_follows_method_and_calibration_digest(llama_dir):
    key = stage._recipe_key
    rtn = key(QuantizeConfig())
    assert not {"method", "calibration", "scale_sweep"} & set(rtn)  # rtn keys as before the methods
    assert key(QuantizeConfig(method="rtn", scale_sweep=5, calibration={"count": 3})) == rtn
    mse = key(QuantizeConfig(method="mse"))
    assert mse != rtn and key(QuantizeConfig(method="mse", scale_sweep=1)) != mse
    assert key(QuantizeConfig(method="mse", calibration={"count": 3})) == mse  # calibration: gptq only
    g = QuantizeConfig.model_validate(GPTQ)
    k1, k2 = key(g, {"digest": "a"}), key(g, {"digest": "b"})
    assert k1 != k2 and k1 != mse
    with pytest.raises(ValueError, match="calibration digest"):
        key(g)
    # the digest follows the calibration text
    ids1, info1 = calibration_tokens(g.calibration, llama_dir, DataConfig())
    g2 = QuantizeConfig.model_validate({**GPTQ, "calibration": {**GPTQ["calibration"], "seed": 1}})
    _, info2 = calibration_tokens(g2.calibration, llama_dir, DataConfig())
    assert info1["digest"] != info2["digest"] and info1["sequences"] == len(ids1()) == 24


def test_missing_calibration_data_is_a_clear_error(llama_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("QERL_DATA_DIR", raising=False)
    cfg = QuantizeConfig.model_validate({"method": "gptq", "calibration": {"source": "gsm8k"}})
    with pytest.raises(CalibrationDataError, match=r"data\.root"):
        stage.run(cfg, llama_dir, ArtifactStore(tmp_path / "s"), DataConfig())
    with pytest.raises(FileNotFoundError, match="gsm8k/train"):
        calibration_pairs("gsm8k", 4, 0, DataConfig(root=str(tmp_path)))
    with pytest.raises(CalibrationDataError, match="no reference solutions"):
        calibration_pairs("train", 4, 0, DataConfig(dataset="math500"))
    assert not (tmp_path / "s" / "objects").exists() or not any(
        (tmp_path / "s" / "objects").rglob("*.safetensors")
    )


@needs_shared
def test_gsm8k_calibration_pairs_hold_the_worked_solutions():
    pairs, label = calibration_pairs("auto", 5, 0, DataConfig(root=str(SHARED_DATA)))
    assert label == "gsm8k/train" and len(pairs) == 5
    assert all("####" in a and len(a) > 20 for _, a in pairs)
    assert pairs != calibration_pairs("gsm8k", 5, 1, DataConfig(root=str(SHARED_DATA)))[0]
    held = frozenset(q for q, _ in pairs[:2])
    assert (
        not {q for q, _ in calibration_pairs("auto", 5, 0, DataConfig(root=str(SHARED_DATA)), held)[0]} & held
    )


def test_calibration_leaves_the_runs_validation_questions_out():
    """Promotion decides on the validation questions: GPTQ's calibration text never holds one."""
    data = DataConfig(arithmetic_size=40)
    pairs, _ = calibration_pairs("train", 40, 0, data)  # the whole pool
    held = frozenset(q for q, _ in pairs[:10])
    kept, _ = calibration_pairs("train", 40, 0, data, held)
    assert len(kept) == 30 and not {q for q, _ in kept} & held
    questions, _ = calibration_questions(40, 0, data, held)
    assert len(questions) == 30 and not set(questions) & held


def test_the_searchs_fp4_rounding_has_the_reference_error_ties_included():
    from qerl.kernels.nvfp4_reference import fp4_codes
    from qerl.pipeline.nvfp4.scale_search import _lut, _round_fp4_value

    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.25, -1.75, -5.0, 0.0, -0.0])
    y = torch.cat([ties, torch.randn(5000) * 3])
    ref = _lut(y.device)[fp4_codes(y).long()]
    assert torch.equal((y - _round_fp4_value(y)).abs(), (y - ref).abs())


def test_auto_calibration_falls_back_to_the_models_own_completions(tmp_path):
    from qerl.pipeline.data.calibration_text import resolve_source

    assert resolve_source("auto", DataConfig(root=str(tmp_path))) == "train"  # arithmetic has answers
    assert resolve_source("auto", DataConfig(dataset="math500", root=str(tmp_path))) == "samples"
    assert resolve_source("samples", DataConfig()) == "samples"


def test_greedy_completions_match_unpadded_generation(llama_dir):
    from qerl.pipeline.data.calibration_tokens import greedy_completions
    from transformers import AutoModelForCausalLM

    prompts = [[5, 17, 42], [9, 8, 7, 6, 5, 4, 3], [11]]
    got = greedy_completions(llama_dir, prompts, max_tokens=12, eos_id=2, pad_id=0, batch_size=2)
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    for p, ids in zip(prompts, got, strict=True):
        with torch.no_grad():
            want = model.generate(
                torch.tensor([p]), do_sample=False, max_new_tokens=12, eos_token_id=2, pad_token_id=0
            )
        want = want[0].tolist()
        want = want[: want.index(2, len(p)) + 1] if 2 in want[len(p) :] else want
        assert ids == want[:12] and ids[: len(p)] == p and len(ids) > len(p)


def test_samples_calibrate_on_generated_text_and_a_cache_hit_generates_nothing(
    llama_dir, tmp_path, monkeypatch
):
    from qerl.pipeline.data import calibration_tokens as cal_tokens

    cfg = QuantizeConfig.model_validate(
        {
            "method": "gptq",
            "quality": {"texts": 0},
            "calibration": {"source": "samples", "count": 4, "max_tokens": 24},
        }  # fmt: skip
    )
    store = ArtifactStore(tmp_path / "s")
    manifest, cached = stage.run_with_status(cfg, llama_dir, store, DataConfig())
    info = manifest.extra["calibration"]
    assert not cached and info["source"] == "samples:arithmetic/train" and info["completions"] == "greedy"
    assert info["sequences"] == 4 and len(info["completions_digest"]) == 64 and info["tokens"] > 0
    assert info["digest"] != info["completions_digest"]  # keyed by the prompts, recorded with the completions
    assert info["generated_on"] == "{}/{}".format(*cal_tokens.generation_device())  # cpu/torch.float32 here
    assert len(dict(iter_quantized_linears(manifest.dir))) == 14

    def no_generation(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("a cache hit generated completions")

    monkeypatch.setattr(cal_tokens, "greedy_completions", no_generation)
    again, cached = stage.run_with_status(cfg, llama_dir, store, DataConfig())
    assert cached and again.dir == manifest.dir


def test_calibration_renders_prompts_with_the_rollouts_template(monkeypatch):
    """GPTQ's calibration prompts are rendered as the rollouts render them (``rollout.template``),
    not with ``data.template``, which may differ."""
    from qerl.flows import tasks
    from qerl.pipeline.planning.run_config import RunConfig

    seen = {}
    monkeypatch.setattr(
        tasks.quantize,
        "run",
        lambda cfg, src, store, data, progress, held: seen.update(data=data, held=held),
    )
    cfg = RunConfig.model_validate({"data": {"template": "terse"}, "rollout": {"template": "boxed"}})
    tasks.quantized.fn(cfg=cfg, src="src", store=None, held_out=frozenset({"What is 1 + 1?"}))
    assert seen["data"].template == "boxed" and seen["data"].dataset == cfg.data.dataset
    assert seen["held"] == {"What is 1 + 1?"}  # the run's validation questions reach the calibration


def test_gsm8k_stored_as_parquet_is_read_by_calibration_and_the_quality_texts(tmp_path):
    """A data directory holding GSM8K as parquet (as the hub's export ships it) is the calibration's
    and the quality report's GSM8K too, not a silent switch to another source."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from qerl.pipeline.data.calibration_text import calibration_pairs, resolve_source
    from qerl.pipeline.data.datasets import DataConfig
    from qerl.pipeline.data.heldout import held_out_texts

    rows = [{"question": f"What is {i} + 1?", "answer": f"{i} plus one.\n#### {i + 1}"} for i in range(6)]
    (tmp_path / "gsm8k").mkdir()
    for split in ("train", "test"):
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / "gsm8k" / f"{split}.parquet")
    data = DataConfig(dataset="gsm8k", root=str(tmp_path))
    assert resolve_source("auto", data) == "gsm8k"
    pairs, label = calibration_pairs("auto", 4, 0, data)
    assert label == "gsm8k/train" and len(pairs) == 4 and all("####" in c for _, c in pairs)
    label, items, _ = held_out_texts("auto", 3, str(tmp_path))
    assert label == "gsm8k/test" and [i["completion"] for i in items] == [r["answer"] for r in rows[:3]]
