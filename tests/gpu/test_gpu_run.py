"""The GPU kit's ``qerl run`` part and its preset, on the CPU (kept out of tests/gpu/test_gpu.py, whose
imports the GPU image must satisfy without Prefect or MLflow).

``gpu_check.sh --run-only`` in the dry run runs ``qerl run`` end to end with a tiny config and reports
the run record's summary; the ``demo-gpu`` preset it runs on the GPU fits FP4 Marlin's tiles and
FA3's head sizes, in bf16 with CUDA graphs on.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # about a minute: one qerl run of one step on the transformers engine
@pytest.mark.kit
def test_gpu_check_run_part_runs_qerl_run_and_reports_it(tmp_path, tiny_model_factory):
    """``--run-only`` (the kit's ``qerl run`` part) in the dry run, with a tiny config on the CPU: the
    run goes end to end in a fresh work folder, and the report gives its record's summary."""
    import torch
    import yaml

    from tests.flows.test_flow import tiny_run_config

    cfg = tiny_run_config(tiny_model_factory(arch="qwen2", dtype=torch.float32), engine="hf")
    cfg["loop"].update(steps=1, eval_base=False)
    cfg_path = tmp_path / "run.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out)}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu" / "gpu_check.sh"), "--dry-run", "--run-only", "--run-config", str(cfg_path)],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = (out / "gpu-check.md").read_text()
    assert re.search(r"^\| qerl_run \| \d+ \| exit 0 \|$", report, re.M), report
    assert "qerl run exit 0" in report and f"## qerl run --config {cfg_path}" in report
    assert re.search(r"run \S+: status completed, engine mode hf-nvfp4-emulated, 1 steps", report), report
    # the first version of a registered model must beat the base model, which this untrained one ties
    assert "registration: qerl-adapter v1, promoted False" in report
    assert len([p for p in out.rglob("*") if p.is_file()]) <= 8  # what the device tool brings back


def test_the_gpu_demo_preset_fits_fp4_marlin_and_fa3():
    """``demo-gpu`` (the kit's ``qerl run``, a GPU install's smoke test): every projection of its
    demo model fits FP4 Marlin's tiles (output % 64, input % 128), head_dim is 64 (FA3's sizes), and
    it runs in bf16 with CUDA graphs on, like the GPU presets."""
    import inspect

    from qerl.pipeline.demo.tiny_model import tiny_config
    from qerl.pipeline.planning.run_config import PRESET_DIR, load_run_config

    cfg = load_run_config(PRESET_DIR / "demo-gpu.yaml")
    d = cfg.model.demo
    defaults = inspect.signature(tiny_config).parameters  # the demo base keeps its head counts
    heads, kv_heads = defaults["num_heads"].default, defaults["num_kv_heads"].default
    head_dim = d.hidden_size // heads
    assert cfg.model.source == "demo" and head_dim == 64
    for out_dim, in_dim in (
        (d.hidden_size, d.hidden_size),  # q, o
        (kv_heads * head_dim, d.hidden_size),  # k, v
        (d.intermediate_size, d.hidden_size),  # gate, up
        (d.hidden_size, d.intermediate_size),  # down
    ):
        assert out_dim % 64 == 0 and in_dim % 128 == 0, (out_dim, in_dim)
    assert cfg.rollout.dtype == cfg.train.dtype == "bfloat16" and not cfg.rollout.enforce_eager
    assert cfg.quantize.scheme == "nvfp4"


def test_qerl_imports_from_an_uninstalled_checkout():
    """The GPU image has no install of qerl, and the benchmarks put the checkout first on sys.path, so
    ``import qerl`` there finds ./qerl, whose sub-packages live in the top-level folders. That failed on
    an H200 (``No module named 'qerl.pipeline'``); ``python -S`` here leaves out the editable install's
    finder (a .pth file) the same way."""
    import sysconfig

    code = "import qerl.kernels, qerl.pipeline.planning.model_shape, qerl.stages, qerl; print(qerl.__file__)"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), sysconfig.get_paths()["purelib"]])}
    proc = subprocess.run(
        [sys.executable, "-S", "-c", code], capture_output=True, text=True, cwd=ROOT, env=env
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == str(ROOT / "qerl" / "__init__.py")
