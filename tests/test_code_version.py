"""Code versions cover a stage's import closure: editing any module it (transitively) imports
changes its key; nothing keeps a list of them."""

from __future__ import annotations

import time
import uuid

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
def test_editing_any_module_of_the_closure_changes_the_version(package, edited):
    name, root = package
    before = code_version(f"{name}.a", root=name)
    path = root / edited
    path.write_text(path.read_text() + "# edited\n")
    assert code_version(f"{name}.a", root=name) != before


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
