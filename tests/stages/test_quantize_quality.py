"""The quality stage (what quantization cost): metrics against hand-derived values and a plain
reference, the held-out and validation texts, determinism, its key (never the checkpoint's), the disk
check of its spill, the one line, the table and the CLI report."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from qerl.kernels.nvfp4_reference import dequantize_nvfp4
from qerl.pipeline.data.heldout import held_out_texts
from qerl.pipeline.nvfp4 import quality
from qerl.pipeline.nvfp4.loading import load_dequantized
from qerl.pipeline.nvfp4.quality import QualityConfig, logit_metrics, relative_error
from qerl.pipeline.nvfp4.quality_report import quality_brief, quality_line, quality_table
from qerl.pipeline.nvfp4.recipe import QuantizeConfig
from qerl.pipeline.store.artifact_store import ArtifactStore
from qerl.stages import quality as quality_stage
from qerl.stages import quantize as stage
from shared_data import SHARED_DATA, needs_shared


def test_logit_metrics_match_hand_derived_values():
    # row 0: p = (1/2, 1/2), q = (3/4, 1/4); row 1: p = (4/5, 1/5), q = (1/5, 4/5)
    base = torch.tensor([[0.0, 0.0], [math.log(4), 0.0]])
    quant = torch.tensor([[math.log(3), 0.0], [0.0, math.log(4)]])
    targets = torch.tensor([1, 0])
    m = logit_metrics(base, quant, targets)
    kl0 = 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)  # = ln(4/3) / 2
    kl1 = 0.8 * math.log(0.8 / 0.2) + 0.2 * math.log(0.2 / 0.8)  # = 0.6 ln 4
    assert m["kl"] == pytest.approx(kl0 + kl1, rel=1e-6)
    assert m["agree"] == 1.0  # row 0: both argmax 0; row 1: 0 vs 1
    assert m["nll_base"] == pytest.approx(-math.log(0.5) - math.log(0.8), rel=1e-6)
    assert m["nll_quant"] == pytest.approx(-math.log(0.25) - math.log(0.2), rel=1e-6)
    assert m["tokens"] == 2.0
    same = logit_metrics(base, base.clone(), targets)
    assert same["kl"] == pytest.approx(0.0, abs=1e-7) and same["agree"] == 2.0


def test_logit_metrics_refuse_mismatched_shapes():
    with pytest.raises(ValueError, match="must be"):
        logit_metrics(torch.zeros(2, 3), torch.zeros(2, 4), torch.zeros(2))


def test_relative_error_by_hand():
    w = torch.tensor([[3.0, 4.0], [0.0, 0.0]])
    d = torch.tensor([[3.0, 0.0], [0.0, 0.0]])
    assert relative_error(w, d) == pytest.approx(4 / 5)
    # chunked over rows: the same number when every row is its own chunk
    assert relative_error(w, d, chunk_elements=1) == pytest.approx(4 / 5)
    assert relative_error(torch.zeros(2, 2), torch.zeros(2, 2)) == 0.0
    with pytest.raises(ValueError, match="shapes differ"):
        relative_error(w, d[:1])


def test_held_out_arithmetic_is_the_test_split_and_fixed():
    label, items, digest = held_out_texts("arithmetic", 8)
    assert label == "arithmetic/test" and len(items) == 8
    from qerl.pipeline.data.arithmetic import ARITHMETIC_LEVELS, arithmetic_problems

    test = {
        p["question"] for p in arithmetic_problems(8, seed=0, split="test", levels=list(ARITHMETIC_LEVELS))
    }
    assert {it["messages"][0]["content"] for it in items} == test
    assert all(it["completion"].startswith("<answer>") for it in items)
    assert held_out_texts("arithmetic", 8)[2] == digest
    assert held_out_texts("arithmetic", 7)[2] != digest


def test_held_out_gsm8k_needs_its_file(tmp_path, monkeypatch):
    monkeypatch.delenv("QERL_DATA_DIR", raising=False)
    with pytest.raises(FileNotFoundError, match=r"gsm8k/test.jsonl.*quantize.quality.data_root"):
        held_out_texts("gsm8k", 4, str(tmp_path))
    assert held_out_texts("auto", 4, str(tmp_path))[0] == "arithmetic/test"
    with pytest.raises(ValueError, match="unknown held-out text source"):
        held_out_texts("gsm8k-train", 4)


@needs_shared
def test_held_out_gsm8k_are_test_solutions():
    label, items, _ = held_out_texts("auto", 3, str(SHARED_DATA))
    rows = [json.loads(line) for line in (SHARED_DATA / "gsm8k" / "test.jsonl").open()][:3]
    assert label == "gsm8k/test"
    assert [it["completion"] for it in items] == [r["answer"].strip() for r in rows]
    assert [it["messages"][0]["content"] for it in items] == [r["question"].strip() for r in rows]


def test_encode_items_truncates_the_completion_and_refuses_what_cannot_fit(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    item = {
        "id": "x",
        "messages": [{"role": "user", "content": "What is 2 + 2?"}],
        "completion": "4 4 4 4 4 4 4 4",
    }
    [(ids, n)], truncated = quality.encode_items(tok, [item], max_tokens=1024)
    assert truncated == 0 and ids[:n] == tok("What is 2 + 2?\n", add_special_tokens=False).input_ids
    assert ids[n:] == tok(item["completion"], add_special_tokens=False).input_ids
    [(cut, m)], truncated = quality.encode_items(tok, [item], max_tokens=n + 2)
    assert truncated == 1 and m == n and cut == ids[: n + 2]
    with pytest.raises(ValueError, match="no room for a completion"):
        quality.encode_items(tok, [item], max_tokens=n)

    class NoTemplate:
        chat_template = None
        name_or_path = "plain-tok"

    with pytest.raises(ValueError, match="plain-tok.*no chat template"):
        quality.encode_items(NoTemplate(), [item], max_tokens=64, prompt="chat")


def _without_tokenizer(model_dir: Path, out: Path) -> Path:
    """The model's config and weights, none of its tokenizer files (a weights-only copy)."""
    import shutil

    out.mkdir()
    for f in model_dir.iterdir():
        if f.name == "config.json" or f.suffix == ".safetensors":
            shutil.copy(f, out / f.name)
    return out


def _measured(cfg: QualityConfig, quantized, src: Path, store: ArtifactStore):
    texts = held_out_texts(cfg.source, cfg.texts) if cfg.texts else None
    return quality_stage.run(cfg, quantized, src, store, texts)


def test_a_source_without_a_tokenizer_is_named_before_a_model_loads(tiny_model_dir, tmp_path, monkeypatch):
    """transformers builds an empty tokenizer from a config.json alone: the quality stage names the
    folder before it loads a model, with no quality artifact left in the store; the checkpoint,
    written first, is kept."""
    src = _without_tokenizer(tiny_model_dir, tmp_path / "weights-only")
    store = ArtifactStore(tmp_path / "store")
    quantized = stage.run(QuantizeConfig(), src, store)
    monkeypatch.setattr(quality, "_load_base", lambda *a: pytest.fail("a model loaded"))
    with pytest.raises(ValueError, match=r"weights-only: no tokenizer .*quantize.quality.texts: 0"):
        _measured(QualityConfig(source="arithmetic", texts=4), quantized, src, store)
    assert [m.parent.parent.name for m in store.root.rglob("manifest.json")] == ["quantize"]
    # without texts the quality section needs no tokenizer (weight errors only)
    section = _measured(QualityConfig(texts=0), quantized, src, store).extra["quality"]
    assert "kl" not in section and section["weight_error"]["linears"] > 0


def test_a_chat_prompt_without_a_template_is_refused_before_a_model_loads(
    tiny_model_dir, tmp_path, monkeypatch
):
    import shutil

    src = shutil.copytree(tiny_model_dir, tmp_path / "no-template")
    (src / "chat_template.jinja").unlink()
    store = ArtifactStore(tmp_path / "store")
    quantized = stage.run(QuantizeConfig(), src, store)
    monkeypatch.setattr(quality, "_load_base", lambda *a: pytest.fail("a model loaded"))
    with pytest.raises(ValueError, match="no chat template"):
        _measured(QualityConfig(source="arithmetic", texts=4, prompt="chat"), quantized, src, store)


def test_a_report_that_fails_keeps_the_checkpoint_and_says_what_the_spill_needs(
    tiny_model_dir, tmp_path, monkeypatch
):
    """The report runs after the checkpoint is committed: a failure (here, no room for the spilled
    logits, which go under the store, not $TMPDIR) costs the report only, and a rerun quantizes nothing."""
    store = ArtifactStore(tmp_path / "store")
    quantized, _ = stage.run_with_status(QuantizeConfig(), tiny_model_dir, store)
    monkeypatch.setattr(quality, "free_bytes", lambda path: 1000)
    with pytest.raises(
        OSError, match=r"logits for [\d,]+ tokens take .* under .*store/tmp/quality-.*1.0 KB free"
    ):
        _measured(QualityConfig(source="arithmetic", texts=4), quantized, tiny_model_dir, store)
    monkeypatch.undo()
    again, cached = stage.run_with_status(QuantizeConfig(), tiny_model_dir, store)
    assert cached and again.digest == quantized.digest
    assert (
        "kl"
        in _measured(QualityConfig(source="arithmetic", texts=4), again, tiny_model_dir, store).extra[
            "quality"
        ]
    )


SECTION = {
    "texts": {
        "source": "gsm8k/test",
        "count": 64,
        "digest": "x",
        "prompt": "plain",
        "max_tokens": 1024,
        "truncated": 0,
    },  # fmt: skip
    "tokens": 7862,
    "kl": 0.215,
    "top1": 0.808,
    "ppl_base": 4.43,
    "ppl_quant": 5.2,
    "weight_error": {"linears": 3, "mean": 0.05, "max": 0.091, "worst": "model.layers.3.mlp.down_proj"},
    "layers": {
        "model.layers.0.self_attn.q_proj": 0.02,
        "model.layers.3.mlp.down_proj": 0.091,
        "model.layers.3.mlp.up_proj": 0.039,
    },
}


def test_quality_line_and_table():
    assert quality_line(SECTION) == (
        "quality: KL 0.215 nats/token, top-1 0.808, ppl 4.43 -> 5.20 "
        "(64 GSM8K test solutions, 7,862 tokens); worst linear layers.3.mlp.down_proj 9.1%"
    )
    rows = quality_table(SECTION).splitlines()
    assert [r.split()[0] for r in rows[2:]] == [
        "layers.3.mlp.down_proj",
        "layers.3.mlp.up_proj",
        "layers.0.self_attn.q_proj",
    ]
    assert rows[2].endswith("9.10%")
    weights_only = {k: SECTION[k] for k in ("weight_error", "layers")}
    assert quality_line(weights_only).startswith("quality: weight error mean 5.0% over 3 linears")
    assert "not measured" in quality_line(None)


def _plain_reference(src: Path, ckpt: Path, items: list[dict], prompt: str) -> dict[str, float]:
    """The metrics with whole-sequence logits from each model's ordinary forward and
    torch.nn.functional.kl_div: no chunking, no spill, no hidden-state path."""
    from qerl.pipeline.nvfp4.loading import load_dequantized
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src)
    base = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    quant = load_dequantized(ckpt, dtype=torch.float32).eval()
    kl = agree = nll_b = nll_q = n = 0.0
    for it in items:
        q = it["messages"][0]["content"]
        chat = tok.apply_chat_template(it["messages"], tokenize=False, add_generation_prompt=True)
        text = q + "\n" if prompt == "plain" else chat
        p = tok(text, add_special_tokens=False).input_ids
        c = tok(it["completion"], add_special_tokens=False).input_ids
        ids = torch.tensor([p + c])
        with torch.no_grad():
            lb = base(ids).logits[0, len(p) - 1 : -1].double().log_softmax(-1)
            lq = quant(ids).logits[0, len(p) - 1 : -1].double().log_softmax(-1)
        t = torch.tensor(c)
        kl += float(torch.nn.functional.kl_div(lq, lb, log_target=True, reduction="sum"))
        agree += float((lb.argmax(-1) == lq.argmax(-1)).sum())
        nll_b -= float(lb[torch.arange(len(c)), t].sum())
        nll_q -= float(lq[torch.arange(len(c)), t].sum())
        n += len(c)
    return {
        "kl": kl / n,
        "top1": agree / n,
        "ppl_base": math.exp(nll_b / n),
        "ppl_quant": math.exp(nll_q / n),
    }


@pytest.fixture(scope="module")
def built(tiny_model_dir, tmp_path_factory):
    """The demo model quantized and measured twice, into two stores (two independent builds):
    (quality config, quality a, quality b, checkpoint a)."""
    cfg = QualityConfig(source="arithmetic", texts=6)
    out = []
    for name in ("qa", "qb"):
        store = ArtifactStore(tmp_path_factory.mktemp(name))
        quantized = stage.run(QuantizeConfig(quality=cfg), tiny_model_dir, store)
        out.append((_measured(cfg, quantized, tiny_model_dir, store), quantized))
    (a, ckpt), (b, _) = out
    return cfg, a, b, ckpt


def test_section_in_the_manifest_and_deterministic(built):
    _, a, b, ckpt = built
    section = a.extra["quality"]
    assert list(section) == [
        "texts",
        "tokens",
        "kl",
        "top1",
        "ppl_base",
        "ppl_quant",
        "weight_error",
        "layers",
    ]
    assert section["texts"]["source"] == "arithmetic/test" and section["texts"]["count"] == 6
    assert section["weight_error"]["linears"] == ckpt.extra["quantized_tensors"] == len(section["layers"])
    assert section["kl"] > 0 and 0 < section["top1"] <= 1 and section["tokens"] > 6
    assert json.dumps(section).encode() == json.dumps(b.extra["quality"]).encode()
    assert json.loads(a.file("quality.json").read_text()) == section and a.metrics["seconds"] > 0
    assert "quality" not in ckpt.extra  # the checkpoint's manifest is the checkpoint's
    assert quality_line(section).startswith("quality: KL ")


@pytest.mark.parametrize(
    ("batch_tokens", "prompt"), [(1, "plain"), (4096, "plain"), (4096, "chat")]
)  # one text per forward; all in one padded batch
def test_model_metrics_match_a_plain_reference(built, tiny_model_dir, monkeypatch, batch_tokens, prompt):
    _, a, _, ckpt = built
    _, items, _ = held_out_texts("arithmetic", 6)
    monkeypatch.setattr(quality, "_LOGIT_BUDGET", 3 * 1000)  # a few rows per chunk: the chunk loop runs
    monkeypatch.setattr(quality, "_BATCH_TOKENS", batch_tokens)
    m = quality.model_metrics(
        tiny_model_dir, ckpt.dir, items, max_tokens=1024, prompt=prompt, load=load_dequantized
    )
    ref = _plain_reference(tiny_model_dir, ckpt.dir, items, prompt)
    for key in ("kl", "top1", "ppl_base", "ppl_quant"):
        assert m[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-7), key
    assert m["kl"] > 1e-4  # the quantized model does differ: the comparison can fail
    if prompt == "plain":  # the stage's default
        assert a.extra["quality"]["kl"] == pytest.approx(ref["kl"], rel=1e-4)


def test_weight_errors_match_an_independent_dequantization(built, tiny_model_dir):
    from safetensors.torch import load_file

    _, a, _, ckpt = built
    src = {}
    for f in sorted(tiny_model_dir.glob("*.safetensors")):
        src.update(load_file(f))
    out = {}
    for f in sorted(ckpt.dir.glob("*.safetensors")):
        out.update(load_file(f))
    for name, err in a.extra["quality"]["layers"].items():
        w = src[f"{name}.weight"].double()
        parts = (out[f"{name}.{k}"] for k in ("weight_packed", "weight_scale", "weight_global_scale"))
        d = dequantize_nvfp4(*parts, dtype=torch.float32).double()
        assert err == pytest.approx(float((w - d).norm() / w.norm()), abs=1e-6), name


def test_quality_settings_and_texts_key_the_report_never_the_checkpoint(built, tiny_model_dir, tmp_path):
    cfg, a, _, ckpt = built
    store = ArtifactStore(tmp_path)
    quantized = stage.run(QuantizeConfig(quality=cfg), tiny_model_dir, store)
    first = _measured(cfg, quantized, tiny_model_dir, store)
    assert first.key == a.key  # the same checkpoint, settings and texts: the same report
    from qerl.pipeline.planning.run_config import load_run_config
    from qerl.pipeline.planning.runs import run_id_for, with_resources
    from qerl.stages import dequantize

    twin = dequantize.run(QuantizeConfig(quality=cfg), quantized, store)
    for other in (
        QualityConfig(enabled=False),
        QualityConfig(source="arithmetic", texts=3, dtype="bfloat16"),
    ):
        again, cached = stage.run_with_status(QuantizeConfig(quality=other), tiny_model_dir, store)
        assert cached and again.key == quantized.key  # a quality setting never re-quantizes
        assert dequantize.run(QuantizeConfig(quality=other), again, store).key == twin.key  # nor re-twins
    # nor is it another run: a resume takes the fix the quality stage's own errors suggest
    demo = load_run_config(None)
    fixed = with_resources(demo, None, ["quantize.quality.dtype=bfloat16", "quantize.quality.enabled=false"])
    assert run_id_for(fixed) == run_id_for(demo) and fixed.quantize.quality.dtype == "bfloat16"
    fewer = _measured(QualityConfig(source="arithmetic", texts=3), quantized, tiny_model_dir, store)
    assert fewer.key != first.key and fewer.extra["quality"]["texts"]["count"] == 3
    weights_only = _measured(QualityConfig(texts=0), quantized, tiny_model_dir, store)
    assert list(weights_only.extra["quality"]) == ["weight_error", "layers"]
    # the key is the checkpoint's content: another recipe's checkpoint is measured again
    mse = stage.run(QuantizeConfig(method="mse"), tiny_model_dir, store)
    assert _measured(cfg, mse, tiny_model_dir, store).key != first.key
    assert mse.digest != ckpt.digest


def test_bfloat16_halves_the_model_and_a_gpu_without_room_is_refused(built, tiny_model_dir, monkeypatch):
    _, _, _, ckpt = built
    fp32 = quality.check_device_room(tiny_model_dir, torch.float32, "cpu")
    assert quality.check_device_room(tiny_model_dir, torch.bfloat16, "cpu") * 2 == fp32 > 0
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (fp32 - 1, 80 << 30))
    with pytest.raises(
        MemoryError, match=r"takes .* in float32, the GPU has .* free: set quantize.quality.dtype"
    ):
        quality.check_device_room(tiny_model_dir, torch.float32, "cuda")
    quality.check_device_room(tiny_model_dir, torch.bfloat16, "cuda")  # half fits
    _, items, _ = held_out_texts("arithmetic", 6)
    half = quality.model_metrics(
        tiny_model_dir, ckpt.dir, items, max_tokens=1024, dtype="bfloat16", load=load_dequantized
    )
    full = quality.model_metrics(tiny_model_dir, ckpt.dir, items, max_tokens=1024, load=load_dequantized)
    assert half["kl"] == pytest.approx(full["kl"], rel=0.5) and half["tokens"] == full["tokens"]


def test_a_runs_validation_split_is_what_the_report_measures(tiny_model_dir):
    """In a run the texts are its validation problems with reference completions, held out of
    training and calibration; the test split is what the run reports, so it never selects a recipe."""
    from qerl.pipeline.data.datasets import DataConfig, load_problems
    from qerl.pipeline.data.heldout import quality_texts
    from qerl.pipeline.evaluation.eval_config import ValidationConfig, validation_split

    data = DataConfig(arithmetic_size=64)
    _, validation = validation_split(load_problems(data, "train"), ValidationConfig(size=12))
    label, items, digest = quality_texts("auto", 8, None, data, validation)
    assert label == "validation:arithmetic" and len(items) == 8
    assert [i["messages"][0]["content"] for i in items] == [p["question"] for p in validation[:8]]
    assert items[0]["completion"] == f"<answer>{validation[0]['answer']}</answer>"  # the terse template's
    assert quality_texts("auto", 8, None, data, [])[0] == "arithmetic/test"  # no split: the test texts
    with pytest.raises(ValueError, match="no validation split"):
        quality_texts("validation", 8, None, data, [])
    assert quality_texts("auto", 0, None, data, validation) is None


def test_cli_prints_the_line_and_the_report(tiny_model_dir, tmp_path, capfd):
    """The result and the report on stdout; on stderr the log file's name, and none of the libraries'
    output (transformers' loading bars go to that file)."""
    from qerl.flows.cli import main

    work, out = str(tmp_path / "w"), str(tmp_path / "out")
    sets = ["--set", "quality.source=arithmetic", "--set", "quality.texts=4"]
    args = ["quantize", str(tiny_model_dir), "--out", out, "--work-dir", work, *sets]
    assert main(args) == 0
    shown = capfd.readouterr()
    plain = shown.out
    assert "quality: KL " in plain and "rel. weight error" not in plain
    (log,) = (tmp_path / "w" / "logs").glob("quantize-*.log")
    assert f"log: {log}" in shown.err and "Loading weights" not in shown.err + shown.out
    assert "Loading weights" in log.read_text()  # the quality stage loads both models through transformers
    assert main([*args, "--report"]) == 0  # cache hits: the report comes from the quality stage's manifest
    report = capfd.readouterr().out.splitlines()
    assert report[0].startswith("cache hit") and report[1].startswith("quality: KL ")
    table = report[report.index(next(r for r in report if "rel. weight error" in r)) + 2 :]
    values = [float(r.split()[-1].rstrip("%")) for r in table]
    assert len(values) == 14 and values == sorted(values, reverse=True)  # 2 layers x 7 linears, worst first


def test_quality_metrics_reach_the_mlflow_run(tmp_path):
    from types import SimpleNamespace

    from qerl.flows.promotion import log_quality
    from qerl.pipeline.nvfp4.quality_report import quality_metrics
    from qerl.pipeline.registry import tracking

    assert quality_metrics(SECTION) == {
        "quantize_kl": 0.215,
        "quantize_top1": 0.808,
        "quantize_ppl_base": 4.43,
        "quantize_ppl_quant": 5.2,
        "quantize_weight_error_mean": 0.05,
        "quantize_weight_error_max": 0.091,
    }
    assert quality_metrics(None) == {}
    cfg = tracking.RegistryConfig()
    run_id = tracking.start_run(tracking.connect(cfg, tmp_path), run_name="quality")
    log_quality(SimpleNamespace(registry=cfg), tmp_path, run_id, SimpleNamespace(extra={"quality": SECTION}))
    logged = tracking.MlflowClient().get_run(run_id).data.metrics
    assert {k: logged[k] for k in quality_metrics(SECTION)} == quality_metrics(SECTION)
    # the run console's quality line and `qerl eval`'s base line carry the short form
    assert quality_brief(SECTION) == ", KL 0.215 nats/token, top-1 0.808"
    weights_only = {"weight_error": SECTION["weight_error"]}
    assert quality_brief(weights_only) == ", weight error 5.0%"
    assert quality_brief(None) == ""
