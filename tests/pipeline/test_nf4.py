"""QLoRA's NF4 base (``quantize.scheme: nf4``): the checkpoint against bitsandbytes' own functional
quantizer, its twin against bitsandbytes' dequantization, the trainer on ``Linear4bit`` against the
twin the engine serves, the engine modes, the quality report and the ``qlora`` arm (a whole ablation with it, runs that learn
on NF4 included: tests/flows/test_ablation.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from qerl.pipeline.nvfp4.recipe import QuantizeConfig
from qerl.pipeline.nvfp4.safetensors_io import read_tensor, safetensors_index
from qerl.pipeline.schemes import NF4_MODE, NF4_TWIN_MODE
from qerl.pipeline.store.artifact_store import ArtifactStore

NF4 = QuantizeConfig(scheme="nf4", twin_dtype="float32")


@pytest.fixture(scope="module")
def src(tiny_model_factory) -> Path:
    return tiny_model_factory(arch="qwen2", dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> ArtifactStore:
    return ArtifactStore(tmp_path_factory.mktemp("nf4-store"))


@pytest.fixture(scope="module")
def nf4_base(src, store):
    from qerl.stages import quantize

    return quantize.run(NF4, src, store)


def test_the_nf4_base_is_bitsandbytes_nf4_with_double_quantization_of_the_source(src, store, nf4_base):
    """Every targeted linear holds exactly what bitsandbytes' functional ``quantize_4bit`` (NF4, blocks
    of 64, double quantization) makes of the source weight in the twin dtype; the rest is that dtype's
    cast; transformers loads it as its own 4-bit model."""
    import bitsandbytes as bnb
    from bitsandbytes.functional import quantize_4bit
    from qerl.stages import quantize

    man = nf4_base
    assert man.mode == NF4_MODE
    assert man.extra["recipe"] == {
        "scheme": "nf4", "library": "bitsandbytes", "bitsandbytes": bnb.__version__, "quant_type": "nf4",
        "blocksize": 64, "double_quant": True, "dtype": "float32",
    }  # fmt: skip
    qc = json.loads(man.file("config.json").read_text())["quantization_config"]
    assert (qc["quant_method"], qc["bnb_4bit_quant_type"], qc["bnb_4bit_use_double_quant"]) == (
        "bitsandbytes", "nf4", True,
    )  # fmt: skip
    source, out = safetensors_index(src), safetensors_index(man.dir)
    linears = [
        n[: -len(".weight")] for n in source if n.startswith("model.layers.") and n.endswith("proj.weight")
    ]
    assert len(linears) == 14 and man.extra["quantized_tensors"] == 14
    # the manifest's layout is what the file holds, read from every linear's quantization state
    from qerl.pipeline.nf4.checkpoint import quant_state, written_layout

    states = [quant_state(out, m) for m in linears]
    assert len(states) == 14 and {st["blocksize"] for st in states} == {man.extra["recipe"]["blocksize"]}
    assert written_layout(man.dir) == {"quant_type": "nf4", "blocksize": 64, "double_quant": True}
    for module in linears:
        weight = read_tensor(source[f"{module}.weight"]).to(torch.float32)
        codes, state = quantize_4bit(weight, blocksize=64, compress_statistics=True, quant_type="nf4")
        assert torch.equal(read_tensor(out[f"{module}.weight"]), codes), module
        assert torch.equal(read_tensor(out[f"{module}.weight.absmax"]), state.absmax), module
        assert torch.equal(read_tensor(out[f"{module}.weight.nested_absmax"]), state.state2.absmax), module
    for name in ("model.embed_tokens.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight"):
        assert torch.equal(read_tensor(out[name]), read_tensor(source[name]).to(torch.float32)), name
    assert quantize.run(NF4, src, store).key == man.key  # cached
    assert quantize.run(NF4.model_copy(update={"twin_dtype": "bfloat16"}), src, store).key != man.key

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(man.dir, dtype=torch.float32)
    assert isinstance(model.model.layers[1].mlp.down_proj, bnb.nn.Linear4bit)


def test_targets_and_keep_leave_linears_dense(src, store):
    from qerl.stages import quantize

    cfg = NF4.model_copy(
        update={"keep": ["model.layers.0.mlp.down_proj"], "targets": ["gate_proj", "up_proj", "down_proj"]}
    )
    out = safetensors_index(quantize.run(cfg, src, store).dir)
    nf4 = {
        n.removesuffix(".weight.quant_state.bitsandbytes__nf4")
        for n in out
        if n.endswith("bitsandbytes__nf4")
    }
    assert nf4 == {"model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"} | {
        f"model.layers.1.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")
    }
    assert out["model.layers.0.mlp.down_proj.weight"].dtype == "F32"
    assert out["model.layers.0.self_attn.q_proj.weight"].dtype == "F32"


def test_the_twin_holds_bitsandbytes_dequantization_and_computes_what_the_trainer_does(store, nf4_base):
    """The dequantize stage's NF4 twin is a plain checkpoint of ``dequantize_4bit``'s values; the
    trainer's model (``Linear4bit`` under peft's LoRA, LoRA B at zero) gives the twin's logits exactly."""
    from bitsandbytes.functional import dequantize_4bit
    from qerl.pipeline.rl.policy import init_state
    from qerl.pipeline.rl.train_config import TrainConfig
    from qerl.stages import dequantize
    from transformers import AutoModelForCausalLM

    twin = dequantize.run(NF4, nf4_base, store)
    assert twin.mode == NF4_TWIN_MODE and twin.extra["dequantized_linears"] == 14
    assert "quantization_config" not in json.loads(twin.file("config.json").read_text())
    trainer = init_state(nf4_base.dir, TrainConfig(lora_r=4, lora_alpha=8, dtype="float32", seed=0)).model
    plain = AutoModelForCausalLM.from_pretrained(twin.dir, dtype=torch.float32).eval()
    twin_specs = safetensors_index(twin.dir)
    compared = 0
    for name, module in trainer.named_modules():
        if type(module).__name__ == "Linear4bit" and hasattr(module, "lora_A"):
            base = module.base_layer
            key = name.removeprefix("base_model.model.") + ".weight"
            expected = dequantize_4bit(base.weight.data, base.weight.quant_state)
            assert torch.equal(read_tensor(twin_specs[key]), expected), key
            compared += 1
    assert compared == 14  # every NF4 linear under LoRA: a renamed peft layer class would compare none
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        trainer.eval()
        assert torch.equal(trainer(input_ids=ids).logits, plain(input_ids=ids).logits)
    trainer.train()
    trainer(input_ids=ids).logits.float().logsumexp(
        -1
    ).mean().backward()  # after a no-grad call, still trains
    grads = [p.grad for n, p in trainer.named_parameters() if p.requires_grad and "lora_A" in n]
    assert grads and all(g is not None for g in grads)


def test_resume_on_an_nf4_base_is_bit_identical(src, nf4_base, tmp_path):
    """The train step's resume guarantee holds on ``Linear4bit`` (test_train's check, on NF4; the
    batches come from the plain source model, which samples faster)."""
    from tests.stages.test_train import check_resume_is_bit_identical

    check_resume_is_bit_identical(nf4_base.dir, src, tmp_path)


def test_nf4_engine_modes_name_the_scheme_and_take_its_twin_only(store, nf4_base, monkeypatch):
    from qerl.pipeline.planning.engine_setup import needs_twin
    from qerl.pipeline.rollout import factory
    from qerl.pipeline.rollout.config import RolloutConfig
    from qerl.pipeline.rollout.lazy import LazyEngine
    from qerl.pipeline.rollout.protocol import EngineError
    from qerl.stages import dequantize, quantize

    rollout = RolloutConfig(engine="hf", dtype="float32", max_model_len=64, max_new_tokens=4)
    vllm = rollout.model_copy(update={"engine": "vllm"})
    assert factory.base_scheme(nf4_base) == "nf4" and needs_twin("vllm", "nf4") and needs_twin("hf", "nf4")
    assert LazyEngine(rollout, nf4_base, None).mode == "hf-nf4-emulated"
    assert LazyEngine(vllm, nf4_base, None).mode == "vllm-nf4-emulated"
    nvfp4 = quantize.run(QuantizeConfig(twin_dtype="float32"), nf4_base.extra["source"], store)
    with pytest.raises(EngineError, match="nf4-dequantized-twin"):  # an NVFP4 twin for an NF4 base
        factory.build_engine(
            rollout, nf4_base, dequantize.run(QuantizeConfig(twin_dtype="float32"), nvfp4, store)
        )
    engine = factory.build_engine(rollout, nf4_base, dequantize.run(NF4, nf4_base, store))
    try:
        assert engine.mode == "hf-nf4-emulated"
    finally:
        engine.close()
    monkeypatch.setattr(factory.device, "cuda_available", lambda: True)
    assert factory.planned_mode(vllm, "nf4")[0] == "vllm-nf4-bitsandbytes"
    assert factory.planned_mode(vllm, "nvfp4")[0] == "vllm-nvfp4-marlin"
    assert factory.planned_mode(rollout, "nf4")[0] == "hf-nf4-emulated"


def test_an_nf4_run_on_cuda_needs_a_vllm_that_has_bitsandbytes(nf4_base, monkeypatch, tmp_path):
    """vLLM 0.32.0 (this environment's) no longer ships bitsandbytes, 0.26.0 does. On a CUDA machine an
    NF4 run on the vLLM engine is refused when its config loads, naming both ways out, and the engine
    refuses to start; with a vLLM that has it, on the HF engine, or on a CPU, the config loads. vLLM
    cannot split a pre-quantized bitsandbytes checkpoint across GPUs, so tensor parallelism is refused."""
    import importlib.util
    import types

    from qerl.pipeline.config import ConfigError
    from qerl.pipeline.planning.run_config import load_run_config
    from qerl.pipeline.rollout import factory
    from qerl.pipeline.rollout.config import RolloutConfig
    from qerl.pipeline.rollout.protocol import EngineError

    if (factory.installed_vllm() or "").endswith(" 0.32.0"):
        assert not factory.vllm_has_bitsandbytes()
    real_find_spec = importlib.util.find_spec
    package = tmp_path / "vllm"
    fake = types.SimpleNamespace(submodule_search_locations=[str(package)])
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: fake if n == "vllm" else real_find_spec(n, *a)
    )
    (package / "model_executor" / "layers" / "quantization").mkdir(parents=True)
    assert not factory.vllm_has_bitsandbytes()
    (package / "model_executor" / "layers" / "quantization" / "bitsandbytes.py").write_text("")
    assert factory.vllm_has_bitsandbytes()
    monkeypatch.undo()

    nf4 = ["quantize.scheme=nf4", "train.dtype=bfloat16", "rollout.dtype=bfloat16"]
    refused = r"quantize.scheme is nf4.*vllm-nf4-bitsandbytes.*requirements/gpu.txt.*--set rollout.engine=hf"
    assert load_run_config(None, nf4).quantize.scheme == "nf4"  # a CPU: the twin, mode vllm-nf4-emulated
    monkeypatch.setattr(factory.device, "cuda_available", lambda: True)
    monkeypatch.setattr(factory, "vllm_has_bitsandbytes", lambda: False)
    with pytest.raises(ConfigError, match=refused):
        load_run_config(None, nf4)
    with pytest.raises(EngineError, match=refused):
        factory.build_engine(RolloutConfig(dtype="bfloat16"), nf4_base, None)
    assert load_run_config(None, [*nf4, "rollout.engine=hf"]).rollout.engine == "hf"
    assert load_run_config(None, nf4[1:]).quantize.scheme == "nvfp4"  # NVFP4 needs no bitsandbytes
    monkeypatch.setattr(factory, "vllm_has_bitsandbytes", lambda: True)
    assert load_run_config(None, nf4).quantize.scheme == "nf4"
    tp = RolloutConfig(dtype="bfloat16", tensor_parallel_size=2)  # vLLM's loader refuses it for NF4
    assert "rollout.tensor_parallel_size=1" in factory.serving_error(tp, "vllm-nf4-bitsandbytes")
    assert factory.serving_error(tp, "vllm-nvfp4-marlin") is None


def test_the_quality_stage_measures_an_nf4_base(src, store, nf4_base):
    from bitsandbytes.functional import dequantize_4bit, quantize_4bit
    from qerl.stages import quality

    items = [
        {
            "id": str(a),
            "messages": [{"role": "user", "content": f"What is {a} + {a}?"}],
            "completion": f"It is {2 * a}.",
        }
        for a in range(6)
    ]
    report = quality.run(NF4.quality, nf4_base, src, store, ("test", items, "d1")).extra["quality"]
    assert report["weight_error"]["linears"] == 14 and 0 < report["weight_error"]["mean"] < 0.2
    assert report["kl"] > 0 and report["tokens"] > 0 and 0 < report["top1"] <= 1
    module = "model.layers.1.self_attn.o_proj"
    weight = read_tensor(safetensors_index(src)[f"{module}.weight"]).to(torch.float32)
    deq = dequantize_4bit(*quantize_4bit(weight, blocksize=64, compress_statistics=True, quant_type="nf4"))
    expected = float((weight - deq).norm() / weight.norm())
    assert report["layers"][module] == pytest.approx(expected, rel=1e-5)


def test_the_qlora_arm_is_the_nf4_base_without_aqn():
    from qerl.pipeline.evaluation import arms

    assert arms.arm_overrides("qlora") == {"quantize": {"scheme": "nf4"}, "aqn": {"enabled": False}}
    assert arms.parse_arms("qlora,nvfp4-lora,bf16-lora") == ["qlora", "nvfp4-lora", "bf16-lora"]
    with pytest.raises(arms.AblationError, match="'gptq' is not a variant of qlora"):
        arms.arm_overrides("qlora-gptq")


def test_the_planners_nf4_bytes_are_the_checkpoints(nf4_base):
    """``qerl plan --base nf4``'s per-linear bytes against the file: codes, scale codes, nested scales
    and code books exactly; the state's JSON is budgeted at 200 bytes."""
    from qerl.pipeline.nf4.checkpoint import nf4_linears, nf4_shape
    from qerl.pipeline.planning.memory import nf4_bytes

    specs = safetensors_index(nf4_base.dir)
    for module in nf4_linears(specs):
        stored = {
            k: s.nbytes
            for k, s in specs.items()
            if k == f"{module}.weight" or k.startswith(f"{module}.weight.")
        }
        json_bytes = stored.pop(f"{module}.weight.quant_state.bitsandbytes__nf4")
        assert sum(stored.values()) + 200 == nf4_bytes(*nf4_shape(specs, module)), module
        assert 100 < json_bytes <= 200, module


def test_the_written_layout_is_read_from_the_file_and_must_be_one(tmp_path):
    """bitsandbytes picks the block size by device (128 on ROCm's warp-64 GPUs): the manifest says
    what the quantization states hold, and a file with two layouts is refused."""
    from bitsandbytes.functional import quantize_4bit
    from qerl.pipeline.nf4.checkpoint import written_layout
    from safetensors.torch import save_file

    tensors = {}
    for name, blocksize in (("a", 64), ("b", 128)):
        codes, state = quantize_4bit(
            torch.randn(16, 128), blocksize=blocksize, quant_type="nf4", compress_statistics=True
        )
        tensors[f"{name}.weight"] = codes
        tensors.update({f"{name}.weight.{k}": v for k, v in state.as_dict(packed=True).items()})
    save_file({k: v for k, v in tensors.items() if k.startswith("b.")}, str(tmp_path / "model.safetensors"))
    assert written_layout(tmp_path) == {"quant_type": "nf4", "blocksize": 128, "double_quant": True}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="NF4 linears with 2 layouts"):
        written_layout(tmp_path)
