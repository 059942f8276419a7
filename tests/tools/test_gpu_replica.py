"""The CPU replica of the GPU image (``tools/gpu_transfer/gpu_replica.sh``, ``tools/gpu_transfer/gpu_replica_check.py``).

The replica itself (6.3 GB: the image's CUDA torch) is a developer's pre-flight before a GPU run and is
not built here. What is tested here runs without it: the stub driver, the replica's package lists,
the plugins the build registers, and the requests and model checks against this environment's vLLM
(0.32 on the CPU; the replica runs them against 0.26).
"""

from __future__ import annotations

import ctypes
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "tools" / "gpu_transfer"
sys.path.insert(0, str(SCRIPTS))  # the scripts import their siblings, as they do when run
import gpu_imports as gi  # noqa: E402
import gpu_replica_build as grb  # noqa: E402
import gpu_replica_check as grc  # noqa: E402


def test_the_stub_driver_defines_what_extensions_link_and_answers_no_device(tmp_path):
    if not (shutil.which("cc") and shutil.which("nm")):
        pytest.skip("needs a C compiler (cc) and nm to build the stub driver")
    site = tmp_path / "site" / "pkg"
    site.mkdir(parents=True)
    (tmp_path / "ext.c").write_text(
        "int cuTensorMapEncodeTiled(void); int cuPointerGetAttribute(void); int cudaMalloc(void);\n"
        "int use(void) { return cuTensorMapEncodeTiled() + cuPointerGetAttribute() + cudaMalloc(); }\n"
    )
    subprocess.run(
        ["cc", "-shared", "-fPIC", "-o", str(site / "_ext.so"), str(tmp_path / "ext.c")], check=True
    )
    # the driver's entry points (cu + capital), not the runtime's (cuda...)
    assert grb.driver_symbols(tmp_path / "site") == ["cuPointerGetAttribute", "cuTensorMapEncodeTiled"]
    stub = grb.build_stub(tmp_path / "site", tmp_path / "driver")
    assert stub.name == "libcuda.so.1"  # the name the extensions need
    lib = ctypes.CDLL(str(stub))
    for name in ("cuInit", "cuPointerGetAttribute", "cuTensorMapEncodeTiled"):
        assert getattr(lib, name)() == grb.NO_DEVICE == 100  # CUDA_ERROR_NO_DEVICE


def test_the_replica_installs_nothing_the_image_lacks():
    image = gi.image_packages()
    wanted = [
        re.match(r"[A-Za-z0-9_.-]+", line).group(0)
        for line in (SCRIPTS / "gpu_replica_requirements.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert len(wanted) > 30
    missing = [n for n in wanted if gi.norm(n) not in image]
    assert not missing, f"not on the GPU image, so the replica must not have them: {missing}"
    pins = dict(
        re.findall(
            r"^(torch|torchvision|torchaudio|triton)==(\S+)",
            (SCRIPTS / "gpu_replica_requirements.txt").read_text(),
            re.M,
        )
    )
    assert pins == {"torch": "2.11.0", "torchvision": "0.26.0", "torchaudio": "2.11.0", "triton": "3.6.0"}


def test_the_replica_script_names_a_bad_option():
    out = subprocess.run(["bash", str(SCRIPTS / "gpu_replica.sh"), "--bogus"], capture_output=True, text=True)
    assert out.returncode == 2 and "unknown option --bogus" in out.stderr
    out = subprocess.run(["bash", str(SCRIPTS / "gpu_replica.sh"), "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--python PATH" in out.stdout and "--build-only" in out.stdout
    assert "--user-install" in out.stdout and "--requirements FILE" in out.stdout
    untested = "requirements/gpu-untested-vllm032.txt"
    out = subprocess.run(
        ["bash", str(SCRIPTS / "gpu_replica.sh"), "--requirements", untested], capture_output=True, text=True
    )
    assert out.returncode == 2 and "--requirements goes with --user-install" in out.stderr
    out = subprocess.run(
        ["bash", str(SCRIPTS / "gpu_replica.sh"), "--user-install", "--requirements", "requirements/no-such.txt"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode == 2 and "no requirements file 'requirements/no-such.txt'" in out.stderr


@pytest.mark.parametrize(("flags", "python"), [([], "3.12"), (["--user-install"], "3.11")])
def test_the_replica_refuses_a_python_other_than_its_targets_before_removing_anything(flags, python):
    """The image replica wants the image's Python, the user-install one the GPU set-up's;
    a wrong one is refused before --rebuild removes the venv (/bin/false answers no version)."""
    assert "QERL_ENV=gpu make venv" in (ROOT / "README.md").read_text()
    assert (
        "PY=${PYTHON:-python3.11}" in (ROOT / "scripts" / "bootstrap.sh").read_text()
    )  # the set-up's Python
    out = subprocess.run(
        ["bash", str(SCRIPTS / "gpu_replica.sh"), *flags, "--rebuild", "--python", "/bin/false"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1 and f"no Python {python} found" in out.stderr, out.stderr


@pytest.fixture(scope="module")
def adapter(tiny_model_dir, tmp_path_factory):
    return grc.lora_adapter(tiny_model_dir, tmp_path_factory.mktemp("replica") / "adapter")


def test_the_requests_check_passes_qerls_requests_through_vllms_signatures(tiny_model_dir, adapter):
    pytest.importorskip("vllm")
    from qerl.pipeline.rollout.config import RolloutConfig

    from tests.gpu.test_gpu_vllm import ENGINE

    assert grc.check_requests(RolloutConfig(**ENGINE), tiny_model_dir, adapter) == []


def test_the_requests_check_names_an_argument_vllm_does_not_take(tiny_model_dir, adapter, monkeypatch):
    pytest.importorskip("vllm")
    from qerl.pipeline.rollout import vllm_engine
    from qerl.pipeline.rollout.config import RolloutConfig

    from tests.gpu.test_gpu_vllm import ENGINE

    def prefill(self, encoded):
        from vllm import SamplingParams

        self.llm.generate([], SamplingParams(max_tokens=1), use_tqdm=False, lora=self._lora)

    monkeypatch.setattr(vllm_engine.VLLMEngine, "_prefill_prompts_once", prefill)
    findings = grc.check_requests(RolloutConfig(**ENGINE), tiny_model_dir, adapter)
    assert len(findings) == 1 and "lora" in findings[0], findings


@pytest.mark.kit
def test_the_model_check_runs_against_this_vllm_and_names_a_missing_fp4_scheme(tiny_model_dir, tmp_path):
    """check_model on this environment's vLLM and a plain bf16 model: the AQN part holds (targets, the
    noise written, sigma 0), and the one finding is the missing FP4 scheme. In a subprocess: it
    initialises vLLM's distributed state, which would outlive the test in this one."""
    pytest.importorskip("vllm")
    code = (
        "import json, sys; from pathlib import Path; sys.path[:0] = sys.argv[1:3]; import gpu_replica_check as g; "
        "print('FINDINGS=' + json.dumps(g.check_model(Path(sys.argv[3]), Path(sys.argv[4]))))"
    )
    args = [sys.executable, "-c", code, str(SCRIPTS), str(ROOT), str(tiny_model_dir), str(tmp_path)]
    out = subprocess.run(args, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("FINDINGS=")]
    assert lines, out.stdout[-2000:] + out.stderr[-2000:]
    findings = json.loads(lines[0].removeprefix("FINDINGS="))
    assert len(findings) == 1 and "did not load an NVFP4 scheme" in findings[0], findings
    assert "4 AQN norms" in out.stdout


def test_the_replica_also_gets_the_image_packages_the_bundles_rely_on(tmp_path):
    (tmp_path / "req.txt").write_text("# comment\nnumpy==2.5.2   # the image's\ntorch==2.11.0\n")
    (tmp_path / "vllm.json").write_text(json.dumps({"scan": {"image_dists_used": ["numpy", "pandas"]}}))
    (tmp_path / "run.json").write_text(
        json.dumps({"left_out": {"image": ["numpy==2.5.5", "humanize==4.17.0", "Pandas==3.1.1"]}})
    )
    lines = grb.image_needs(tmp_path / "req.txt", [tmp_path / "vllm.json", tmp_path / "run.json"])
    # the list's pins win; each name once, the first manifest's spelling
    assert lines == ["numpy==2.5.2", "torch==2.11.0", "pandas", "humanize==4.17.0"]


def test_the_plugins_the_build_registers_exist_and_share_the_checks_signal():
    """The entry points gpu_replica.sh writes name functions of the plugin module (parsed: importing it
    needs vLLM's CUDA platform), and the plugin writes where the engine check reads."""
    import ast

    source = (SCRIPTS / "gpu_replica_platform.py").read_text()
    functions = {n.name for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)}
    registered = re.findall(r"qerl_replica_platform:(\w+)", (SCRIPTS / "gpu_replica.sh").read_text())
    assert sorted(registered) == ["activate", "stop_at_device"]
    assert set(registered) <= functions
    assert (
        "QERL_REPLICA_REACHED" in source
        and "QERL_REPLICA_REACHED" in (SCRIPTS / "gpu_replica_check.py").read_text()
    )


WEIGHTS_CHECK = """
import json, sys
from pathlib import Path
sys.path[:0] = sys.argv[1:3]
import gpu_replica_weights as w
if sys.argv[5] == "swap":  # a loader that puts gate_proj's rows where up_proj's go, in layer 1
    from vllm.model_executor.models import qwen2
    load = qwen2.Qwen2Model.load_weights
    def swapped(self, weights):
        swap = {"gate_proj": "up_proj", "up_proj": "gate_proj"}
        def rename(n):
            part = next((p for p in swap if f"layers.1.mlp.{p}." in n), None)
            return n.replace(part, swap[part]) if part else n
        return load(self, ((rename(n), t) for n, t in weights))
    qwen2.Qwen2Model.load_weights = swapped
print("FINDINGS=" + json.dumps(w.check_weights(Path(sys.argv[3]), Path(sys.argv[4]), print)))
"""


@pytest.mark.kit
@pytest.mark.parametrize("loader", ["as-is", "swap"])
def test_the_weights_check_compares_what_vllms_loader_wrote_with_the_checkpoint(
    loader, tiny_model_dir, tmp_path
):
    """check_weights on this environment's vLLM and a plain bf16 model (no FP4 layer: vLLM 0.32 has no
    CPU kernel for them): every parameter equals the checkpoint, fused q/k/v and gate/up and the padded
    vocabulary included; a loader that swaps gate and up is caught. In a subprocess, like the model
    check."""
    pytest.importorskip("vllm")
    args = [
        sys.executable,
        "-c",
        WEIGHTS_CHECK,
        str(SCRIPTS),
        str(ROOT),
        str(tiny_model_dir),
        str(tmp_path),
        loader,
    ]
    out = subprocess.run(args, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("FINDINGS=")]
    assert lines, out.stdout[-2000:] + out.stderr[-2000:]
    findings = json.loads(lines[0].removeprefix("FINDINGS="))
    if loader == "as-is":
        assert findings == [] and "0 NVFP4 layers" in out.stdout, out.stdout[-1500:]
    else:
        assert findings == [
            "weights: model.layers.1.mlp.gate_up_proj.weight differs from the checkpoint after vLLM's loader"
        ]
