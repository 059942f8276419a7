"""Code versions cover a stage's import closure: editing any module it (transitively) imports
changes its key; nothing keeps a list of them."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

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


def test_the_stages_closures_hold_what_they_compute_with_and_no_other_scheme():
    """Each stage's roots, as the stages pass them (the engine, the scheme's decoding module): the
    prompts, kernels and rewards each computes with are in, another scheme's code and another stage's
    report are not."""
    from qerl.stages import dequantize, train

    nvfp4, nf4 = ("qerl.pipeline.nvfp4.loading",), ("qerl.pipeline.nf4.dequantize",)
    assert dequantize.code_roots("nvfp4") == ("qerl.stages.dequantize", *nvfp4)
    assert dequantize.code_roots("nf4") == ("qerl.stages.dequantize", *nf4)
    assert train.code_roots(SimpleNamespace(mode="nvfp4/numba")) == ("qerl.stages.train", *nvfp4)
    nf4_train = ("qerl.pipeline.nf4.training",)
    assert train.code_roots(SimpleNamespace(mode="nf4/bitsandbytes")) == ("qerl.stages.train", *nf4_train)
    assert train.code_roots(SimpleNamespace(mode="unquantized")) == ("qerl.stages.train",)
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
    nvfp4_train = set(module_closure("qerl.stages.train", *nvfp4))
    assert kernels <= nvfp4_train and kernels <= set(module_closure("qerl.stages.quantize"))
    assert {"qerl.pipeline.data.rewards", "qerl.pipeline.data.answers"} <= set(
        module_closure("qerl.stages.score")
    )
    nf4_code = {m for m in module_closure("qerl.stages.quantize_nf4") if m.startswith("qerl.pipeline.nf4")}
    for roots in (("qerl.stages.quantize",), dequantize.code_roots("nvfp4"), ("qerl.stages.train", *nvfp4)):
        closure = set(module_closure(*roots))
        assert not closure & nf4_code and "qerl.pipeline.nvfp4.quality" not in closure, roots
        assert "qerl.pipeline.rollout.factory" not in closure  # the engines' config checks
    assert not kernels & set(module_closure("qerl.stages.quantize_nf4"))
    assert "qerl.pipeline.rollout.factory" not in vllm
    for stage in ("rollout", "train", "quantize", "score", "evaluate", "register"):
        assert not any(m.startswith("qerl.flows") for m in module_closure(f"qerl.stages.{stage}"))


def test_a_stage_call_costs_milliseconds():
    cost = closure_cost("qerl.stages.train")
    assert cost["modules"] >= 15
    start = time.perf_counter()
    code_version("qerl.stages.train")
    assert time.perf_counter() - start < 0.5  # measured: about 5 ms once the closure is parsed


# every stage's code version as its run computes it, per scheme and engine (the roots the stages pass)
VERSIONS = """
import json
from qerl.pipeline.schemes import scheme_module_name as decoder
from qerl.pipeline.store.code_version import code_version
S = "qerl.stages."
engines = {"hf": "qerl.pipeline.rollout.hf_engine", "vllm": "qerl.pipeline.rollout.vllm_engine"}
versions = {s: code_version(S + s) for s in ("fetch_model", "demo_base", "score", "register")}
versions.update({f"quantize/{s}": code_version(S + m) for s, m in
                 (("nvfp4", "quantize"), ("nf4", "quantize_nf4"), ("none", "quantize_none"))})
for s in ("nvfp4", "nf4"):
    versions[f"dequantize/{s}"] = code_version(S + "dequantize", decoder(s))
    versions[f"quality/{s}"] = code_version(S + "quality", decoder(s))
    versions[f"train/{s}"] = code_version(S + "train", decoder(s, training=True))
versions["train/none"] = code_version(S + "train")
for e, module in engines.items():
    versions[f"rollout/{e}"] = code_version(S + "rollout", module)
    versions[f"evaluate/{e}"] = code_version(S + "evaluate", module)
import qerl
print(json.dumps({"from": qerl.__file__, **versions}))
"""
NVFP4_KEYS = {"quantize/nvfp4", "dequantize/nvfp4", "train/nvfp4", "quality/nvfp4"}


def _versions_of(tree: Path | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if tree is not None:
        env["PYTHONPATH"] = str(tree)  # ahead of the installed qerl
    cwd = tree or Path(__file__).resolve().parents[2]  # -c puts the working dir first on sys.path
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
    checkout = Path(__file__).resolve().parents[2]
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
    assert moved == {"score", "evaluate/hf", "evaluate/vllm"}, moved


class _Reworded(ast.NodeTransformer):
    """Every message reworded: the strings of raise statements and of logging calls, their f-strings
    whole, and the argument of ``logging.getLogger``."""

    LOGGING = {"debug", "info", "warning", "error", "exception", "critical", "setLevel", "getLogger"}

    def _reword(self, node: ast.AST) -> ast.AST:
        for child in ast.walk(node):
            for field, value in ast.iter_fields(child):
                items = value if isinstance(value, list) else [value]
                new = [ast.Constant(f"reworded {i}") if isinstance(v, ast.JoinedStr) or (
                    isinstance(v, ast.Constant) and isinstance(v.value, str)) else v for i, v in enumerate(items)]  # fmt: skip
                setattr(child, field, new if isinstance(value, list) else new[0])
        return node

    def visit_Raise(self, node: ast.Raise) -> ast.AST:
        return self._reword(node)

    def visit_Call(self, node: ast.Call) -> ast.AST:
        if isinstance(node.func, ast.Attribute) and node.func.attr in self.LOGGING:
            return self._reword(node)
        return self.generic_visit(node)


def _reword_messages(path: Path) -> bool:
    """Rewrite ``path`` with every message reworded (``_Reworded``); whether any was."""
    before = ast.unparse(ast.parse(path.read_text()))
    after = ast.unparse(_Reworded().visit(ast.parse(path.read_text())))
    path.write_text(after + "\n")
    return after != before


def test_messages_logs_and_another_schemes_code_keep_the_keys(tmp_path):
    """Rewording every error and log message of the NVFP4 quantizer, the twin, the engine factory and
    the NF4 checkpoint, silencing a library's logger there, changing the quality report's batching and
    the NF4 quantizer's code moves no NVFP4 key, nor any rollout's, train's or evaluation's."""
    tree = upgraded_qerl(tmp_path / "upgraded")
    pkg = tree / "qerl"
    installed = _versions_of(None)
    _edit(pkg / "stages/quantize.py", 'log = logging.getLogger("qerl.stages.quantize")',
          'log = logging.getLogger("qerl.quantize")\nlogging.getLogger("numba").setLevel(logging.WARNING)')  # fmt: skip
    for rel in ("stages/quantize.py", "stages/dequantize.py", "pipeline/rollout/factory.py",
                "pipeline/nf4/checkpoint.py", "kernels/nvfp4_dispatch.py", "pipeline/rl/step.py"):  # fmt: skip
        assert _reword_messages(pkg / rel), rel
    _edit(pkg / "pipeline/nvfp4/quality.py", "_BATCH_TOKENS = 4096", "_BATCH_TOKENS = 2048")
    _edit(pkg / "stages/quantize_nf4.py", 'skip = ["lm_head", ', 'skip = ["lm_head", "embed_tokens", ')
    moved = {s for s, v in _versions_of(tree).items() if v != installed[s]}
    assert moved == {"quality/nvfp4", "quality/nf4", "quantize/nf4"}, moved


@pytest.mark.parametrize(
    ("rel", "old", "new", "expected"),
    [
        ("kernels/nvfp4_reference.py", "ZERO_SCALE = 0.125", "ZERO_SCALE = 0.25", NVFP4_KEYS),
        ("pipeline/rl/objective.py", "torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)",
         "torch.clamp(ratio, 1.0 - eps_low, 1.0 + 2 * eps_high)", {"train/nvfp4", "train/nf4", "train/none"}),
        ("pipeline/data/answers.py", "return found[-1] if found else None", "return found[0] if found else None",
         {"score", "evaluate/hf", "evaluate/vllm"}),
        ("pipeline/nf4/dequantize.py", "state).to(dtype)", "state).to(dtype) * 1.0", {"dequantize/nf4", "quality/nf4"}),
    ],
)  # fmt: skip
def test_a_change_that_moves_an_output_moves_the_keys_that_depend_on_it_and_only_those(
    tmp_path, rel, old, new, expected
):
    tree = upgraded_qerl(tmp_path / "upgraded")
    installed = _versions_of(None)
    _edit(tree / "qerl" / rel, old, new)
    moved = {s for s, v in _versions_of(tree).items() if v != installed[s]}
    assert moved == expected, moved


def test_the_normaliser_blanks_only_what_people_read(package):
    """Messages and logging leave the version; a returned string, a raise's type and what a
    statement computes beside its logging do not."""
    name, root = package
    b = root / "sub" / "b.py"
    b.write_text(
        "import logging\nlog = logging.getLogger('a')\nfrom . import d\n"
        "def f(x):\n    if x < 0:\n        raise ValueError(f'x is {x}')\n    log.info('x=%s', x)\n"
        "    assert x >= 0, 'negative'\n    return 'ok'\n"
    )
    before = code_version(f"{name}.a", root=name)
    for old, new in (("f'x is {x}'", "'x below zero'"), ("'x=%s'", "'value %s'"), ("getLogger('a')", "getLogger('b')"),
                     ("'negative'", "'must be >= 0'"), ("    log.info('x=%s', x)\n", "")):  # fmt: skip
        b.write_text(b.read_text().replace(old, new))
        assert code_version(f"{name}.a", root=name) == before, (old, new)
    for old, new in (("return 'ok'", "return 'OK'"), ("ValueError", "TypeError"), ("x < 0", "x < 1")):
        text = b.read_text()
        b.write_text(text.replace(old, new))
        assert code_version(f"{name}.a", root=name) != before, (old, new)
        b.write_text(text)
