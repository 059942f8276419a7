"""Code versions cover a stage's import closure: editing any module it (transitively) imports
changes its key; nothing keeps a list of them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from qerl.pipeline.store.code_version import closure_cost, code_version, module_closure


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A small package: ``a`` imports ``b`` at module level, ``b`` imports ``c`` inside a function
    and ``d`` relatively, ``c`` names ``e`` by string; ``f`` only under TYPE_CHECKING, ``g`` never."""
    name = f"cvpkg_{uuid.uuid4().hex[:8]}"
    root = tmp_path / name
    (root / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": f"import {name}.sub.b\n",
        "sub/__init__.py": "X = 1\n",
        "sub/b.py": (f"from . import d\ndef f():\n    from {name} import c\n    return c\n"),
        "c.py": f'EXT = "{name}.e.Extension"\n',
        "sub/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n" + f"    import {name}.f\n",
        "e.py": "class Extension: ...\n",
        "f.py": "",
        "g.py": "",
    }
    for rel, text in files.items():
        (root / rel).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name, root


def test_the_closure_follows_every_kind_of_import(package):
    name, _ = package
    closure = set(module_closure(f"{name}.a", root=name))
    expected = {"", ".a", ".sub", ".sub.b", ".c", ".sub.d", ".e"}
    assert closure == {name + m for m in expected}


@pytest.mark.parametrize("edited", ["a.py", "sub/__init__.py", "sub/b.py", "c.py", "sub/d.py", "e.py"])
def test_changing_the_code_of_any_module_of_the_closure_changes_the_version(package, edited):
    name, root = package
    before = code_version(f"{name}.a", root=name)
    path = root / edited
    path.write_text(path.read_text() + "LIMIT = 3\n")
    assert code_version(f"{name}.a", root=name) != before


def test_comments_docstrings_and_layout_change_nothing(package):
    name, root = package
    before = code_version(f"{name}.a", root=name)
    b = root / "sub" / "b.py"
    b.write_text(
        '"""What b does, now documented."""\n\n# a comment\nfrom . import d  # why\n\n\n'
        f'def f( ):\n    """Return c."""\n    from {name} import c\n\n    return (c)\n'
    )
    (root / "e.py").write_text('class Extension:\n    """Loaded by name."""\n\n    ...\n')
    assert code_version(f"{name}.a", root=name) == before
    b.write_text(b.read_text().replace("return (c)", "return None"))
    assert code_version(f"{name}.a", root=name) != before


def test_a_skipped_package_is_left_out_below_a_root_and_hashed_alone_as_one(package):
    name, root = package
    skip = (f"{name}.sub",)
    closure = module_closure(f"{name}.a", root=name, skip=skip)
    assert f"{name}.sub.b" not in closure and f"{name}.c" not in closure  # c came in through b only
    alone = set(module_closure(f"{name}.sub.b", root=name, skip=skip))  # its sub-package left out
    assert alone == {name, f"{name}.sub.b", f"{name}.c", f"{name}.e"}


def test_a_module_outside_the_closure_changes_nothing(package):
    name, root = package
    before = code_version(f"{name}.a", root=name)
    for rel in ("f.py", "g.py"):
        (root / rel).write_text("y = 2\n")
    assert code_version(f"{name}.a", root=name) == before


def test_the_stages_closures_hold_their_prompts_and_kernels():
    rollout = set(module_closure("qerl.stages.rollout"))
    assert "qerl.pipeline.data.prompts" in rollout
    vllm = set(module_closure("qerl.stages.rollout", "qerl.pipeline.rollout.vllm_engine"))
    assert {"qerl.pipeline.rollout.aqn_vllm", "qerl.pipeline.rollout.vllm_engine"} <= vllm
    kernels = {
        "qerl.kernels.nvfp4_reference",
        "qerl.kernels.nvfp4_dispatch",
        "qerl.kernels.nvfp4_triton",
        "qerl.kernels.nvfp4_numba",
    }
    assert kernels <= set(module_closure("qerl.stages.train"))
    assert kernels <= set(module_closure("qerl.stages.quantize"))
    assert {"qerl.pipeline.data.rewards", "qerl.pipeline.data.answers"} <= set(
        module_closure("qerl.stages.score")
    )
    for stage in ("rollout", "train", "quantize", "score", "evaluate", "register"):
        assert not any(m.startswith("qerl.flows") for m in module_closure(f"qerl.stages.{stage}"))


def test_a_stage_call_costs_milliseconds():
    cost = closure_cost("qerl.stages.train")
    assert cost["modules"] >= 20
    start = time.perf_counter()
    code_version("qerl.stages.train")
    assert time.perf_counter() - start < 0.5  # measured: about 5 ms once the closure is parsed


STAGES = (
    "fetch_model",
    "demo_base",
    "quantize",
    "dequantize",
    "quality",
    "rollout",
    "score",
    "train",
    "evaluate",
    "register",
)
VERSIONS = f"""
import json
from qerl.pipeline.store.code_version import code_version
versions = {{s: code_version("qerl.stages." + s) for s in {STAGES!r}}}
versions["rollout-vllm"] = code_version("qerl.stages.rollout", "qerl.pipeline.rollout.vllm_engine")
import qerl
print(json.dumps({{"from": qerl.__file__, **versions}}))
"""


def _versions_of(tree: Path | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if tree is not None:
        env["PYTHONPATH"] = str(tree)  # ahead of the installed qerl
    cwd = tree or Path(__file__).resolve().parent.parent  # -c puts the working dir first on sys.path
    out = subprocess.run(
        [sys.executable, "-c", VERSIONS], env=env, cwd=cwd, capture_output=True, text=True, check=True
    )
    versions = json.loads(out.stdout)
    assert tree is None or Path(versions["from"]).is_relative_to(tree), versions["from"]
    return {k: v for k, v in versions.items() if k != "from"}


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, (path, old)
    path.write_text(text.replace(old, new, 1))


def upgraded_qerl(tree: Path) -> Path:
    """A copy of this qerl under ``tree`` (first on PYTHONPATH, it runs instead of the installed one)
    with the edits of an upgrade that computes the same: comment lines in the GRPO step, the rewards
    and the NVFP4 linear, a reworded docstring, new code in the store, registry and config machinery."""
    checkout = Path(__file__).resolve().parent.parent
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(checkout / "qerl", tree / "qerl", ignore=ignore)
    for sub in ("pipeline", "stages", "kernels", "flows"):
        shutil.copytree(checkout / sub, tree / "qerl" / sub, ignore=ignore)
    pkg = tree / "qerl"
    for rel in ("pipeline/rl/step.py", "pipeline/data/rewards.py", "pipeline/nvfp4/linear.py"):
        (pkg / rel).write_text((pkg / rel).read_text() + "# upgraded: a comment only\n")
    _edit(pkg / "stages/train.py", '"""', '"""Reworded. ')
    for rel in ("pipeline/store/artifact_store.py", "pipeline/registry/promotion.py", "pipeline/config.py"):
        (pkg / rel).write_text(
            (pkg / rel).read_text() + "\n\ndef added_by_the_upgrade() -> int:\n    return 1\n"
        )
    return tree


def test_an_upgrade_that_computes_the_same_keeps_every_stage_version(tmp_path):
    """The edit that rebuilt 13 of a run's 14 artifacts (a comment line in the GRPO step, the rewards
    and the NVFP4 linear), with a reworded docstring and a changed store, registry and config
    machinery, keeps every stage's version; a change to the reward's code moves score and evaluate
    only."""
    tree = upgraded_qerl(tmp_path / "upgraded")
    pkg = tree / "qerl"
    installed = _versions_of(None)
    assert _versions_of(tree) == installed

    rewards = (pkg / "pipeline/data/rewards.py").read_text()
    (pkg / "pipeline/data/rewards.py").write_text(rewards + "\nUPGRADED_LIMIT = 2\n")
    moved = {s for s, v in _versions_of(tree).items() if v != installed[s]}
    assert moved == {"score", "evaluate"}, moved
