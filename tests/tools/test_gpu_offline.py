"""tools/gpu_transfer/gpu_offline.sh, the validation on a GPU image with carried bundles, on the CPU.

The wrapper stages the bundles (tests/tools/test_gpu_bundle.py checks the staging itself), builds the
environment (qerl from the checkout through .gpu-src, the extracted bundles after site-packages, the
sampler switch the vLLM bundle needs) and runs the product's scripts/gpu/gpu_validate.sh or
gpu_check.sh in it: here, that the product gets that environment and the wrapper's note; that the
roots' import check runs once per extracted bundle and roots list; that a missing pydantic is reported
with the bundles' state. And what the image lacks: the modules the GPU tests and benchmark import
pull in no Prefect, MLflow or vLLM.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KIT = ROOT / "tools" / "gpu_transfer"
WRAPPER = "tools/gpu_transfer/gpu_offline.sh"

# What the GPU image lacks and the GPU tests must therefore never import (directly or through our modules).
FORBIDDEN = (
    "prefect", "mlflow", "vllm", "math_verify", "compressed_tensors", "trl", "datasets", "matplotlib",
    "psycopg", "asyncpg", "fastapi", "sqlalchemy",
)  # fmt: skip

# the files a throwaway repository root needs for the wrapper and the product it runs
DEVICE_FILES = (
    "tools/gpu_transfer/gpu_offline.sh",
    "tools/gpu_transfer/gpu_bundle.py",
    "tools/gpu_transfer/gpu_chunks.py",
    "tools/gpu_transfer/gpu_imports.py",
    "tools/gpu_transfer/gpu_lazy.py",
    "tools/gpu_transfer/gpu_image_packages.txt",
    "tools/gpu_transfer/gpu_import_roots.py",
    "tools/gpu_transfer/gpu_src.sh",
    "tools/gpu_transfer/gpu_sitecustomize.py",
    "tools/gpu_transfer/gpu_vllm_roots.txt",
    "scripts/gpu/gpu_validate.sh",
    "scripts/gpu/gpu_check.sh",
    "benchmarks/bench_vllm.py",  # gpu_validate.sh reads its arms
    "qerl/__init__.py",
)

FAKE_IMAGE_PYTHON = """#!/usr/bin/env bash
# the GPU image's python as the probes see it, without CUDA; counts the import checks it runs
case "$*" in
  --version) echo "Python 3.12.3" ;;
  *gpu_import_roots.py*) echo run >>"$IMPORT_CHECKS"; echo "imports: 39 of 39 roots import (9.9 s)" ;;
  *is_available*) exit 1 ;;
  -) cat >/dev/null; echo "python 3.12.3 on x86_64" ;;
  *) exit 0 ;;
esac
"""


def _device_root(tmp_path: Path) -> tuple[Path, dict]:
    """A throwaway repository root holding the wrapper and the product's scripts, and the environment
    to run them in."""
    root = tmp_path / "device-root"
    for rel in DEVICE_FILES:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes((ROOT / rel).read_bytes())
    return root, {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "results")}


def _fake_python(tmp_path: Path, text: str = FAKE_IMAGE_PYTHON) -> Path:
    fake = tmp_path / "python"
    fake.write_text(text)
    fake.chmod(0o755)
    return fake


# the product's stand-in for gpu_check.sh: writes down the environment it was given
RECORDING_KIT = """#!/usr/bin/env bash
mkdir -p "$OUT"
printf '# GPU check\\n\\nmode: fake\\n\\n1 passed in 0.1s\\n' >"$OUT/gpu-check.md"
"$PYTHON" -c "$PROBE" >"$RECORD"
"""

PROBE = """
import json, os, site, sys
import qerl
after = os.environ.get("QERL_SYS_PATH_AFTER", "")
site_at = max(sys.path.index(p) for p in site.getsitepackages() if p in sys.path)
print(json.dumps({
    "qerl": qerl.__file__,
    "after_at": sys.path.index(after) if after in sys.path else None,
    "site_at": site_at,
    **{k: os.environ.get(k) for k in ("PYTHONPATH", "QERL_SYS_PATH_AFTER", "VLLM_USE_FLASHINFER_SAMPLER",
                                      "QERL_GPU_ENV_NOTE", "DO_NOT_TRACK")},
}))
"""


def test_the_wrapper_runs_the_validation_in_the_environment_it_prepared(tmp_path):
    """``gpu_offline.sh OPTIONS`` stages (nothing carried here), then runs scripts/gpu/gpu_validate.sh
    with the options; the product's calls get qerl from .gpu-src, the extracted run bundle appended after
    site-packages, the sampler switch and the wrapper's note, and write the product's results."""
    root, env = _device_root(tmp_path)
    (root / ".gpu-run-site").mkdir()
    (root / ".gpu-run-site" / ".bundle-sha256").write_text("cd" * 32 + "\n")  # extracted by an earlier call
    kit = tmp_path / "recording_kit.sh"
    kit.write_text(RECORDING_KIT)
    record = tmp_path / "record.json"
    env = {**env, "QERL_GPU_VALIDATE_KIT": str(kit), "RECORD": str(record), "PROBE": PROBE}
    proc = subprocess.run(["bash", WRAPPER, "--items", "1"], cwd=root, env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "no vLLM bundle carried" in proc.stderr and "no run bundle carried" in proc.stderr
    seen = json.loads(record.read_text())
    # qerl from the checkout, uninstalled (`-c` puts the working folder, the root, before .gpu-src)
    assert seen["qerl"] == str(root / "qerl" / "__init__.py")
    assert seen["PYTHONPATH"].split(":")[:2] == [str(root / ".gpu-src"), str(root)]
    assert seen["QERL_SYS_PATH_AFTER"] == str(root / ".gpu-run-site")
    assert seen["after_at"] > seen["site_at"], "the bundles come after the image's site-packages"
    assert seen["VLLM_USE_FLASHINFER_SAMPLER"] == "0" and seen["DO_NOT_TRACK"] == "1"
    assert seen["QERL_GPU_ENV_NOTE"].startswith("carried bundles (gpu_offline.sh): no vLLM bundle carried")
    results = [json.loads(line) for line in (tmp_path / "results" / "results.jsonl").read_text().splitlines()]
    assert [(r["event"], r["name"]) for r in results] == [("start", "qerl-run"), ("end", "qerl-run")]
    assert results[-1]["outcome"] == "passed"
    # with the product's --dry-run the bundles are left alone and the product prints its items
    dry = subprocess.run(["bash", WRAPPER, "--dry-run"], cwd=root, env=env, capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert dry.returncode == 0, dry.stderr
    assert "dry run: the vLLM bundle is not unpacked" in dry.stderr
    assert re.search(r"^item 1 qerl-run \(limit \d+s\)$", dry.stdout, re.M)
    bad = subprocess.run(["bash", WRAPPER, "--exec"], cwd=root, env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "--exec takes a command" in bad.stderr


def test_exec_runs_a_command_with_qerl_from_the_checkout_and_the_bundles_after_site_packages(tmp_path):
    """``--exec CMD``: what the README of tools/gpu_transfer gives for running qerl by hand there."""
    root, env = _device_root(tmp_path)
    site = root / ".gpu-vllm-site"
    site.mkdir()
    (site / ".bundle-sha256").write_text("ab" * 32 + "\n")
    (site / ".imports-ok").write_text(  # a clean import check of this roots list, by an earlier call
        subprocess.run(["sha256sum", str(KIT / "gpu_vllm_roots.txt")], capture_output=True, text=True,
                       check=True).stdout.split()[0] + "\nimports: 39 of 39 roots import (9.9 s)\n"
    )  # fmt: skip
    (site / "from_the_bundle.py").write_text("X = 1\n")
    code = "import json, qerl, from_the_bundle; print(json.dumps([qerl.__file__, from_the_bundle.__file__]))"
    proc = subprocess.run(["bash", WRAPPER, "--exec", sys.executable, "-c", code], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "roots import (9.9 s), by an earlier call on this machine" in proc.stderr
    qerl_file, bundle_file = json.loads(proc.stdout.strip().splitlines()[-1])
    assert qerl_file == str(root / "qerl" / "__init__.py")  # the checkout's, uninstalled
    assert bundle_file == str(site / "from_the_bundle.py")


def test_a_clean_vllm_import_check_serves_the_later_calls_of_a_lease(tmp_path):
    """The roots' import check (tens of seconds a call on a GPU machine) runs once per extracted
    bundle and roots list: a later call on the same machine reuses a clean result, and a changed list
    checks again. The product then runs with the image's python and stops where it needs CUDA."""
    root, env = _device_root(tmp_path)
    (root / ".gpu-vllm-site").mkdir()
    (root / ".gpu-vllm-site" / ".bundle-sha256").write_text("ab" * 32 + "\n")  # an extracted bundle
    checks = tmp_path / "import-checks"
    env = {**env, "PYTHON": str(_fake_python(tmp_path)), "IMPORT_CHECKS": str(checks)}

    def call() -> str:
        proc = subprocess.run(["bash", WRAPPER, "--check", "--tests-only"], cwd=root, env=env,
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert proc.returncode == 2 and "no CUDA device" in proc.stderr, proc.stderr  # stops there
        return proc.stderr

    assert "vLLM imports: 39 of 39 roots import (9.9 s)\n" in call()
    assert "roots import (9.9 s), by an earlier call on this machine" in call()
    assert checks.read_text().count("run") == 1
    with (root / "tools" / "gpu_transfer" / "gpu_vllm_roots.txt").open("a") as roots:
        roots.write("vllm.extra\n")
    assert "by an earlier call" not in call()  # another list: checked again
    assert checks.read_text().count("run") == 2


def test_the_kit_does_not_start_the_tests_without_pydantic(tmp_path):
    """On the image, qerl's configs import pydantic, which only the extracted vLLM bundle brings: the
    product says so, quoting the wrapper's note with the bundles' state, instead of running tests that
    all error at setup."""
    root, env = _device_root(tmp_path)
    fake = _fake_python(
        tmp_path,
        FAKE_IMAGE_PYTHON.replace("*is_available*) exit 1 ;;", "*is_available*) exit 0 ;;").replace(
            "  *) exit 0 ;;",
            '  *"import pydantic"*) exit 1 ;;\n  *pytest*) echo PYTEST-RAN >>"$IMPORT_CHECKS" ;;\n  *) exit 0 ;;',
        ),
    )
    checks = tmp_path / "calls"
    env = {**env, "PYTHON": str(fake), "IMPORT_CHECKS": str(checks)}
    proc = subprocess.run(["bash", WRAPPER, "--check", "--tests-only", "--no-vllm"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert "tests: not started: qerl needs pydantic" in proc.stderr, proc.stderr
    assert not checks.exists() or "PYTEST-RAN" not in checks.read_text()
    report = (tmp_path / "results" / "gpu-check.md").read_text()
    assert (
        "| test_gpu | 0 | not started: no pydantic (carried bundles (gpu_offline.sh): no vLLM bundle carried"
        in report
    )
    assert proc.returncode == 5  # nothing failed; the run is incomplete


@pytest.mark.kit
@pytest.mark.slow  # about 30 s: one product dry run (pytest imports torch, the test skips)
def test_the_wrappers_dry_run_runs_the_product_with_qerl_from_the_checkout(tmp_path):
    """``gpu_offline.sh --check --dry-run`` in this checkout: the CPU environment has every package, so
    nothing is staged or installed, but the product runs with .gpu-src first on the path, as on the
    image."""
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    env.pop("TRITON_INTERPRET", None)
    args = ["--check", "--dry-run", "--tests-only", "--test-files", "tests/gpu/test_gpu_vllm_padded.py"]
    proc = subprocess.run(
        ["bash", WRAPPER, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = (tmp_path / "gpu-check.md").read_text()
    assert re.search(r"^\| test_gpu_vllm_padded \| \d+ \| exit 0 \|$", report, re.M), report
    assert "environment prepared by the caller:" in report
    assert "dry run: the vLLM bundle is not unpacked" in report
    assert (ROOT / ".gpu-src" / "qerl" / "__init__.py").is_file() and (
        ROOT / ".gpu-src" / "sitecustomize.py"
    ).is_file()


def _kit_modules() -> list[str]:
    """Our modules imported by tests/gpu/test_gpu.py and by benchmarks/bench_gpu.py and its parts (parsed,
    so a new import is covered without editing a list)."""
    found = set()
    kit = (
        "tests/gpu/test_gpu.py",
        "tests/conftest.py",
        "tests/pipeline/test_qlinear.py",
        "tests/kernels/test_nvfp4_kernels.py",
    )
    bench = ("bench_gpu.py", "gpu_train_arm.py", "gpu_kernels.py")
    for path in [ROOT / p for p in kit] + [ROOT / "benchmarks" / p for p in bench]:
        for mod in re.findall(
            r"^\s*(?:from|import) (qerl\.(?:pipeline|stages|kernels)[\w.]*)", path.read_text(), re.M
        ):
            found.add(mod)
    return sorted(found)


def test_kit_imports_no_prefect_mlflow_or_vllm():
    """tests/gpu/test_gpu.py and the GPU benchmark run on the image with the vLLM bundle alone: their
    modules import nothing the image lacks."""
    modules = _kit_modules()
    assert {
        "qerl.pipeline.rl.policy",
        "qerl.pipeline.rl.step",
        "qerl.pipeline.rl.checkpoint",
        "qerl.pipeline.nvfp4.linear",
        "qerl.pipeline.nvfp4.loading",
        "qerl.kernels.nvfp4_dispatch",
        "qerl.kernels.nvfp4_reference",
        "qerl.kernels.nvfp4_triton",
        "qerl.pipeline.rollout.hf_engine",
    } <= set(modules)
    code = (
        "import importlib, json, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        f"print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & set({FORBIDDEN!r}))))"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []
