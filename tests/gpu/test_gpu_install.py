"""The GPU install a user gets is the one that ran: the README's GPU install (requirements/gpu.txt,
through `QERL_ENV=gpu make venv`), whose versions the docs name, and a newer set offered only labelled
untested. Every version is read from the files, none is written here. (That the maintainers' transfer
kit carries the same vLLM and torch is tests/tools/test_gpu_bundle.py's.)"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GPU_REQS = ROOT / "requirements" / "gpu.txt"
UNTESTED = ROOT / "requirements" / "gpu-untested-vllm032.txt"


def pins(path: Path) -> dict[str, str]:
    """name -> version of every `name==version` line (extras and comments dropped)."""
    out = {}
    for line in path.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.-]+)(?:\[[^]]*\])?==([^\s#]+)", line.strip())
        if m:
            out[m.group(1).lower()] = m.group(2)
    return out


def readme_gpu_section() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("## Install on a GPU machine\n")
    return text[start : text.index("\n## ", start + 1)]


def test_the_readmes_gpu_install_is_requirements_gpu_txt_and_names_its_versions():
    section = readme_gpu_section()
    install = pins(GPU_REQS)
    assert "QERL_ENV=gpu make venv" in section and "requirements/gpu.txt" in section
    bootstrap = (ROOT / "scripts" / "bootstrap.sh").read_text()
    assert "gpu) REQS=requirements/gpu.txt ;;" in bootstrap, "QERL_ENV=gpu installs requirements/gpu.txt"
    assert "untested" not in bootstrap.lower(), "make never installs the untested set"
    assert f"vLLM {install['vllm']} on torch {install['torch']}" in section
    guide = (ROOT / "docs" / "guide" / "gpu.md").read_text()
    assert f"vLLM {install['vllm']} on torch {install['torch']}" in guide
    # which versions ran on which GPU, with dates
    assert re.search(r"H200 on 2026-11-26", section) and "H100 and an H200" in section
    table = re.findall(r"^\| (\d{4}-\d\d-\d\d) \| NVIDIA (H100|H200)[^|]*\| ([^|]*) \|", guide, re.M)
    assert {gpu for _, gpu, _ in table} == {"H100", "H200"} and len(table) >= 3
    first = table[0][2]
    assert f"vLLM {install['vllm']}" in first and f"torch {install['torch']}" in first


def test_a_newer_vllm_is_offered_only_as_an_untested_option():
    untested, install = pins(UNTESTED), pins(GPU_REQS)
    assert untested["vllm"] != install["vllm"]
    assert UNTESTED.read_text().startswith("# UNTESTED ON A GPU")
    newer = f"vLLM {untested['vllm']}"
    for doc in (readme_gpu_section(), (ROOT / "docs" / "guide" / "gpu.md").read_text()):
        assert newer in doc
        # every paragraph that names the newer release says it is untested
        for para in re.split(r"\n\s*\n", doc):
            if newer in para:
                assert "untested" in para.lower() or "no gpu has run" in para.lower(), para
    assert not re.search(r"\blease|\bsession|borrowed|call sequence|issue \d", readme_gpu_section(), re.I)


def test_the_gpu_guide_says_no_development_logistics():
    guide = (ROOT / "docs" / "guide" / "gpu.md").read_text()
    offline = (ROOT / "docs" / "guide" / "gpu-offline.md").read_text()
    for text in (guide, offline):
        assert not re.search(r"\blease|\bsession|borrowed|call sequence|budget_left|issue \d+", text, re.I)
