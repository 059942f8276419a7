"""The demo base does not depend on the caller's thread count or on the CPU's instruction set."""

from __future__ import annotations

import hashlib

import pytest
import torch
from qerl.pipeline.demo.base_model import DemoBaseConfig, build_demo_base


def _digest(out) -> str:  # noqa: ANN001
    return hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()


@pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"), reason="the pinned warm-up needs AVX2"
)
def test_the_warm_up_runs_on_one_instruction_set_and_thread_whatever_the_caller_runs(tmp_path, monkeypatch):
    """The warm-up child runs torch's AVX2 kernels (and MKL's AVX2 path) on one thread whatever the
    caller's process runs, so an AVX-512 and an AVX2 machine, with any number of cores, build one
    base. A warm-up on other kernels (torch's scalar ones, as ``ATEN_CPU_CAPABILITY=default``
    selects) builds other weights: the instruction set does reach this warm-up, and pinning it is
    what makes the base portable."""
    import json
    import os
    import subprocess
    import sys

    from qerl.pipeline.demo import base_model

    cfg = DemoBaseConfig(n_train=200, sft_steps=12, sft_batch=32, hidden_size=64, intermediate_size=192)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        pinned = build_demo_base(tmp_path / "pinned", cfg)
        assert pinned["sft_cpu_capability"] == "AVX2" and pinned["sft_threads"] == 1
        torch.set_num_threads(2)
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
        monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "SSE4_2")
        other_caller = build_demo_base(tmp_path / "caller", cfg)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert other_caller["sft_cpu_capability"] == "AVX2" and other_caller["sft_threads"] == 1
    assert _digest(tmp_path / "caller") == _digest(tmp_path / "pinned")

    request = json.dumps({"out": str(tmp_path / "scalar"), "config": cfg.model_dump(), "exclude": []})
    env = {**os.environ, **base_model.PORTABLE_ARITHMETIC, "ATEN_CPU_CAPABILITY": "default"}
    child = subprocess.run(
        [sys.executable, "-m", base_model.__name__], input=request, capture_output=True, text=True, env=env
    )
    assert child.returncode == 0, child.stderr[-2000:]
    assert json.loads(child.stdout.splitlines()[-1])["sft_cpu_capability"] == "DEFAULT"
    assert _digest(tmp_path / "scalar") != _digest(tmp_path / "pinned")


def test_a_failed_warm_up_names_its_error(tmp_path):
    cfg = DemoBaseConfig(n_train=20, sft_steps=2, sft_target=0.5, sft_probe_groups=500)
    with pytest.raises(
        RuntimeError, match="demo warm-up failed.*sft_probe_groups 500 leaves no warm-up data"
    ):
        build_demo_base(tmp_path / "bad", cfg)


def test_the_warm_up_stops_when_its_probe_of_unseen_pairs_reaches_the_target(tmp_path, monkeypatch):
    """``sft_target``: the warm-up probes whole groups of problems it never trains on every
    ``sft_probe_every`` steps and stops once the mean of the last ``sft_probe_window`` probes reaches
    the target; a target it does not reach runs every step. The probe's measurements are replaced by a
    fixed sequence here: the rule is what is tested, not what the model learns in a few steps."""
    import json

    from qerl.pipeline.demo import base_model

    seen: list[list[str]] = []

    def probe(model, tokenizer, problems, template):  # noqa: ANN001
        seen.append([p["group"] for p in problems])
        return [0.2, 0.6, 0.5, 0.9, 0.1][len(seen) - 1]

    monkeypatch.setattr(base_model, "_probe_accuracy", probe)
    small = dict(n_train=200, sft_batch=32, hidden_size=64, intermediate_size=192, sft_probe_groups=4)
    cfg = DemoBaseConfig(**small, sft_steps=40, sft_target=0.55, sft_probe_every=5, sft_probe_window=2)
    reached = base_model.warm_up(tmp_path / "reached", cfg)
    # probes 0.2, 0.6 (mean 0.4), 0.5 (mean 0.55): stopped after the third, at step 15
    assert reached["sft_steps_run"] == 15 and reached["sft_probe_accuracy"] == pytest.approx(0.55)
    assert len({g for groups in seen for g in groups}) == 4  # the same four groups, every time
    assert reached["sft_probe_items"] > 0 and reached["n_train"] + reached["sft_probe_items"] == 200
    seen.clear()
    unreached = base_model.warm_up(
        tmp_path / "all", cfg.model_copy(update={"sft_target": 0.95, "sft_steps": 25})
    )
    assert unreached["sft_steps_run"] == 25 and unreached["sft_probe_accuracy"] == pytest.approx(0.5)
    written = json.loads((tmp_path / "all" / "qerl_demo.json").read_text())["metrics"]
    assert written["sft_steps_run"] == 25 and "sft_seconds" not in written
    plain = base_model.warm_up(tmp_path / "plain", DemoBaseConfig(**small, sft_steps=12))
    assert plain["sft_steps_run"] == 12 and "sft_probe_accuracy" not in plain and plain["n_train"] == 200
