"""Imports go one way (pipeline/__init__.py): flows -> stages -> pipeline -> kernels, and inside pipeline
from the top of its layer list to the bottom. Checked on every import statement, at module level or
inside a function, so a lazy import cannot cross a layer either."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# pipeline's sub-packages by layer: a sub-package may import its own layer's lower entries only when
# listed in SAME_LAYER_OK, and any lower layer
LAYERS = [
    {"config", "runtime", "schemes", "fleet"},
    {"store"},
    {"nvfp4", "data"},
    {"nf4"},
    {"rollout", "rl", "evaluation", "registry", "demo"},
    {"planning"},
]
SAME_LAYER_OK: set[tuple[str, str]] = set()
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}
TOP = {"flows": 3, "stages": 2, "pipeline": 1, "kernels": 0}


def _imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
    return found


def _sources(folder: str) -> list[Path]:
    return sorted((REPO / folder).rglob("*.py"))


def test_every_pipeline_sub_package_has_a_layer():
    packages = {p.name for p in (REPO / "pipeline").iterdir() if (p / "__init__.py").exists()}
    packages |= {p.stem for p in (REPO / "pipeline").glob("*.py") if p.stem != "__init__"}
    assert packages == set(RANK), (
        "add the new sub-package to LAYERS (and to pipeline/__init__.py's docstring)"
    )


def test_pipeline_sub_packages_import_downwards_only():
    wrong = []
    for path in _sources("pipeline"):
        rel = path.relative_to(REPO / "pipeline").parts
        if rel == ("__init__.py",):
            continue
        here = rel[0].removesuffix(".py")
        for module in _imports(path):
            parts = module.split(".")
            if parts[:2] != ["qerl", "pipeline"] or len(parts) < 3 or parts[2] == here:
                continue
            there = parts[2]
            if RANK[there] > RANK[here] or (RANK[there] == RANK[here] and (here, there) not in SAME_LAYER_OK):
                wrong.append(f"{path.relative_to(REPO)} imports {module}")
    assert wrong == []


def test_the_top_level_folders_import_downwards_only():
    wrong = []
    for folder, rank in TOP.items():
        for path in _sources(folder):
            for module in _imports(path):
                parts = module.split(".")
                if parts[0] == "qerl" and len(parts) > 1 and TOP.get(parts[1], -1) > rank:
                    wrong.append(f"{path.relative_to(REPO)} imports {module}")
    assert wrong == []


def test_only_flows_import_prefect():
    wrong = [
        f"{path.relative_to(REPO)} imports {module}"
        for folder in ("pipeline", "stages", "kernels")
        for path in _sources(folder)
        for module in _imports(path)
        if module.split(".")[0] in {"prefect", "prefect_ray"}
    ]
    assert wrong == []


def test_the_checker_finds_an_upward_import(tmp_path, monkeypatch):
    fake = tmp_path / "pipeline" / "store"
    fake.mkdir(parents=True)
    (fake / "bad.py").write_text("def f():\n    from qerl.pipeline.planning.run_config import RunConfig\n")
    assert _imports(fake / "bad.py") == ["qerl.pipeline.planning.run_config"]
    monkeypatch.setattr(__import__(__name__), "REPO", tmp_path)
    try:
        test_pipeline_sub_packages_import_downwards_only()
    except AssertionError as err:
        assert "store/bad.py imports qerl.pipeline.planning.run_config" in str(err)
    else:
        raise AssertionError("the upward import was not reported")
