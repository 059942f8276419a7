"""The GPU validation kit: CUDA paths checked on a CUDA machine, and the kit itself checked anywhere.

``gpu`` tests (run by ``scripts/gpu/gpu_check.sh`` on a CUDA machine, skipped elsewhere with the reason):
the Triton kernels compiled for the GPU, bit-exact with the PyTorch reference over the truth tables,
adversarial and random weights; ``NVFP4Linear`` forward and LoRA gradients on CUDA against a bf16
model holding the dequantized weights; one GRPO train step on CUDA from the packed base, whose
checkpoint reloads bit-exactly; the transformers engine generating on CUDA from the twin.

Everywhere (CPU included): the compiled PTX of the Triton kernels divides with IEEE rounding; every
name the vLLM tests and benchmark import from qerl exists; the vLLM test modules share one checkpoint
and one gap file; ``gpu_check.sh --dry-run`` runs, and without pydantic it reports the tests not
started. (What the maintainers' transfer kit needs of these files is tests/tools/'s.)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
CUDA = torch.cuda.is_available()
GPU_ENV = "TRITON_INTERPRET=0 is needed: run the gpu tests through scripts/gpu/gpu_check.sh"


@pytest.fixture
def cuda():
    """Skip without CUDA; on CUDA insist on compiled Triton (the interpreter would test nothing)."""
    if not CUDA:
        pytest.skip("needs a CUDA GPU: run `bash scripts/gpu/gpu_check.sh` on one")
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        pytest.fail(GPU_ENV)
    return torch.device("cuda")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.cpu().contiguous(), b.cpu().contiguous()  # bytes: NaN payloads and -0.0 count
    same_kind = a.shape == b.shape and a.dtype == b.dtype
    return same_kind and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


# -- the kit, checked on any machine ------------------------------------------------------------------


def test_compiled_kernels_divide_with_ieee_rounding(tmp_path):
    """Triton lowers float32 ``/`` on NVIDIA GPUs to ``div.full.f32``/``div.approx.f32`` (up to 2 ulp
    off; triton-lang/triton#10661), which the interpreter never shows. Compile the kernels for an
    H100 (sm_90) here, no GPU needed (ptxas included), and read the PTX: only correctly rounded division
    may remain. Before the kernels used ``tl.math.div_rn`` this found div.full.f32 in all three and
    div.approx.f32 in the quantizer. Nor may a float negation: signs go on by an integer OR, since
    ``tl.where(code & 8, -v, v)`` (neg.f32) decoded code 8 to +0.0 on an H200 (the interpreter: -0.0)."""
    code = """
import json, re
from triton import compile
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from qerl.kernels import nvfp4_triton as k
sigs = {
    "_dequantize_kernel": ({"packed_ptr": "*u8", "scale_ptr": "*fp32", "gs_ptr": "*fp32", "out_ptr": "*bf16",
                            "n_groups": "i32", "BLOCK": "constexpr", "BF16": "constexpr"}, {"BLOCK": 64, "BF16": True}),
    "_quantize_kernel": ({"w_ptr": "*bf16", "gs_ptr": "*fp32", "packed_ptr": "*u8", "scale_ptr": "*fp32",
                          "n_groups": "i32", "BLOCK": "constexpr"}, {"BLOCK": 64}),
    "_round_fp8_kernel": ({"x_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}, {"BLOCK": 1024}),
}
ops = {}
for name, (sig, const) in sigs.items():
    asm = compile(ASTSource(fn=getattr(k, name), signature=sig, constexprs=const),
                  target=GPUTarget("cuda", 90, 32)).asm
    assert asm.get("cubin"), name  # ptxas assembled it for sm_90 too
    ops[name] = sorted(set(re.findall(r"\\b(?:div|rcp|neg)\\.[a-z0-9.]+", asm["ptx"])))
print(json.dumps(ops))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # a real compile, not a cached one
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ops = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(ops) == {"_dequantize_kernel", "_quantize_kernel", "_round_fp8_kernel"}
    for name, found in ops.items():
        assert found and set(found) <= {"div.rn.f32"}, (name, found)


def test_the_kit_vllm_modules_share_one_checkpoint_under_gpu_check(tmp_path, tmp_path_factory, monkeypatch):
    """gpu_check.sh sets $QERL_GPU_KIT_DIR: the AQN module's engine then serves the very checkpoint
    (same path: a hit in the same store) that the plain module's engine compiled for, so that vLLM's
    compile cache lies between them as it does between ``qerl eval`` and a run with AQN."""
    from tests.gpu.test_gpu_vllm import kit_checkpoint

    monkeypatch.setenv("QERL_GPU_KIT_DIR", str(tmp_path))
    first = kit_checkpoint(tmp_path_factory)
    second = kit_checkpoint(tmp_path_factory)  # as the other module's process finds it
    assert first.dir == second.dir and first.key == second.key
    assert "export QERL_GPU_KIT_DIR=" in (ROOT / "scripts" / "gpu" / "gpu_check.sh").read_text()
    monkeypatch.delenv("QERL_GPU_KIT_DIR")
    assert kit_checkpoint(tmp_path_factory).dir != first.dir  # run alone: a fresh folder


# the kit's files that import vLLM
VLLM_KIT = (
    "tests/gpu/test_gpu_vllm.py",
    "tests/gpu/test_gpu_vllm_aqn.py",
    "tests/gpu/test_gpu_vllm_padded.py",
    "benchmarks/bench_vllm.py",
)


def test_the_vllm_kit_names_qerl_modules_and_names_that_exist():
    """tests/gpu/test_gpu_vllm.py and benchmarks/bench_vllm.py run whole only on a GPU: here, on any
    machine, every `from qerl... import x` in them must resolve (module paths move in refactors; the
    GPU session should not find out first)."""
    import ast
    import importlib
    import importlib.util

    trees = [ast.parse((ROOT / f).read_text()) for f in VLLM_KIT]
    wanted = [
        (node.module, alias.name)
        for tree in trees
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("qerl.")
        for alias in node.names
    ]
    assert len(wanted) >= 10
    missing = []
    for module, name in wanted:
        try:
            parent = importlib.import_module(module)
            if not hasattr(parent, name) and importlib.util.find_spec(f"{module}.{name}") is None:
                missing.append(f"{module}.{name}")  # neither a name in it nor a submodule
        except ImportError as err:
            missing.append(f"{module} ({err})")
    assert not missing, missing


def test_the_vllm_modules_share_one_gap_file(tmp_path, monkeypatch):
    """The AQN and padded modules add their records to vllm-gap.json beside the first module's, so the
    kit stays within the 8 files the device tool brings back."""
    from tests.gpu.test_gpu_vllm import record_gap

    monkeypatch.setenv("OUT", str(tmp_path))
    (tmp_path / "vllm-gap.json").write_text(json.dumps({"clean": {"tokens": 3}}))
    record_gap("fp32_norms", {"tokens": 4})
    record_gap("padded", {"tokens": 5})
    assert json.loads((tmp_path / "vllm-gap.json").read_text()) == {
        "clean": {"tokens": 3}, "fp32_norms": {"tokens": 4}, "padded": {"tokens": 5},
    }  # fmt: skip
    assert [p.name for p in tmp_path.iterdir()] == ["vllm-gap.json"]


# a CUDA machine's python as gpu_check.sh's probes see it, without pydantic; notes a pytest start
FAKE_CUDA_PYTHON = """#!/usr/bin/env bash
case "$*" in
  --version) echo "Python 3.11.9" ;;
  -) cat >/dev/null; echo "python 3.11.9 on x86_64" ;;
  *"import pydantic"*) exit 1 ;;
  *pytest*) echo PYTEST-RAN >>"$CALLS" ;;
  *) exit 0 ;;
esac
"""


def test_gpu_check_does_not_start_the_tests_without_pydantic(tmp_path):
    """qerl's configs import pydantic (importing qerl does not): without it gpu_check.sh reports the
    tests not started, quoting what the caller said of the environment ($QERL_GPU_ENV_NOTE's first
    line; the report has all of it), instead of running tests that all error at setup."""
    fake = tmp_path / "python"
    fake.write_text(FAKE_CUDA_PYTHON)
    fake.chmod(0o755)
    calls = tmp_path / "calls"
    note = "the image's own packages\nsecond line of the note"
    env = {**os.environ, "PYTHON": str(fake), "OUT": str(tmp_path / "out"), "CALLS": str(calls),
           "QERL_GPU_ENV_NOTE": note}  # fmt: skip
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu" / "gpu_check.sh"), "--tests-only", "--no-vllm"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 5, proc.stderr  # nothing failed; the run is incomplete
    assert (
        f"tests: not started: qerl needs pydantic, which {fake} cannot import (the image's own packages)"
        in proc.stderr
    )
    assert not calls.exists()
    report = (tmp_path / "out" / "gpu-check.md").read_text()
    assert "| test_gpu | 0 | not started: no pydantic (the image's own packages) |" in report
    assert "second line of the note" in report


@pytest.mark.slow  # about 2 min on an idle 2-core machine (child processes import torch, two start vLLM)
@pytest.mark.kit
def test_gpu_check_dry_run(tmp_path):
    """``gpu_check.sh --dry-run`` on the CPU: the gpu tests skip, both benchmarks run at tiny shapes,
    the results are written under $OUT (no more files than the device tool brings back), and
    benchmarks/results is left alone."""
    results = ROOT / "benchmarks" / "results"
    before = {p.name: p.stat().st_mtime_ns for p in results.iterdir()}
    env = {**os.environ, "OUT": str(tmp_path)}
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu" / "gpu_check.sh"), "--dry-run"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = (tmp_path / "gpu-check.md").read_text()
    assert "mode: dry-run" in report and "SKIPPED" in report and "INCOMPLETE" not in report
    for part in (
        "test_gpu_vllm",
        "test_gpu_vllm_aqn",
        "test_gpu_vllm_padded",
        "test_gpu",
        "bench_vllm",
        "bench_gpu",
    ):
        assert re.search(rf"^\| {part} \| \d+ \| exit 0 \|$", report, re.M), part
    assert "| tiny | nvfp4 |" in report and "| tiny | bf16 |" in report
    assert (
        "| tiny | nvfp4 | vllm-nvfp4-emulated |" in report and "| tiny | bf16 | vllm-unquantized |" in report
    )
    data = json.loads((tmp_path / "gpu.json").read_text())
    assert data["mode"] == "dry-run-cpu" and all("peak_bytes" in a for a in data["train"])
    vllm = json.loads((tmp_path / "vllm.json").read_text())
    assert vllm["mode"] == "dry-run-cpu" and all(r["tokens"] > 0 for r in vllm["models"]["tiny"].values())
    assert len([p for p in tmp_path.rglob("*") if p.is_file()]) <= 8  # what the device tool brings back
    assert {p.name: p.stat().st_mtime_ns for p in results.iterdir()} == before


@pytest.mark.slow  # about 30 s
@pytest.mark.kit
def test_gpu_check_budget_cuts_parts_and_says_so(tmp_path):
    """``--budget-s``: parts run under what is left of the budget; one that would get too little is
    not started, one that runs past it is cut off; the report's parts table says which, and the exit
    status is 5 (incomplete, nothing failed)."""
    env = {**os.environ, "OUT": str(tmp_path), "QERL_GPU_PART_MIN_S": "5", "QERL_GPU_REPORT_RESERVE_S": "0"}
    script = str(ROOT / "scripts" / "gpu" / "gpu_check.sh")
    proc = subprocess.run(
        ["bash", script, "--dry-run", "--budget-s", "25"], capture_output=True, text=True, env=env, cwd=ROOT
    )
    assert proc.returncode == 5, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = (tmp_path / "gpu-check.md").read_text()
    assert "INCOMPLETE" in report and "budget 25s" in report
    assert re.search(r"^\| bench_vllm \| \d+ \| (cut off at the budget|not started: .*) \|$", report, re.M)
    assert re.search(r"^\| bench_gpu \| 0 \| not started: -?\d+s of the 25s budget left \|$", report, re.M)
    bad = subprocess.run(["bash", script, "--dry-run", "--budget-s", "soon"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--budget-s takes whole seconds, not 'soon'" in bad.stderr


@pytest.mark.kit
def test_gpu_check_runs_the_test_files_it_is_given(tmp_path):
    """``--test-files``: one GPU test file can run alone (gpu_validate.sh's padded item); a name
    that is no GPU test file is refused before anything runs."""
    env = {**os.environ, "OUT": str(tmp_path)}
    script = str(ROOT / "scripts" / "gpu" / "gpu_check.sh")
    only = "tests/gpu/test_gpu_vllm_padded.py"
    args = ["bash", script, "--dry-run", "--tests-only", "--test-files", only]
    proc = subprocess.run(args, capture_output=True, text=True, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    parts = re.findall(r"^\| (test_gpu\w*) \| \d+ \| (.*) \|$", (tmp_path / "gpu-check.md").read_text(), re.M)
    assert parts == [("test_gpu_vllm_padded", "exit 0")]
    bad = subprocess.run(
        [*args[:-1], "tests/pipeline/test_engines.py"], capture_output=True, text=True, cwd=ROOT
    )
    assert bad.returncode == 2 and "no GPU test file 'tests/pipeline/test_engines.py'" in bad.stderr


def test_deterministic_kernels_switch_on_cuda_only_and_restore_what_was_there(monkeypatch):
    """The switch the GPU trainer runs under (its effect, identical bytes, is the CUDA test below): on
    the CPU it changes nothing; for CUDA it sets torch's and cuDNN's flags for the block and puts the
    previous ones back, and the cuBLAS workspace config is set only where the user set none."""
    from qerl.pipeline.runtime.determinism import CUBLAS_ENV, deterministic_kernels, prepare_process

    flags = lambda: (  # noqa: E731
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    before = flags()
    with deterministic_kernels("cpu", True) as record:
        assert record == {} and flags() == before
    monkeypatch.delenv(CUBLAS_ENV, raising=False)
    with deterministic_kernels("cuda", True) as record:
        assert flags() == (True, False, True, False)  # warn_only would leave attention's backward as is
        assert record == {"deterministic": True, CUBLAS_ENV: ":4096:8"}
    assert flags() == before
    with deterministic_kernels("cuda", False) as record:
        assert record == {"deterministic": False} and flags() == before
    monkeypatch.setenv(CUBLAS_ENV, ":0:0")
    prepare_process()
    assert os.environ[CUBLAS_ENV] == ":0:0"  # the user's own setting stays (the step then warns)


# -- CUDA -----------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_triton_kernels_bit_exact_on_cuda(cuda):
    from qerl.kernels import nvfp4_dispatch
    from qerl.kernels.nvfp4_reference import FP4_VALUES, dequantize_nvfp4, pack_codes, quantize_nvfp4
    from qerl.kernels.nvfp4_triton import (
        dequantize_nvfp4_triton,
        quantize_nvfp4_triton,
        round_fp8_e4m3_triton,
    )

    from tests.kernels.test_nvfp4_kernels import _adversarial, _adversarial_packed

    assert (
        nvfp4_dispatch.quantize_backend(cuda) == "triton"
        and nvfp4_dispatch.dequantize_backend(cuda) == "triton"
    )
    # truth table: every code decodes to its value, sign of zero included
    packed = pack_codes(torch.arange(16, dtype=torch.uint8).reshape(1, 16))
    one = torch.ones(1, 1).to(torch.float8_e4m3fn)
    deq = dequantize_nvfp4_triton(packed.to(cuda), one.to(cuda), 1.0, torch.float32).cpu()[0]
    assert deq[:8].tolist() == list(FP4_VALUES) and deq[9:].tolist() == [-v for v in FP4_VALUES[1:]]
    assert deq[8].item() == 0.0 and torch.signbit(deq[8])
    # ties: amax 6 gives global scale 448 and block scale 448, so each quotient is the value itself and
    # sits exactly on a rounding boundary (the cases an approximate division gets wrong)
    ties = torch.tensor(
        [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -2.5, -5.0, 0.0, -0.0, 5.5, -6.0]
    )
    assert all(
        _same(a, b)
        for a, b in zip(quantize_nvfp4(ties[None]), quantize_nvfp4_triton(ties[None].to(cuda)), strict=True)
    )
    # FP8 E4M3 rounding, value by value, against torch's cast on the GPU
    g = torch.Generator().manual_seed(3)
    x = torch.cat([torch.rand(1 << 20, generator=g) * 460, torch.rand(1 << 16, generator=g) * 0.03])
    x = torch.cat([x, torch.tensor([7.85, 15.5, 448.0, 2.0**-9, 3 * 2.0**-11])]).to(cuda)
    assert torch.equal(round_fp8_e4m3_triton(x), x.clamp(max=448).to(torch.float8_e4m3fn).float())
    # adversarial and random weights, many program blocks, a ragged last block
    weights = _adversarial(0) + _adversarial(1) + [torch.randn(4099, 528, generator=g) * 0.02]
    for w in weights:
        ref = quantize_nvfp4(w)
        assert all(_same(a, b) for a, b in zip(ref, quantize_nvfp4_triton(w.to(cuda)), strict=True))
        assert all(_same(a, b) for a, b in zip(ref, nvfp4_dispatch.quantize(w.to(cuda)), strict=True))
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        for packed, scale, gs in _adversarial_packed(0) + _adversarial_packed(1):
            ref = dequantize_nvfp4(packed, scale, gs, dtype)
            assert _same(ref, dequantize_nvfp4_triton(packed.to(cuda), scale.to(cuda), gs.to(cuda), dtype))


@pytest.fixture(scope="module")
def cuda_checkpoints(request, tmp_path_factory):
    """The tiny model quantized by the real quantize stage on CUDA (Triton), and its bf16 twin."""
    if not CUDA:  # before the tiny model is built: nothing to do on a CPU
        pytest.skip("needs a CUDA GPU: run `bash scripts/gpu/gpu_check.sh` on one")
    tiny_model_dir = request.getfixturevalue("tiny_model_dir")
    from qerl.pipeline.nvfp4.recipe import QuantizeConfig
    from qerl.pipeline.store.artifact_store import ArtifactStore
    from qerl.stages.dequantize import run as run_twin
    from qerl.stages.quantize import run as quantize

    store = ArtifactStore(tmp_path_factory.mktemp("gpu-store"))
    manifest = quantize(QuantizeConfig(), str(tiny_model_dir), store)
    return manifest, run_twin(QuantizeConfig(twin_dtype="bfloat16"), manifest, store)


@pytest.mark.gpu
def test_quantize_stage_on_cuda_matches_the_reference(cuda, cuda_checkpoints):
    from qerl.kernels.nvfp4_reference import global_scale, quantize_nvfp4
    from safetensors.torch import load_file

    manifest, _ = cuda_checkpoints
    assert manifest.mode == "nvfp4/triton"
    ours = {k: v for f in manifest.dir.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    source = Path(manifest.extra["source"])
    src = {k: v for f in source.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    fused = {"q_proj": ("q_proj", "k_proj", "v_proj"), "k_proj": ("q_proj", "k_proj", "v_proj")}
    fused |= {
        "v_proj": fused["q_proj"],
        "gate_proj": ("gate_proj", "up_proj"),
        "up_proj": ("gate_proj", "up_proj"),
    }
    for key in [k for k in ours if k.endswith(".weight_packed")]:
        base = key[: -len(".weight_packed")]
        prefix, proj = base.rsplit(".", 1)
        group = [src[f"{prefix}.{p}.weight"] for p in fused.get(proj, (proj,))]
        amax = max(float(w.float().abs().max()) for w in group)  # the stage's shared scale of a fused group
        ref = quantize_nvfp4(src[f"{base}.weight"], None if len(group) == 1 else global_scale(amax))
        got = (
            ours[f"{base}.weight_packed"],
            ours[f"{base}.weight_scale"],
            ours[f"{base}.weight_global_scale"],
        )
        assert all(_same(a, b) for a, b in zip(ref, got, strict=True)), base


def _lora_grads(model, mb) -> dict[str, torch.Tensor]:
    from qerl.pipeline.rl.logprobs import completion_logprobs

    model.zero_grad(set_to_none=True)
    logp, _ = completion_logprobs(model, mb, 1.0)
    weights = torch.linspace(-1, 1, logp.numel(), device=logp.device).reshape(logp.shape)
    (logp * weights).sum().backward()
    return {
        n.replace(".base_layer", ""): p.grad.clone() for n, p in model.named_parameters() if p.requires_grad
    }


@pytest.mark.gpu
def test_gptq_on_cuda_agrees_with_the_cpu(cuda, tiny_model_factory, tmp_path, monkeypatch):
    """``quantize.method: gptq`` runs on the GPU where there is one (mode ``nvfp4/torch-cuda``). Its
    float32 sums differ from the CPU's in the last bits, so a few codes may round the other way; the
    checkpoints must otherwise agree (>= 99% of packed code bytes and of block scales)."""
    from qerl.pipeline.data.datasets import DataConfig
    from qerl.pipeline.nvfp4.recipe import QuantizeConfig
    from qerl.pipeline.nvfp4.safetensors_io import iter_quantized_linears
    from qerl.pipeline.store.artifact_store import ArtifactStore
    from qerl.stages import quantize as stage

    cfg = QuantizeConfig.model_validate(
        {
            "method": "gptq",
            "calibration": {"source": "train", "count": 24, "max_tokens": 48, "act_order": True},
        }
    )
    src = tiny_model_factory(arch="llama", dtype=torch.float32)
    gpu = stage.run(cfg, src, ArtifactStore(tmp_path / "gpu"), DataConfig())
    monkeypatch.setattr(stage, "_device", lambda: torch.device("cpu"))
    cpu = stage.run(cfg, src, ArtifactStore(tmp_path / "cpu"), DataConfig())
    assert (gpu.mode, cpu.mode) == ("nvfp4/torch-cuda", "nvfp4/torch")
    ours, theirs = dict(iter_quantized_linears(gpu.dir)), dict(iter_quantized_linears(cpu.dir))
    assert ours.keys() == theirs.keys() and ours
    for i, what in ((0, "packed codes"), (1, "block scales")):
        a = [ours[k][i].contiguous().view(torch.uint8) for k in ours]
        b = [theirs[k][i].contiguous().view(torch.uint8) for k in ours]
        same = sum(int((x == y).sum()) for x, y in zip(a, b, strict=True))
        assert same / sum(x.numel() for x in a) >= 0.99, (what, same)


@pytest.mark.gpu
@pytest.mark.parametrize("checkpointing", [False, True])
def test_nvfp4_linear_and_lora_grads_on_cuda_equal_dense_bf16(
    cuda, cuda_checkpoints, tmp_path, checkpointing
):
    """Our packed model on CUDA vs an HF model holding dequant(W) in bf16: same logits, same LoRA grads."""
    import shutil

    from qerl.pipeline.nvfp4.linear import NVFP4Linear
    from qerl.pipeline.nvfp4.loading import load_dequantized, load_for_training
    from qerl.pipeline.rl.policy import init_state
    from qerl.pipeline.rl.train_config import TrainConfig

    from tests.pipeline.test_qlinear import _minibatch

    ckpt = cuda_checkpoints[0].dir
    qmodel = load_for_training(ckpt, device="cuda")
    ref = load_dequantized(ckpt, device="cuda")
    assert sum(isinstance(m, NVFP4Linear) for m in qmodel.modules()) == 7 * qmodel.config.num_hidden_layers
    assert qmodel.model.layers[0].mlp.up_proj.weight_packed.is_cuda
    ids = torch.tensor([[3, 50, 7, 99, 12, 4]], device="cuda")
    assert torch.equal(qmodel(input_ids=ids).logits, ref(input_ids=ids).logits)
    dense_dir = tmp_path / "dense"
    ref.save_pretrained(dense_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (ckpt / name).is_file():
            shutil.copy(ckpt / name, dense_dir / name)
    cfg = TrainConfig(lora_r=4, lora_alpha=8, seed=5, gradient_checkpointing=checkpointing)
    ours, dense = init_state(ckpt, cfg, device="cuda"), init_state(dense_dir, cfg, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    dense_params = dict(dense.model.named_parameters())
    with torch.no_grad():  # non-zero lora_B so lora_A gets a gradient too; identical LoRA in both
        for name, p in ours.model.named_parameters():
            if p.requires_grad:
                if "lora_B" in name:
                    p.normal_(0, 0.1, generator=gen)
                dense_params[name].copy_(p)
    mb = _minibatch()
    g_ours, g_dense = _lora_grads(ours.model, mb), _lora_grads(dense.model, mb)
    assert g_ours.keys() == g_dense.keys() and len(g_ours) == 2 * 7 * 2
    for name in g_ours:
        assert g_ours[name].is_cuda and float(g_dense[name].abs().max()) > 0, name
        # same bf16 weights, same GEMMs (F.linear forward, grad_out @ W backward): bit-identical
        assert torch.equal(g_ours[name], g_dense[name]), name


@pytest.mark.gpu
def test_grpo_step_on_cuda_and_its_checkpoint_reloads_bit_exactly(cuda, cuda_checkpoints, tmp_path):
    from qerl.pipeline.rl.batch import RolloutBatch
    from qerl.pipeline.rl.checkpoint import load_checkpoint, save_checkpoint
    from qerl.pipeline.rl.policy import init_state
    from qerl.pipeline.rl.step import train_step
    from qerl.pipeline.rl.train_config import TrainConfig

    ckpt = cuda_checkpoints[0].dir
    cfg = TrainConfig(lora_r=4, lora_alpha=8, seed=3, gradient_checkpointing=True, lr=1e-3)
    state = init_state(ckpt, cfg, device="cuda")
    assert state.base_format == "nvfp4"
    batch = RolloutBatch(
        prompt_ids=[[5, 6, 7, 8]] * 4,
        completion_ids=[[11, 12, 13], [14, 15, 16, 17], [18, 19], [20, 21, 22]],
        sampler_logprobs=[[-5.0] * 3, [-5.0] * 4, [-5.0] * 2, [-5.0] * 3],
        truncated=[False] * 4,
        rewards=[1.0, 0.0, 1.0, 0.0],
        group_ids=[0] * 4,
    )
    before = {n: p.detach().clone() for n, p in state.model.named_parameters() if p.requires_grad}
    metrics = train_step(state, batch, cfg)
    assert (
        metrics["updates"] == 1 and not metrics["skipped"] and torch.isfinite(torch.tensor(metrics["loss"]))
    )
    after = {n: p.detach().clone() for n, p in state.model.named_parameters() if p.requires_grad}
    assert all(t.is_cuda for t in after.values())
    assert any(not torch.equal(before[n], after[n]) for n in after)  # the update moved the adapter
    save_checkpoint(state, tmp_path / "ckpt")
    again = load_checkpoint(ckpt, cfg, tmp_path / "ckpt", device="cuda")
    reloaded = {n: p.detach() for n, p in again.model.named_parameters() if p.requires_grad}
    assert reloaded.keys() == after.keys() and all(_same(after[n], reloaded[n]) for n in after)
    old_opt, new_opt = state.optimizer.state_dict()["state"], again.optimizer.state_dict()["state"]
    assert old_opt.keys() == new_opt.keys()
    for idx in old_opt:
        for key, value in old_opt[idx].items():
            assert _same(value, new_opt[idx][key]), (idx, key)
    assert (again.step, again.updates) == (state.step, state.updates)
    assert train_step(again, batch, cfg)["updates"] == 1  # and it trains on from there


@pytest.mark.gpu
def test_two_grpo_steps_at_realistic_lengths_give_identical_bytes_with_deterministic_kernels(cuda, tmp_path):
    """``train.deterministic`` (qerl.pipeline.runtime.determinism): two GRPO steps on 8 sequences of
    256 prompt + 1,024 completion tokens, run twice from the same start, give the same adapter and
    AdamW bytes, as a rebuilt checkpoint (resume, heal) must. Also measured, not asserted: the same
    without the switch (do the bytes differ there?) and the step time each way ($OUT/determinism.json)."""
    import statistics
    import time

    from qerl.pipeline.demo.tiny_model import build_tiny_model
    from qerl.pipeline.nvfp4.recipe import QuantizeConfig
    from qerl.pipeline.rl.batch import RolloutBatch
    from qerl.pipeline.rl.policy import init_state
    from qerl.pipeline.rl.step import train_step
    from qerl.pipeline.rl.train_config import TrainConfig
    from qerl.pipeline.runtime.determinism import deterministic_kernels
    from qerl.pipeline.store.artifact_store import ArtifactStore
    from qerl.stages.quantize import run as quantize

    sizes = dict(hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=2, intermediate_size=1536)
    base = build_tiny_model(tmp_path / "model", max_position_embeddings=2048, **sizes)
    ckpt = quantize(QuantizeConfig(), str(base), ArtifactStore(tmp_path / "store")).dir
    vocab = json.loads((base / "config.json").read_text())["vocab_size"]
    gen = torch.Generator().manual_seed(0)
    prompt, completion, n = 256, 1024, 8
    batch = RolloutBatch(
        prompt_ids=torch.randint(3, vocab, (n, prompt), generator=gen).tolist(),
        completion_ids=torch.randint(3, vocab, (n, completion), generator=gen).tolist(),
        sampler_logprobs=(-6.0 - torch.rand(n, completion, generator=gen)).tolist(),
        truncated=[False] * n,
        rewards=[1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0],
        group_ids=[0] * 4 + [1] * 4,
    )
    cfg = TrainConfig(
        lora_r=16, lora_alpha=32, seed=5, lr=1e-4, minibatch_size=4, gradient_checkpointing=True
    )

    def two_steps(deterministic: bool) -> tuple[dict[str, torch.Tensor], list[float]]:
        state = init_state(ckpt, cfg, device="cuda")
        times = []
        with deterministic_kernels("cuda", deterministic):
            for _ in range(2):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                assert not train_step(state, batch, cfg)["skipped"]
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
        out = {n: p.detach().clone() for n, p in state.model.named_parameters() if p.requires_grad}
        for idx, entry in state.optimizer.state_dict()["state"].items():
            out.update(
                {f"adamw.{idx}.{k}": v.detach().clone() for k, v in entry.items() if torch.is_tensor(v)}
            )
        return out, times

    runs, errors = {True: [], False: []}, {}
    for _ in range(2):  # interleaved, so neither switch gets the warmer machine
        for flag in (True, False):
            if flag in errors:
                continue
            try:
                runs[flag].append(two_steps(flag))
            except RuntimeError as exc:  # an op with no deterministic variant names itself here
                errors[flag] = str(exc)[:800]
    runs = {f: r for f, r in runs.items() if len(r) == 2}
    same = {f: all(_same(a, r[1][0][k]) for k, a in r[0][0].items()) for f, r in runs.items()}
    # the second step of each run: the first carries allocator and Triton warm-up
    step_s = {f: statistics.median(t[1] for _, t in r) for f, r in runs.items()}
    all_s = {("deterministic" if f else "default_kernels"): [t for _, t in r] for f, r in runs.items()}
    record = {
        "sequences": n,
        "tokens_per_sequence": prompt + completion,
        "model": sizes,
        "identical_bytes": {"deterministic": same.get(True), "default_kernels": same.get(False)},
        "step_s": {"deterministic": step_s.get(True), "default_kernels": step_s.get(False)},
        "cost_ratio": step_s[True] / step_s[False] if len(step_s) == 2 else None,
        "step_s_all": all_s,  # each run's two steps, in the order they ran
        "errors": {("deterministic" if f else "default_kernels"): e for f, e in errors.items()},
        "device": torch.cuda.get_device_name(0),
    }
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / "determinism.json").write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record))
    assert not errors and same[True], record


@pytest.mark.gpu
def test_hf_engine_generates_on_cuda_from_the_twin(cuda, cuda_checkpoints):
    """The transformers engine puts the twin on the GPU and records the logprobs of what it sampled:
    checked against a float32 CPU forward of the same weights (bf16 on the GPU: 0.05 nats)."""
    from qerl.pipeline.rollout.config import RolloutConfig
    from qerl.pipeline.rollout.factory import build_engine
    from qerl.pipeline.rollout.hf_engine import HFEngine
    from qerl.pipeline.rollout.protocol import SamplingSpec
    from transformers import AutoModelForCausalLM

    twin = cuda_checkpoints[1]
    cfg = RolloutConfig(engine="hf", max_new_tokens=12, max_model_len=64, template="terse", dtype="bfloat16")
    engine = build_engine(cfg, cuda_checkpoints[0], twin)
    try:
        assert isinstance(engine, HFEngine) and engine.mode == "hf-nvfp4-emulated"
        assert engine.info["device"] == "cuda"
        assert next(engine.base.parameters()).is_cuda
        out = engine.generate(
            ["1 + 2 =", "What is 7 - 3?"], 2, SamplingSpec(temperature=1.0, max_new_tokens=12), seed=0
        )
        again = engine.generate(
            ["1 + 2 =", "What is 7 - 3?"], 2, SamplingSpec(temperature=1.0, max_new_tokens=12), seed=0
        )
    finally:
        engine.close()
    assert [[c.completion_ids for c in row] for row in out] == [
        [c.completion_ids for c in row] for row in again
    ]
    cpu = AutoModelForCausalLM.from_pretrained(twin.dir, dtype=torch.float32).eval()
    for row in out:
        assert len(row) == 2
        for c in row:
            assert c.completion_ids and len(c.logprobs) == len(c.completion_ids)
            ids = torch.tensor([c.prompt_ids + c.completion_ids])
            with torch.no_grad():
                logp = torch.log_softmax(cpu(input_ids=ids).logits[0, len(c.prompt_ids) - 1 : -1].float(), -1)
            want = logp.gather(-1, torch.tensor(c.completion_ids)[:, None])[:, 0]
            assert torch.allclose(torch.tensor(c.logprobs), want, atol=0.05), (c.logprobs, want.tolist())


def _bench_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "benchmarks" / "bench_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_report_records_oom_and_merges_runs(tmp_path):
    """An arm that ran out of memory is a result row, and --merge keeps the other models' arms."""
    bench = _bench_module()
    from qerl.pipeline.planning.model_shape import KNOWN_SHAPES

    shape = KNOWN_SHAPES["qwen2.5-32b"].__dict__
    arms = [
        {"shape": shape, "base": "nvfp4", "peak_bytes": 40 * 2**30, "weights_bytes": 20 * 2**30,
         "times": [9.0, 11.0], "loss": 0.1, "phase": "done", "plan_bytes": 41 * 2**30},
        {"shape": shape, "base": "bf16", "oom": True, "phase": "warm-up update", "error": "CUDA out of memory",
         "peak_bytes_at_oom": 78 * 2**30, "weights_bytes": 61 * 2**30, "plan_bytes": 80 * 2**30},
    ]  # fmt: skip
    report = {
        "device_name": "NVIDIA H100", "cpus": 16, "torch": "x", "triton": "x", "transformers": "x", "peft": "x",
        "dry_run": False, "mode": "cuda", "batch": dict(bench.PAPER), "steps": 2, "train": arms, "kernels": None,
    }  # fmt: skip
    text = bench.render(report)
    assert "| qwen2.5-32b | bf16 | 61.00 | - | 80.00 | - | **OOM** in warm-up update (78.00 GiB" in text
    assert "| qwen2.5-32b | nvfp4 | 20.00 | 40.00 | 41.00 | 10.00 |" in text
    assert "the NVFP4 base trains in 40.00 GiB; the bf16 base does not fit" in text
    (tmp_path / "gpu.json").write_text(json.dumps(report))
    fresh = {**report, "train": [], "kernels": None}
    bench._merge_previous(fresh, tmp_path / "gpu.json", ["7b"], ["nvfp4", "bf16"])
    assert [a["base"] for a in fresh["train"]] == ["nvfp4", "bf16"]  # 32b kept: this run is 7b only
    again = {**report, "train": []}
    bench._merge_previous(again, tmp_path / "gpu.json", ["32b"], ["nvfp4", "bf16"])
    assert again["train"] == []  # 32b is being re-run: its old arms go
    other_arm = {**report, "train": []}
    bench._merge_previous(other_arm, tmp_path / "gpu.json", ["32b"], ["nf4"])
    assert [a["base"] for a in other_arm["train"]] == ["nvfp4", "bf16"]  # a 32b NF4 row joins them
    with pytest.raises(SystemExit, match="another setup"):
        bench._merge_previous({**report, "steps": 3}, tmp_path / "gpu.json", ["7b"], ["nvfp4"])


@pytest.mark.kit
def test_bench_gpu_times_the_deterministic_switch_and_qloras_base_beside_the_plain_arm(tmp_path):
    """``--arms nvfp4,nvfp4-det,nf4``: the same NVFP4 update with and without train.deterministic's
    kernels, and the update on QLoRA's NF4 base, each in its own process, and the ratios of their
    times and peaks (on the CPU the switch changes no kernel, so this checks the plumbing; its cost
    is a GPU figure)."""
    bench = _bench_module()
    args = bench.parse_args(
        ["--dry-run", "--arms", "nvfp4,nvfp4-det,nf4", "--skip-kernels", "--out-dir", str(tmp_path)]
    )
    report = bench.main(args)
    arms = {a["arm"]: a for a in report["train"]}
    assert set(arms) == {"nvfp4", "nvfp4-det", "nf4"}, report["train"]
    # the NF4 arm trains on bitsandbytes' layers, as QLoRA does (lm_head stays a plain Linear)
    assert arms["nf4"]["layers"] == ["Linear", "Linear4bit"] and arms["nf4"]["times"]
    assert arms["nvfp4"]["layers"] == ["Linear", "NVFP4Linear"]
    assert arms["nvfp4-det"]["base"] == "nvfp4" and arms["nvfp4-det"]["deterministic"] is True
    assert arms["nvfp4"]["deterministic"] is False and all(a.get("times") for a in arms.values())
    text = (tmp_path / "gpu.md").read_text()
    assert "| tiny | nvfp4-det |" in text
    assert re.search(r"- tiny, nvfp4 base: deterministic kernels / default, time \*\*\d+\.\d\dx\*\*", text)
    assert re.search(r"- tiny: NVFP4 / NF4 \(QLoRA's base\) peak \*\*\d+\.\d\dx\*\*", text)
    with pytest.raises(SystemExit):
        bench.parse_args(["--dry-run", "--arms", "nvfp4,fp8"])
