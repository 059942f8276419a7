"""The quantize stage end to end on tiny Qwen2/Qwen3/Llama models, the dequantized twin, export, CLI.

vLLM on CPU, exactly how far it gets with our checkpoint (``test_vllm_parses_the_scheme``):
``CompressedTensorsConfig.from_config`` parses our ``quantization_config``; its target map sends every
``Linear`` to our weight args, which it recognises as NVFP4 (``_is_nvfp4_format``) with no input
quantization, so ``get_scheme`` constructs ``CompressedTensorsW4A4Fp4(use_a16=True)`` -- vLLM's
NVFP4A16 scheme, the one served on an H100 by the FP4 Marlin kernel. The constructor then picks its
kernel and fails on CPU with "Forced NVFP4 kernel MarlinNvFp4LinearKernel is not supported: Marlin FP4
not available", so no weights are created or loaded. The CPU rollout path serves the dequantized twin.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from qerl.kernels.nvfp4_reference import dequantize_nvfp4, global_scale
from qerl.pipeline.nvfp4.recipe import QuantizeConfig, UnsupportedModelError
from qerl.pipeline.nvfp4.safetensors_io import iter_quantized_linears, safetensors_index
from qerl.pipeline.store.artifact_store import ArtifactStore
from qerl.pipeline.store.manifest import ArtifactError
from qerl.stages import dequantize
from qerl.stages import quantize as stage
from safetensors import safe_open
from safetensors.torch import load_file, save_file

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _src_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _logits(model_dir: Path, model=None) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = model or AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        return model(torch.tensor([[3, 17, 42, 99, 7, 250, 11, 5]])).logits.float()


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> ArtifactStore:
    return ArtifactStore(tmp_path_factory.mktemp("store"))


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_checkpoint_loads_in_transformers_and_matches_our_dequantization(arch, tiny_model_factory, store):
    from transformers import AutoModelForCausalLM

    src = tiny_model_factory(arch=arch, norm_jitter=0.05)
    manifest = stage.run(QuantizeConfig(), src, store)
    dst = manifest.dir
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["quantization_config"]["format"] == "nvfp4-pack-quantized"
    assert {"tokenizer.json", "generation_config.json", "model.safetensors.index.json"} <= {
        p.name for p in dst.iterdir()
    }
    assert manifest.extra["architecture"] == cfg["architectures"][0]
    assert manifest.extra["quantized_tensors"] == 2 * len(PROJ)
    assert manifest.mode in ("nvfp4/numba", "nvfp4/torch")

    # reference: the source model with every projection replaced by our dequantization
    ref = AutoModelForCausalLM.from_pretrained(src)
    ours = dict(iter_quantized_linears(dst))
    assert len(ours) == 2 * len(PROJ)
    with torch.no_grad():
        for name, (p, s, g) in ours.items():
            ref.get_submodule(name).weight.copy_(dequantize_nvfp4(p, s, g, dtype=torch.bfloat16))
    loaded = AutoModelForCausalLM.from_pretrained(dst)  # compressed-tensors integration
    got = _logits(dst, loaded)
    assert torch.equal(got, _logits(src, ref))
    assert not torch.equal(got, _logits(src))  # quantization did change the model
    # compressed-tensors decompressed every linear to exactly our dequantization
    for name, (p, s, g) in ours.items():
        w = loaded.get_submodule(name).weight
        assert torch.equal(w.view(torch.int16), dequantize_nvfp4(p, s, g, dtype=w.dtype).view(torch.int16)), (
            name
        )


def test_layout_fused_scales_and_pass_through(tiny_model_dir, store):
    manifest = stage.run(QuantizeConfig(), tiny_model_dir, store)
    src = _src_tensors(tiny_model_dir)
    out = _src_tensors(manifest.dir)
    for name, t in src.items():
        if any(f".{p}.weight" in name for p in PROJ):
            base = name[: -len(".weight")]
            assert f"{base}.weight" not in out
            assert out[f"{base}.weight_packed"].shape == (t.shape[0], t.shape[1] // 2)
            assert out[f"{base}.weight_scale"].dtype == torch.float8_e4m3fn
        else:  # embeddings, norms, biases, lm_head: byte for byte
            assert torch.equal(out[name].view(torch.uint8), t.view(torch.uint8)), name
    for layer in range(2):
        for group in (("self_attn", "q_proj", "k_proj", "v_proj"), ("mlp", "gate_proj", "up_proj")):
            parent, *projs = group
            names = [f"model.layers.{layer}.{parent}.{p}" for p in projs]
            gss = [out[f"{n}.weight_global_scale"] for n in names]
            expected = global_scale(max(src[f"{n}.weight"].float().abs().amax().item() for n in names))
            assert all(torch.equal(g, expected) for g in gss)
    with safe_open(manifest.dir / "model-00001-of-00001.safetensors", "pt") as fh:
        assert fh.metadata() == {"format": "pt"}


def test_small_shards_and_index(tiny_model_dir, tmp_path):
    store = ArtifactStore(tmp_path / "store")
    manifest = stage.run(QuantizeConfig(max_shard_mb=0.1), tiny_model_dir, store)
    index = json.loads((manifest.dir / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0].startswith("model-00001-of-")
    assert sum(len(load_file(manifest.dir / f)) for f in files) == len(index["weight_map"])


def test_cache_hit_is_fast_and_corruption_recomputes(tiny_model_dir, tmp_path):
    store = ArtifactStore(tmp_path / "store")
    seen: list[tuple[int, int]] = []
    first, cached = stage.run_with_status(
        QuantizeConfig(), tiny_model_dir, store, progress=lambda *a: seen.append(a)
    )
    assert not cached
    # progress counts every source tensor once, in order, up to the total (a console's quantize bar)
    n_sources = len(safetensors_index(tiny_model_dir))
    assert seen[-1] == (n_sources, n_sources) and [d for d, _ in seen] == sorted({d for d, _ in seen})
    reported = len(seen)
    t0 = time.perf_counter()
    again, cached = stage.run_with_status(
        QuantizeConfig(), tiny_model_dir, store, progress=lambda *a: seen.append(a)
    )
    assert cached and time.perf_counter() - t0 < 1.0 and again.key == first.key
    assert len(seen) == reported  # a cache hit builds nothing and reports nothing
    shard = again.dir / "model-00001-of-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    redone, cached = stage.run_with_status(QuantizeConfig(), tiny_model_dir, store)
    assert not cached and redone.digest == first.digest  # same content, rebuilt


def _rewrite(src: Path, dst: Path, config_edit=None, tensor_edit=None) -> Path:
    import shutil

    shutil.copytree(src, dst)
    if config_edit:
        cfg = json.loads((dst / "config.json").read_text())
        config_edit(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    if tensor_edit:
        f = next(dst.glob("*.safetensors"))
        tensors = load_file(f)
        tensor_edit(tensors)
        save_file(tensors, f, metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda c: c.update(architectures=["MixtralForCausalLM"], num_local_experts=8), "mixture-of-experts"),
        (lambda c: c.update(architectures=["GPT2LMHeadModel"]), "unsupported architecture 'GPT2LMHeadModel'"),
        (lambda c: c.update(quantization_config={"quant_method": "gptq"}), "already quantized"),
    ],
)
def test_unsupported_models_fail_before_writing(edit, match, tiny_model_dir, tmp_path):
    src = _rewrite(tiny_model_dir, tmp_path / "bad", config_edit=edit)
    store = ArtifactStore(tmp_path / "store")
    with pytest.raises(UnsupportedModelError, match=match):
        stage.run(QuantizeConfig(), src, store)
    assert not any((store.root / "objects").iterdir()) and not any((store.root / "tmp").iterdir())


def test_a_truncated_shard_fails_naming_the_file(tiny_model_dir, tmp_path):
    """A shard cut inside its JSON header (an interrupted copy) is named, not a bare JSON error."""
    src = _rewrite(tiny_model_dir, tmp_path / "cut")
    shard = next(src.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:40])
    with pytest.raises(UnsupportedModelError, match=rf"{shard}.*not a readable safetensors file \(32 of \d+"):
        stage.run(QuantizeConfig(), src, ArtifactStore(tmp_path / "store"))


def test_unknown_linear_in_a_layer_fails_naming_it(tiny_model_dir, tmp_path):
    def add(t):
        t["model.layers.0.mlp.shared_proj.weight"] = torch.zeros(8, 128, dtype=torch.bfloat16)

    src = _rewrite(tiny_model_dir, tmp_path / "odd", tensor_edit=add)
    with pytest.raises(UnsupportedModelError, match=r"model\.layers\.0\.mlp\.shared_proj\.weight"):
        stage.run(QuantizeConfig(), src, ArtifactStore(tmp_path / "store"))


def test_nan_weight_fails_naming_the_tensor(tiny_model_dir, tmp_path):
    def poison(t):
        t["model.layers.1.mlp.down_proj.weight"][3, 7] = float("nan")

    src = _rewrite(tiny_model_dir, tmp_path / "nan", tensor_edit=poison)
    store = ArtifactStore(tmp_path / "store")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj\.weight.*row 3, column 7"):
        stage.run(QuantizeConfig(), src, store)
    assert not any((store.root / "objects").iterdir())


def test_hub_id_without_network_fails_clearly(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UnsupportedModelError, match="not a local directory and could not be fetched"):
        stage.run(QuantizeConfig(), "qerl-test/definitely-not-local", ArtifactStore(tmp_path / "store"))


def test_dequantized_twin(tiny_model_dir, store):
    from transformers import AutoModelForCausalLM

    quant = stage.run(QuantizeConfig(), tiny_model_dir, store)
    twin = dequantize.run(QuantizeConfig(), quant, store)
    assert twin.stage == "dequantize" and twin.mode == "nvfp4-dequantized-twin"
    assert twin.extra["derived_from"]["digest"] == quant.digest
    assert "quantization_config" not in json.loads((twin.dir / "config.json").read_text())
    tensors = _src_tensors(twin.dir)
    for name, (p, s, g) in iter_quantized_linears(quant.dir):
        assert torch.equal(
            tensors[f"{name}.weight"].view(torch.int16), dequantize_nvfp4(p, s, g).view(torch.int16)
        )
    twin_model = AutoModelForCausalLM.from_pretrained(twin.dir)
    assert torch.equal(_logits(twin.dir, twin_model), _logits(quant.dir))


def test_export_is_atomic_and_refuses_foreign_dirs(tiny_model_dir, store, tmp_path):
    manifest = stage.run(QuantizeConfig(), tiny_model_dir, store)
    dst = stage.export(manifest, tmp_path / "out")
    assert (dst / "config.json").is_file() and (dst / stage.EXPORT_MARKER).is_file()
    stage.export(manifest, dst)  # a previous export may be replaced
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep")
    with pytest.raises(ArtifactError, match="refusing to overwrite .*mine"):
        stage.export(manifest, foreign)
    assert (foreign / "notes.txt").read_text() == "keep"


def test_cli_quantize(tiny_model_dir, tmp_path, capsys):
    from qerl.flows.cli import main

    args = [
        "quantize",
        str(tiny_model_dir),
        "--out",
        str(tmp_path / "dst"),
        "--work-dir",
        str(tmp_path / "w"),
    ]
    assert main(args) == 0
    assert "quantized (nvfp4/" in capsys.readouterr().out
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "cache hit" in out and str(tmp_path / "dst") in out
    assert (tmp_path / "w" / "store" / "objects" / "quantize").is_dir()


def test_vllm_parses_the_scheme(monkeypatch):
    """How far vLLM's compressed-tensors loader gets on CPU: see the module docstring."""
    from qerl.pipeline.nvfp4.recipe import quantization_config
    from vllm.model_executor.layers.quantization.compressed_tensors import compressed_tensors as ct

    config = ct.CompressedTensorsConfig.from_config(quantization_config())
    assert config.ignore == ["lm_head"]
    weights = config.target_scheme_map["Linear"]["weights"]
    assert config._is_nvfp4_format(weights) and weights.group_size == 16
    assert config.target_scheme_map["Linear"]["input_activations"] is None
    layer = torch.nn.Linear(128, 256)
    built = {}

    class Recorder:
        def __init__(self, use_a16: bool = False):
            built["use_a16"] = use_a16

        get_min_capability = ct.CompressedTensorsW4A4Fp4.get_min_capability  # the real scheme's (75)

    real = ct.CompressedTensorsW4A4Fp4
    monkeypatch.setattr(ct, "CompressedTensorsW4A4Fp4", Recorder)
    assert isinstance(config.get_scheme(layer, layer_name="model.layers.0.mlp.up_proj"), Recorder)
    assert built == {"use_a16": True}  # the NVFP4A16 (weight-only) scheme
    monkeypatch.setattr(ct, "CompressedTensorsW4A4Fp4", real)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="Marlin FP4 not available"):
            config.get_scheme(layer, layer_name="model.layers.0.mlp.up_proj")


ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def test_narrowed_targets_quantize_only_those_and_load_in_transformers(tiny_model_dir, store):
    """``quantize.targets`` narrowed to attention: the MLP stays bf16, and the checkpoint's
    quantization_config targets exactly what was quantized (it used to say ``Linear`` regardless)."""
    from transformers import AutoModelForCausalLM

    manifest = stage.run(QuantizeConfig(targets=ATTENTION), tiny_model_dir, store)
    qc = json.loads((manifest.dir / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["group_0"]["targets"] == [rf"re:.*\.{p}$" for p in ATTENTION]
    assert qc["ignore"] == ["lm_head"]
    src, out = _src_tensors(tiny_model_dir), _src_tensors(manifest.dir)
    for name, t in src.items():
        if any(f".{p}.weight" in name for p in ATTENTION):
            assert f"{name}_packed" in out and name not in out
        else:  # MLP projections too: copied byte for byte
            assert torch.equal(out[name].view(torch.uint8), t.view(torch.uint8)), name
    ours = dict(iter_quantized_linears(manifest.dir))
    assert len(ours) == manifest.extra["quantized_tensors"] == 2 * len(ATTENTION)

    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        for name, (p, s, g) in ours.items():
            ref.get_submodule(name).weight.copy_(dequantize_nvfp4(p, s, g, dtype=torch.bfloat16))
    loaded = AutoModelForCausalLM.from_pretrained(manifest.dir)  # compressed-tensors integration
    assert torch.equal(_logits(manifest.dir, loaded), _logits(tiny_model_dir, ref))
    mlp = loaded.get_submodule("model.layers.0.mlp.down_proj")
    assert type(mlp) is torch.nn.Linear and torch.equal(
        mlp.weight, src["model.layers.0.mlp.down_proj.weight"]
    )


def test_vllm_builds_nvfp4_layers_exactly_where_the_checkpoint_has_them():
    """vLLM's compressed-tensors loader (0.32) on the narrowed recipe: the fused qkv and o_proj get the
    NVFP4 scheme, gate_up/down stay unquantized (plain weights, as written), lm_head is ignored.
    Loading the weights themselves needs the FP4 Marlin kernel, i.e. a GPU (module docstring)."""
    from qerl.pipeline.nvfp4.recipe import quantization_config
    from vllm.model_executor.layers.quantization.compressed_tensors import compressed_tensors as ct

    fused = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def nvfp4_layers(cfg: QuantizeConfig) -> dict[str, bool]:
        config = ct.CompressedTensorsConfig.from_config(quantization_config(cfg))
        config.packed_modules_mapping = fused
        layer = torch.nn.Linear(128, 128)
        names = ["self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"]
        found = {n: config.get_scheme_dict(layer, f"model.layers.3.{n}") is not None for n in names}
        found["lm_head"] = config.get_scheme_dict(layer, "lm_head") is not None
        return found

    assert nvfp4_layers(QuantizeConfig(targets=ATTENTION)) == {
        "self_attn.qkv_proj": True, "self_attn.o_proj": True, "mlp.gate_up_proj": False,
        "mlp.down_proj": False, "lm_head": False,
    }  # fmt: skip
    assert nvfp4_layers(QuantizeConfig(targets=["gate_proj", "up_proj", "down_proj"])) == {
        "self_attn.qkv_proj": False, "self_attn.o_proj": False, "mlp.gate_up_proj": True,
        "mlp.down_proj": True, "lm_head": False,
    }  # fmt: skip
    everything = nvfp4_layers(QuantizeConfig())
    assert everything.pop("lm_head") is False and all(everything.values())


def test_recipe_rejects_a_split_fused_group_and_the_dead_ignore_key():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=r"takes \['q_proj'\] of the fused group"):
        QuantizeConfig(targets=["q_proj", "o_proj"])
    with pytest.raises(ValidationError, match="distinct projections"):
        QuantizeConfig(targets=["o_proj", "o_proj"])
    with pytest.raises(ValidationError, match="ignore"):  # it changed nothing; lm_head is never quantized
        QuantizeConfig(ignore=["lm_head"])


def test_twin_dtype_is_the_twins_alone(tiny_model_dir, store):
    """The NVFP4 checkpoint does not depend on the twin's dtype (one quantize artifact); an fp32 twin
    holds exactly the fp32 dequantization the fp32 trainer computes."""
    quant = stage.run(QuantizeConfig(twin_dtype="float32"), tiny_model_dir, store)
    assert stage.run(QuantizeConfig(twin_dtype="bfloat16"), tiny_model_dir, store).key == quant.key
    twin = dequantize.run(QuantizeConfig(twin_dtype="float32"), quant, store)
    assert twin.extra["dtype"] == "float32"
    tensors = _src_tensors(twin.dir)
    for name, (p, s, g) in iter_quantized_linears(quant.dir):
        assert torch.equal(tensors[f"{name}.weight"], dequantize_nvfp4(p, s, g, dtype=torch.float32)), name
    default = dequantize.run(QuantizeConfig(), quant, store)  # standalone (no run): bf16
    assert default.extra["dtype"] == "bfloat16" and default.key != twin.key
