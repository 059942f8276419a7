"""``quantize.keep``: mixed precision. The kept linears are copied byte for byte, ``quantization_config``
ignores exactly them, and every loader (transformers' compressed-tensors, vLLM's scheme map, the
trainer's packed loader, the twin) serves them dense while the rest stays NVFP4."""

from __future__ import annotations

import json

import pytest
import torch
from qerl.kernels.nvfp4_reference import dequantize_nvfp4
from qerl.pipeline.data.datasets import DataConfig
from qerl.pipeline.nvfp4.grouping import kept_linears
from qerl.pipeline.nvfp4.recipe import QuantizeConfig, UnsupportedModelError, quantization_config
from qerl.pipeline.nvfp4.safetensors_io import iter_quantized_linears, safetensors_index
from qerl.pipeline.store.artifact_store import ArtifactStore
from qerl.stages import dequantize
from qerl.stages import quantize as stage
from safetensors.torch import load_file

# the last of the tiny model's two decoder layers, in natural (= file) order
LAST = sorted(
    f"model.layers.1.{p}"
    for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
    + ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
)


def _tensors(model_dir) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> ArtifactStore:
    return ArtifactStore(tmp_path_factory.mktemp("store-keep"))


@pytest.fixture(scope="module")
def kept(tiny_model_dir, store):
    return stage.run(QuantizeConfig(keep=["last:1"], quality={"texts": 0}), tiny_model_dir, store)


def test_entries_resolve_to_module_names(tiny_model_dir):
    specs = safetensors_index(tiny_model_dir)  # 2 decoder layers

    def names(*keep: str) -> list[str]:
        return kept_linears(specs, QuantizeConfig(keep=list(keep)))

    assert names("last:1") == LAST
    assert names("first:1") == [n.replace("layers.1", "layers.0") for n in LAST]
    assert names("*.down_proj") == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    assert names("model.layers.1.mlp.*", "*.o_proj") == [
        "model.layers.0.self_attn.o_proj",
        *(f"model.layers.1.mlp.{p}" for p in ("down_proj", "gate_proj", "up_proj")),
        "model.layers.1.self_attn.o_proj",
    ]
    assert names() == []
    assert len(names("first:5")) == 14  # more layers than the model has: all of them


def test_bad_entries_are_refused_naming_them(tiny_model_dir, store):
    from pydantic import ValidationError

    specs = safetensors_index(tiny_model_dir)
    with pytest.raises(UnsupportedModelError, match=r"'\*\.dense_proj' matches no quantized linear.*2 here"):
        kept_linears(specs, QuantizeConfig(keep=["*.dense_proj"]))
    with pytest.raises(
        UnsupportedModelError, match=r"keeps model.layers.0.self_attn.q_proj but not k_proj, v_proj"
    ):
        kept_linears(specs, QuantizeConfig(keep=["*.q_proj"]))
    with pytest.raises(ValidationError, match="first:N / last:N takes a positive N"):
        QuantizeConfig(keep=["last:0"])
    with pytest.raises(ValidationError, match="first:N / last:N takes a positive N"):
        QuantizeConfig(keep=["last:two"])
    with pytest.raises(UnsupportedModelError, match="quantize.keep keeps all 14"):
        stage.run(QuantizeConfig(keep=["*"]), tiny_model_dir, store)
    assert not list(store.root.glob("objects/quantize/*"))  # refused before anything was written


def test_kept_linears_are_copied_and_ignored(kept, tiny_model_dir):
    qc = json.loads((kept.dir / "config.json").read_text())["quantization_config"]
    assert qc["ignore"] == ["lm_head", *LAST]
    assert qc == quantization_config(QuantizeConfig(), LAST)
    src, out = _tensors(tiny_model_dir), _tensors(kept.dir)
    for name in LAST:
        assert torch.equal(out[f"{name}.weight"].view(torch.uint8), src[f"{name}.weight"].view(torch.uint8))
        assert f"{name}.weight_packed" not in out
    assert kept.extra["quantized_tensors"] == 7 and len(dict(iter_quantized_linears(kept.dir))) == 7
    dense = sum(src[f"{n}.weight"].numel() * 2 for n in LAST)  # bf16
    nvfp4 = sum(src[f"{n}.weight"].numel() * (1 / 2 + 1 / 16) + 4 for n in LAST)
    assert kept.extra["keep"] == {"linears": LAST, "bytes": dense, "nvfp4_bytes": nvfp4}


def test_transformers_the_trainer_and_the_twin_serve_them_dense(kept, tiny_model_dir, store):
    from qerl.pipeline.nvfp4.linear import NVFP4Linear
    from qerl.pipeline.nvfp4.loading import load_for_training
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[3, 17, 42, 99, 7, 250, 11, 5]])
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        for name, (p, s, g) in iter_quantized_linears(kept.dir):
            ref.get_submodule(name).weight.copy_(dequantize_nvfp4(p, s, g, dtype=torch.bfloat16))
        want = ref(ids).logits.float()
        loaded = AutoModelForCausalLM.from_pretrained(kept.dir)  # compressed-tensors with the ignore list
        assert torch.equal(loaded(ids).logits.float(), want)
    assert type(loaded.get_submodule(LAST[-1])) is torch.nn.Linear

    model = load_for_training(kept.dir, dtype=torch.bfloat16)
    assert type(model.get_submodule(LAST[0])) is torch.nn.Linear
    assert isinstance(model.get_submodule(LAST[0].replace("layers.1", "layers.0")), NVFP4Linear)

    twin = dequantize.run(QuantizeConfig(keep=["last:1"], twin_dtype="bfloat16"), kept, store)
    twin_tensors = _tensors(twin.dir)
    src = _tensors(tiny_model_dir)
    for name in LAST:
        assert torch.equal(twin_tensors[f"{name}.weight"], src[f"{name}.weight"])


def test_vllm_serves_the_kept_layers_dense():
    """vLLM's compressed-tensors scheme map (CPU: the scheme, not its kernel): a fused layer whose
    parts are all ignored gets no NVFP4 scheme, the same layer of another decoder layer does."""
    from vllm.model_executor.layers.quantization.compressed_tensors import compressed_tensors as ct

    config = ct.CompressedTensorsConfig.from_config(quantization_config(QuantizeConfig(), LAST))
    config.packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }
    layer = torch.nn.Linear(128, 128)
    for i, dense in ((0, False), (1, True)):
        for n in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            assert (config.get_scheme_dict(layer, f"model.layers.{i}.{n}") is None) == dense, (i, n)


def test_keep_keys_the_artifact_and_an_empty_keep_keys_as_before():
    assert "keep" not in stage._recipe_key(QuantizeConfig())
    assert stage._recipe_key(QuantizeConfig(keep=["last:1"]))["keep"] == ["last:1"]


def test_gptq_keeps_them_too(tiny_model_factory, tmp_path):
    llama = tiny_model_factory(arch="llama", norm_jitter=0.05)
    cfg = {"method": "gptq", "keep": ["first:1"], "quality": {"texts": 0},
           "calibration": {"source": "train", "count": 8, "max_tokens": 32}}  # fmt: skip
    manifest = stage.run(QuantizeConfig.model_validate(cfg), llama, ArtifactStore(tmp_path), DataConfig())
    src, out = _tensors(llama), _tensors(manifest.dir)
    first = [n.replace("layers.1", "layers.0") for n in LAST]
    for name in first:
        assert torch.equal(out[f"{name}.weight"], src[f"{name}.weight"])
    assert sorted(dict(iter_quantized_linears(manifest.dir))) == sorted(LAST)


def test_cli_prints_what_keeping_costs(tiny_model_dir, tmp_path, capsys):
    from qerl.flows.cli import main

    work, out = str(tmp_path / "w"), str(tmp_path / "out")
    args = ["quantize", str(tiny_model_dir), "--out", out, "--work-dir", work, "--set", "quality.texts=0"]
    assert main([*args, "--set", "keep=[last:1]"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "(7 linears)" in lines[0]
    src = _tensors(tiny_model_dir)
    dense = sum(src[f"{n}.weight"].numel() * 2 for n in LAST) / 2**20
    extra = dense - sum(src[f"{n}.weight"].numel() * (1 / 2 + 1 / 16) + 4 for n in LAST) / 2**20
    assert lines[2] == f"kept dense: 7 linears, {dense:.1f} MiB (+{extra:.1f} MiB over NVFP4)"


def test_cli_takes_settings_with_or_without_the_quantize_prefix(tiny_model_dir, tmp_path, capsys):
    """`qerl quantize --set keep=...` and `--set quantize.keep=...` (the run config's and `qerl eval`'s
    spelling) are the same setting; an unknown key is named as it was typed."""
    from qerl.flows.cli import main

    work, out = str(tmp_path / "w"), str(tmp_path / "out")
    args = ["quantize", str(tiny_model_dir), "--out", out, "--work-dir", work, "--set", "quality.texts=0"]
    assert main([*args, "--set", "quantize.keep=[last:1]"]) == 0
    assert "kept dense: 7 linears" in capsys.readouterr().out
    assert main([*args, "--set", "keep=[last:1]"]) == 0
    assert capsys.readouterr().out.startswith("cache hit")
    assert main([*args, "--set", "quantize.kep=[last:1]"]) == 2
    assert "unknown config key 'quantize.kep'" in capsys.readouterr().err
