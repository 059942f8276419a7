#!/usr/bin/env python3
"""Before a GPU lease: vLLM's CUDA code paths with qerl's engine, as far as they go without a GPU.

It runs in the CPU replica of the GPU image that ``tools/gpu_transfer/gpu_replica.sh`` builds in ``.gpu-replica``:
Python 3.12, the image's torch 2.11.0+cu130 and the image's packages that vLLM and qerl read, the
bundles (vLLM 0.26) appended after them by gpu_offline.sh's own sitecustomize, a ``libcuda.so.1`` whose every entry
point answers "no device" (``tools/gpu_transfer/gpu_replica_build.py``), and the vLLM plugins of
``tools/gpu_transfer/gpu_replica_platform.py`` (an H200's capability 9.0; a stop at the worker's ``init_device``). Each check stops where a GPU is
first needed: whatever fails before that point fails on the lease too, where a try costs minutes of
a 15-minute budget, while here it costs seconds. With ``--user-install`` the script builds
``.gpu-replica-user`` instead: a user's GPU install (``requirements/gpu.txt`` from the registry: vLLM
0.26.0's CUDA build on torch 2.11.0+cu130; with ``--requirements requirements/gpu-untested-vllm032.txt``
the untested vLLM 0.32 on torch 2.13.0+cu130), with the same driver and plugins.

1. imports: every root of the bundle's import scan imports under vLLM's CUDA platform.
2. scheme: vLLM reads the quantize stage's checkpoint (the kit test's Marlin-sized Qwen2) and, under
   the engine's kernel settings (``linear_backend="marlin"``), gives every linear layer the W4A16 FP4
   scheme on the Marlin kernel, and ``lm_head`` none. It also reports the kernel vLLM picks on its
   own (0.26: Marlin; 0.32 on an H200: Humming), which is why the engine names Marlin.
3. engine: qerl's vLLM engine, built by ``build_engine`` with the kit tests' config (CUDA graphs,
   LoRA, in-process; plain, for AQN, and on the padded test's SmolLM2-shaped Llama) and with
   ``bench_vllm``'s for both its arms and for a run
   with AQN, passes vLLM's argument parsing, config validation, model inspection and
   worker-extension injection and reaches the worker's ``init_device``, the first call that needs
   the GPU, in-process and in vLLM's engine-core process. It reports the model runner vLLM chose and the CUDA graph mode, and the
   worker resolves the model loader asked for (qerl's fp32-norm loader for an AQN engine).
4. requests: qerl's ``generate`` (group prefill, logprobs, a LoRA adapter) runs against an ``LLM``
   stand-in that binds every call to the installed vLLM's ``LLM`` signatures and answers with its own
   output classes, so the SamplingParams, TokensPrompt and LoRARequest qerl builds go through vLLM's
   validation and the output fields it reads exist.
5. model: vLLM builds the checkpoint's model on the meta device (its scheme objects included); the
   AQN worker extension names an FP4 scheme on FP4 Marlin (the engine's mode check), finds the norms the HF side noises, and, with them made
   real on the CPU and held in fp32 as qerl's loader leaves them, writes clean + the same noise into
   them exactly under compiled graphs; sigma 0 restores them bit for bit.
6. weights: vLLM's own loader fills the model, built on the CPU, from the checkpoint (the kit test's
   Qwen2, then the padded test's SmolLM2-shaped Llama, whose padding comes after loading); every
   parameter is compared with the checkpoint, fused layers' global scales must agree, and Marlin's
   conversion of the block scales must keep them (``tools/gpu_transfer/gpu_replica_weights.py``).
7. run: ``qerl run --config demo-gpu`` end to end (two steps, the transformers engine) with the run
   bundle: Prefect's temporary server, MLflow's registry and math-verify on the image's Python and
   packages, as the kit's ``--run-only`` part needs them (skipped without the run bundle).

Not checked (a GPU is needed): Marlin's repacking (``gptq_marlin_repack``), CUDA graph capture, the
sampler, the Triton kernels compiled, anything the kit's tests measure.

Usage: bash tools/gpu_transfer/gpu_replica.sh (builds the replica, then runs this with its environment)
       .gpu-replica/bin/python tools/gpu_transfer/gpu_replica_check.py [--work DIR] [--report FILE]  (exit 1: findings)
"""

from __future__ import annotations

import argparse
import inspect
import logging
import re
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "gpu_transfer"))
log = logging.getLogger("gpu_replica_check")
REPORT: list[Path] = []  # --report: the lines for people also go there (vLLM's log goes to stdout)


def say(line: str) -> None:
    print(line, flush=True)
    for path in REPORT:
        with path.open("a") as f:
            f.write(line + "\n")


def check_imports() -> list[str]:
    from gpu_bundle import read_list
    from gpu_import_roots import import_each

    failed = import_each(read_list(ROOT / "tools" / "gpu_transfer" / "gpu_vllm_roots.txt"))
    return [f"import {name}: {err}" for name, err in failed.items() if err]


def check_scheme(model_dir: Path) -> list[str]:
    import json

    import torch
    from qerl.pipeline.rollout.vllm_engine import FP4_MARLIN_ARGS
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )
    from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM

    qcfg = CompressedTensorsConfig.from_config(
        json.loads((model_dir / "config.json").read_text())["quantization_config"]
    )
    qcfg.packed_modules_mapping = dict(Qwen2ForCausalLM.packed_modules_mapping)  # as vLLM's loader sets it
    findings = []
    # under the engine's kernel settings (vLLM picks the kernel when it builds the scheme)
    args = EngineArgs(model=str(model_dir), dtype="bfloat16", max_model_len=256, **FP4_MARLIN_ARGS)
    with set_current_vllm_config(args.create_engine_config()):
        for name in (
            "self_attn.qkv_proj",
            "self_attn.o_proj",
            "mlp.gate_up_proj",
            "mlp.down_proj",
            "lm_head",
        ):
            layer = name if name == "lm_head" else f"model.layers.0.{name}"
            scheme = qcfg.get_scheme(torch.nn.Linear(1, 1), layer_name=layer)
            got = (
                type(scheme).__name__,
                getattr(scheme, "use_a16", None),
                type(getattr(scheme, "kernel", None)).__name__,
            )
            want = (
                ("NoneType", None, "NoneType")
                if name == "lm_head"
                else ("CompressedTensorsW4A4Fp4", True, "MarlinNvFp4LinearKernel")
            )
            say(f"  scheme {layer}: {got[0]} use_a16={got[1]} kernel={got[2]}")
            if got != want:
                findings.append(f"scheme for {layer}: {got}, expected {want}")
    # what vLLM would pick without the engine's settings (not a finding: the reason for them)
    with set_current_vllm_config(
        EngineArgs(model=str(model_dir), dtype="bfloat16", max_model_len=256).create_engine_config()
    ):
        own = qcfg.get_scheme(torch.nn.Linear(1, 1), layer_name="model.layers.0.mlp.down_proj")
    say(
        f"  scheme without the engine's kernel settings: kernel={type(getattr(own, 'kernel', None)).__name__}"
    )
    return findings


def pretend_cuda() -> None:
    """qerl plans the CUDA mode (vllm-nvfp4-marlin) in this process; vLLM stops at the GPU by itself
    (the replica's general plugin, tools/gpu_transfer/gpu_replica_platform.py)."""
    import qerl.pipeline.rollout.vllm_engine as vllm_engine
    from qerl.pipeline.runtime import device

    device.cuda_available = lambda: True
    vllm_engine.cuda_available = lambda: True


def check_engine(
    label: str, cfg: Any, quantized: Any, work: Path, aqn: bool = False
) -> tuple[list[str], dict[str, Any]]:
    """Build qerl's engine for ``cfg`` (``aqn``: for a run with AQN): it must stop at the worker's
    ``init_device`` and nowhere else, and the worker must find the model loader the engine asked for
    (qerl's fp32-norm loader for a compiled AQN engine, vLLM's default otherwise). The findings, and
    what the worker recorded."""
    import json
    import os

    from qerl.pipeline.rollout.factory import build_engine

    slug = re.sub(r"\W+", "-", label)
    reached = work / f"reached-{slug}.json"
    reached.unlink(missing_ok=True)
    os.environ["QERL_REPLICA_REACHED"] = str(reached)
    try:
        build_engine(cfg, quantized, None, aqn=aqn).close()
        error = "started (the replica has no GPU: its plugins are not loaded)"
    except BaseException as exc:  # noqa: BLE001 - whatever stops the start before the GPU is the finding
        if isinstance(exc, KeyboardInterrupt):
            raise
        error = _error(exc)
    if reached.exists():
        info = json.loads(reached.read_text())
        say(f"  engine {label}: reached init_device: {info}")
        want = "FP32NormsLoader" if aqn and not cfg.enforce_eager else "DefaultModelLoader"
        return (
            []
            if info.get("model_loader") == want
            else [f"engine {label}: model loader {info.get('model_loader')}, expected {want}"]
        ), info
    return [f"engine {label} stopped before the GPU: {error}"], {}


class RecordingLLM:
    """Binds each call to vLLM's own ``LLM`` signature; answers ``generate`` with vLLM's output classes."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def _bind(self, name: str, *args: Any, **kwargs: Any) -> None:
        from vllm import LLM

        inspect.signature(getattr(LLM, name)).bind(None, *args, **kwargs)  # TypeError names the argument
        self.calls.append(name)

    def generate(self, prompts: Any, params: Any, **kwargs: Any) -> list[Any]:
        from vllm import SamplingParams
        from vllm.logprobs import Logprob
        from vllm.lora.request import LoRARequest
        from vllm.outputs import CompletionOutput, RequestOutput

        self._bind("generate", prompts, params, **kwargs)
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if not all(isinstance(p, SamplingParams) for p in plist):
            raise TypeError(f"generate: sampling params that are not vLLM's SamplingParams: {plist}")
        lora = kwargs.get("lora_request")
        if lora is not None and not isinstance(lora, LoRARequest):
            raise TypeError(f"generate: lora_request {lora!r} is not vLLM's LoRARequest")
        outputs = []
        for k, (prompt, p) in enumerate(zip(prompts, plist, strict=True)):
            ids = list(range(3, 3 + min(p.max_tokens, 4)))
            logprobs = [{t: Logprob(logprob=-0.5)} for t in ids] if p.logprobs is not None else None
            done = CompletionOutput(
                index=0,
                text="",
                token_ids=ids,
                cumulative_logprob=None,
                logprobs=logprobs,
                finish_reason="length",
            )
            outputs.append(
                RequestOutput(
                    str(k), None, prompt["prompt_token_ids"], None, [done], True, num_cached_tokens=0
                )
            )
        return outputs

    def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> bool:
        self._bind("reset_prefix_cache", *args, **kwargs)
        return True

    def collective_rpc(self, method: Any, *args: Any, **kwargs: Any) -> list[Any]:
        self._bind("collective_rpc", method, *args, **kwargs)
        return []


def check_requests(cfg: Any, model_dir: Path, adapter: Path) -> list[str]:
    from qerl.pipeline.rollout.protocol import SamplingSpec
    from qerl.pipeline.rollout.vllm_engine import VLLMEngine, logprobs_mode_for
    from transformers import AutoTokenizer

    eng = object.__new__(VLLMEngine)  # no engine start: the requests only
    eng.cfg, eng.mode, eng.model_dir = cfg, "vllm-nvfp4-marlin", model_dir
    eng.logprobs_mode = logprobs_mode_for(cfg.sampling())
    eng.tokenizer = AutoTokenizer.from_pretrained(model_dir)
    eng.block_size, eng.last_prefix_stats, eng._lora_ids, eng._lora = 2, {}, {}, None
    eng.llm = RecordingLLM()
    try:
        eng.set_adapter(adapter, "ab" * 32)
        rows = eng.generate(
            ["1 + 2 =", "Count to five:"], 2, SamplingSpec(temperature=1.0, max_new_tokens=4), seed=0
        )
        eng.set_adapter(None, None)
    except BaseException as exc:  # noqa: BLE001
        if isinstance(exc, KeyboardInterrupt):
            raise
        return [f"requests: {_error(exc)}"]
    got = [len(c.logprobs) for row in rows for c in row]
    say(
        f"  requests: {len(eng.llm.calls)} LLM calls bound to vLLM's signatures ({', '.join(sorted(set(eng.llm.calls)))}); logprobs per completion {got}"
    )
    return [] if got == [4, 4, 4, 4] else [f"requests: completions {got}, expected 4 logprobs each"]


def check_model(model_dir: Path, work: Path) -> list[str]:
    """The replica's vLLM builds the checkpoint's model (meta device, as its loader would before the weights);
    the AQN worker extension finds the norms the HF side noises and names an FP4 scheme; the norms,
    made real on the CPU and held in fp32 as qerl's loader leaves them for a compiled engine, get
    clean + the same noise, exactly, and sigma 0 restores them."""
    import torch
    from gpu_replica_weights import build_vllm_model
    from qerl.pipeline.rollout.aqn import layer_noise, noise_targets
    from qerl.pipeline.rollout.aqn_vllm import AQNWorkerExtension, hold_norms_fp32
    from qerl.pipeline.rollout.factory import MARLIN_MODE
    from qerl.pipeline.rollout.vllm_engine import linears_error
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg, model = build_vllm_model(model_dir, work, "meta")

    class Worker(AQNWorkerExtension):  # what vLLM's worker gives the extension
        vllm_config = cfg

        def get_model(self) -> torch.nn.Module:
            return model

    worker, findings = Worker(), []
    schemes = worker.qerl_describe_quant()
    problem = linears_error(MARLIN_MODE, schemes)
    if problem:
        findings.append(f"model: the engine would refuse its mode: {problem}")
    targets = worker._qerl_norm_modules()
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    hf_keys = sorted((i, k) for i, k, _ in noise_targets(hf.named_modules()).values())
    if sorted((i, k) for i, k, _ in targets.values()) != hf_keys:
        findings.append(f"model: AQN targets {sorted(targets)} differ from the HF side's {hf_keys}")
    weights = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        weights.update(load_file(f))
    clean = {}
    for name, (_, _, module) in targets.items():
        clean[name] = weights[f"{name}.weight"]
        module.weight = torch.nn.Parameter(clean[name].clone(), requires_grad=False)
    if hold_norms_fp32(model) != len(targets):  # what qerl's loader does once vLLM's has loaded
        findings.append("model: the fp32-norm loader did not convert every AQN norm")
    stats = worker.qerl_set_norm_noise(0.05, 11)
    if stats["graphs_frozen"] != 1.0:  # the default config compiles and captures graphs
        findings.append("model: the extension does not see a compiled engine")
    for name, (layer, kind, module) in targets.items():
        want = clean[name].float() + layer_noise(11, layer, clean[name].numel(), 0.05)[kind]
        if module.weight.dtype != torch.float32 or not torch.equal(module.weight, want):
            findings.append(f"model: {name} after set_noise is not clean + the HF side's noise in fp32")
    worker.qerl_set_norm_noise(0.0, 11)
    if not all(torch.equal(m.weight, clean[n].float()) for n, (_, _, m) in targets.items()):
        findings.append("model: sigma 0 did not restore the clean norm weights exactly")
    say(
        f"  model: {type(model).__name__} on meta, schemes {schemes}; {len(targets)} AQN norms, "
        f"graphs_frozen={stats['graphs_frozen']}; targets, noise written, sigma 0: {len(findings)} finding(s)"
    )
    return findings


# `qerl run --config demo-gpu`, small: the replica's rollout runs on the transformers engine (vLLM
# cannot serve without a GPU) and the demo's warm-up and evaluation are cut to seconds
RUN_SETTINGS = (
    "rollout.engine=hf", "loop.steps=2", "loop.eval_every=2", "model.demo.sft_steps=20",
    "eval.benchmark.arithmetic_size=20",
)  # fmt: skip


def check_run(work: Path) -> list[str]:
    """``qerl run`` end to end with the run bundle (Prefect's temporary server, MLflow's registry,
    math-verify) on the image's Python and packages, as the kit's ``--run-only`` part runs it."""
    import importlib.util
    import json
    import os
    import subprocess

    if importlib.util.find_spec("prefect") is None:
        say("  run: skipped (no run bundle in the replica: tools/gpu_transfer/fetch_gpu_wheels.sh --run)")
        return []
    cmd = [
        sys.executable,
        "-m",
        "qerl.flows.cli",
        "run",
        "--config",
        "demo-gpu",
        "--work-dir",
        str(work / "run"),
    ]
    cmd += [arg for setting in RUN_SETTINGS for arg in ("--set", setting)]
    env = dict(os.environ, PREFECT_UI_ENABLED="false")  # PYTHONPATH as gpu_replica.sh sets it
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    print(out.stdout + out.stderr, flush=True)  # into the check's log
    records = sorted((work / "run").glob("runs/*/run.json"))
    if out.returncode != 0 or not records:
        tail = " | ".join((out.stdout + out.stderr).strip().splitlines()[-3:])
        return [f"run: qerl run exited {out.returncode}: {tail}"]
    record = json.loads(records[-1].read_text())
    reg = record.get("registration") or {}
    say(
        f"  run: {record['run_id']} {record['status']}, engine mode {record.get('engine_mode')}, "
        f"{len(record.get('steps', []))} steps, registered {reg.get('model_name')} v{reg.get('version')}"
    )
    return (
        [] if record["status"] == "completed" else [f"run: status {record['status']}: {record.get('error')}"]
    )


def lora_adapter(model_dir: Path, out: Path) -> Path:
    """A PEFT LoRA adapter for ``model_dir`` as the trainer saves it (CPU, its own twin)."""
    from qerl.pipeline.rl.policy import init_state
    from qerl.pipeline.rl.train_config import TrainConfig

    state = init_state(model_dir, TrainConfig(lora_r=8, lora_alpha=16, seed=7), device="cpu")
    state.model.save_pretrained(out)
    return out


def _error(exc: BaseException) -> str:
    return traceback.format_exception_only(type(exc), exc)[-1].strip()


def _has_distribution(name: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(name)
    except PackageNotFoundError:
        return False
    return True


def run_checks(work: Path) -> list[str]:
    """The seven checks in order; the first whose set-up fails ends the run (a finding, not a trace)."""
    import platform
    from importlib.metadata import version

    names = ("torch", "triton", "transformers", "vllm", "compressed-tensors", "prefect", "mlflow")
    found = [f"{n} {version(n)}" for n in names if _has_distribution(n)]
    say(f"replica: Python {platform.python_version()}, {', '.join(found)}")
    findings = check_imports()
    say(f"1. imports: {len(findings)} of the scan's roots failed")
    if findings:
        return findings  # what follows imports them
    from gpu_replica_weights import check_weights
    from qerl.pipeline.demo.tiny_model import build_tiny_model
    from qerl.pipeline.nvfp4.recipe import QuantizeConfig
    from qerl.pipeline.rollout.config import RolloutConfig
    from qerl.pipeline.store.artifact_store import ArtifactStore
    from qerl.stages import quantize

    from tests.gpu.test_gpu_vllm import ENGINE, SIZES
    from tests.gpu.test_gpu_vllm_padded import SMOLLM2_SIZES

    store = ArtifactStore(work / "store")
    base = build_tiny_model(work / "marlin-qwen2", arch="qwen2", norm_jitter=0.05, **SIZES)
    quantized = quantize.run(QuantizeConfig(), str(base), store)
    padded_dir = build_tiny_model(work / "padded-llama", arch="llama", norm_jitter=0.05, **SMOLLM2_SIZES)
    padded = quantize.run(QuantizeConfig(), str(padded_dir), store)
    steps = [
        ("2. scheme", lambda: check_scheme(quantized.dir)),
        (
            "3. engine",
            lambda: check_engines(
                work, quantized, quantize.run(QuantizeConfig(scheme="none"), str(base), store), padded
            ),
        ),
        (
            "4. requests",
            lambda: check_requests(
                RolloutConfig(**ENGINE), quantized.dir, lora_adapter(quantized.dir, work / "adapter")
            ),
        ),
        ("5. model", lambda: check_model(quantized.dir, work)),
        (
            "6. weights",
            lambda: check_weights(quantized.dir, work, say) + check_weights(padded.dir, work, say),
        ),
        ("7. run", lambda: check_run(work)),
    ]
    for title, step in steps:
        say(title)
        try:
            findings += step()
        except Exception as exc:  # noqa: BLE001 - a check that cannot run is a finding
            log.exception("%s", title)
            return findings + [f"{title} could not run: {_error(exc)} (traceback in the log)"]
    return findings


def check_engines(work: Path, quantized: Any, plain: Any, padded: Any) -> list[str]:
    """The kit tests' engines (in-process; plain, built for AQN, and on the SmolLM2-shaped Llama that
    Marlin serves padded), bench_vllm's two arms (engine-core process, as a run's) and the NVFP4 one
    built for AQN (the loader must be registered in the engine-core process too)."""
    from qerl.pipeline.rollout.config import RolloutConfig

    import benchmarks.bench_vllm as bench_vllm
    from tests.gpu.test_gpu_vllm import ENGINE

    pretend_cuda()
    bench_args = argparse.Namespace(prompts=16, n=8, max_new_tokens=256)  # bench_vllm's defaults
    bench_cfg = bench_vllm._rollout_config(bench_args, dry=False)
    engines = {
        "kit test (in-process)": (RolloutConfig(**ENGINE), quantized, False),
        "kit AQN test (in-process)": (RolloutConfig(**ENGINE), quantized, True),
        "kit padded test (in-process)": (RolloutConfig(**ENGINE), padded, False),
        "bench_vllm nvfp4 (engine-core process)": (bench_cfg, quantized, False),
        "bench_vllm bf16 (engine-core process)": (bench_cfg, plain, False),
        "a run's, with AQN (engine-core process)": (bench_cfg, quantized, True),
    }
    findings, hashes = [], {}
    for label, (cfg, model, aqn) in engines.items():
        found, info = check_engine(label, cfg, model, work, aqn=aqn)
        findings += found
        hashes[label] = info.get("config_hash")
    # same model and settings, one built for AQN: vLLM's compile cache must keep their graphs apart
    for plain_engine, aqn_engine in [
        ("kit test (in-process)", "kit AQN test (in-process)"),
        ("bench_vllm nvfp4 (engine-core process)", "a run's, with AQN (engine-core process)"),
    ]:
        if hashes[plain_engine] and hashes[plain_engine] == hashes[aqn_engine]:
            findings.append(
                f"engines {plain_engine!r} and {aqn_engine!r} share vLLM's config hash "
                f"{hashes[plain_engine]}: one would load the other's compiled graphs"
            )
    return findings


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--work", type=Path, help="where the checkpoints go (default: a temporary folder)")
    parser.add_argument("--report", type=Path, help="also write the lines for people here (replaced)")
    args = parser.parse_args(argv)
    if str(ROOT) not in sys.path:  # gpu_replica.sh puts it on PYTHONPATH after its src folder
        sys.path.append(str(ROOT))
    if args.report:
        args.report.write_text("")
        REPORT.append(args.report)
    with tempfile.TemporaryDirectory(prefix="qerl-replica-") as tmp:
        findings = run_checks(args.work or Path(tmp))
    say(f"replica check: {len(findings)} finding(s)")
    for line in findings:
        say(f"  {line}")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
