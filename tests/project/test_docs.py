"""The README and the docs site say true things about the repository.

- the generated configuration reference (docs/reference/configuration.md) is current;
- every repository path the README or a docs page names in backticks (`pipeline/.../x.py`, `flows/x.py`,
  `scripts/x.sh`, ...) exists, and so does every module a dotted name (`qerl.pipeline.rl.step`)
  points at; the README's relative links point at files;
- every docs page is in the site's nav (mkdocs only notes an omitted page; `mkdocs build --strict`,
  run by `make test`, catches broken links between pages).
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
TOP = (
    "pipeline",
    "stages",
    "kernels",
    "flows",
    "benchmarks",
    "scripts",
    "tests",
    "requirements",
    "docs",
    "qerl",
)
PACKAGES = {
    "pipeline": "pipeline",
    "stages": "stages",
    "kernels": "kernels",
    "flows": "flows",
}  # qerl.X -> folder

_FENCE = re.compile(r"^ *(```|~~~).*?^ *\1", re.M | re.S)
_CODE = re.compile(r"`([^`\n]+)`")
_PATH = re.compile(rf"(?<![\w./<-])((?:{'|'.join(TOP)})/[\w./*-]*)")
_DOTTED = re.compile(r"(?<![\w./-])((?:qerl\.)?(?:pipeline|stages|kernels|flows)(?:\.\w+)+)")
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def _code_spans(text: str) -> list[str]:
    return _CODE.findall(_FENCE.sub("", text))


def _path_exists(path: str) -> bool:
    path = path.rstrip(".")
    if "*" in path:
        return any(ROOT.glob(path))
    return (ROOT / path).exists()


def _module_exists(dotted: str) -> bool:
    """``qerl.pipeline.rl.train_config.TrainConfig``: the folders and the module exist, the name is defined there."""
    parts = dotted.split(".")
    if parts[0] == "qerl":
        parts = parts[1:]
    where = ROOT / PACKAGES[parts[0]]
    rest = parts[1:]
    while rest and (where / rest[0]).is_dir():
        where, rest = where / rest[0], rest[1:]
    if not rest:
        return (where / "__init__.py").exists()
    module = where / f"{rest[0]}.py"
    if module.exists():
        where, rest = module, rest[1:]
    else:
        where = where / "__init__.py"
        if not where.exists():
            return False
    if not rest:
        return True
    name = re.escape(rest[0])
    source = where.read_text()
    return bool(
        re.search(
            rf"^\s*(?:async\s+)?(?:def|class)\s+{name}\b|^{name}\s*[:=]|\bimport\b.*\b{name}\b", source, re.M
        )
    )


def stale_mentions(text: str, *, check_links: bool = False) -> list[str]:
    """The repository paths and module names in ``text``'s inline code (and links) that do not exist."""
    stale: list[str] = []
    for span in _code_spans(text):
        if "<" in span or "://" in span:  # `<work>/runs/<run-id>/run.log`, URLs: not repository paths
            continue
        stale += [f"path `{p}`" for p in _PATH.findall(span) if not _path_exists(p)]
        stale += [f"module `{m}`" for m in _DOTTED.findall(span) if not _module_exists(m)]
    if check_links:
        for target in _LINK.findall(_FENCE.sub("", text)):
            target = target.split("#", 1)[0]
            if (
                target
                and "://" not in target
                and not target.startswith("mailto:")
                and not _path_exists(target)
            ):
                stale.append(f"link ({target})")
    return stale


def test_configuration_reference_is_current():
    from qerl.pipeline.planning import config_reference
    from qerl.pipeline.planning.config_reference import DOCS_PAGE, REGENERATE, reference_page

    page = DOCS / "reference" / "configuration.md"
    if Path(config_reference.__file__).resolve().is_relative_to(ROOT):  # a checkout: the command's default
        assert DOCS_PAGE == page
    assert page.exists() and page.read_text() == reference_page(), (
        f"docs/reference/configuration.md is not what the config classes generate; run: {REGENERATE}"
    )


def test_paths_and_modules_named_in_the_docs_exist():
    stale = {
        str(doc.relative_to(ROOT)): found
        for doc in documents()
        if (found := stale_mentions(doc.read_text(), check_links=doc.name == "README.md"))
    }
    assert not stale, f"the docs name paths or modules that do not exist (moved? renamed?): {stale}"


def test_the_check_reports_what_does_not_exist():
    text = (
        "The bootstrap is `scripts/bootstrap.sh`, this test `tests/project/test_docs.py`, the presets `pipeline/planning/presets/`.\n"
        "Made up: `pipeline/store/no_such_module.py`, `scripts/no_such.sh`, `qerl.pipeline.planning.no_such_module`,\n"
        "`qerl.pipeline.planning.config_reference.no_such_function`, and [a link](docs/no-such-page.md).\n"
        "```\nfenced blocks are not inline code: pipeline/also_made_up.py\n```\n"
        "`<work>/runs/<run-id>/run.log` is not a repository path; `qerl.pipeline.planning` is a package,\n"
        "`python -m qerl.pipeline.planning.config_reference` a module, `qerl.pipeline.planning.config_reference.reference_page` a function.\n"
    )
    assert stale_mentions(text, check_links=True) == [
        "path `pipeline/store/no_such_module.py`",
        "path `scripts/no_such.sh`",
        "module `qerl.pipeline.planning.no_such_module`",
        "module `qerl.pipeline.planning.config_reference.no_such_function`",
        "link (docs/no-such-page.md)",
    ]


def test_every_docs_page_is_in_the_nav():
    def pages(nav: object) -> list[str]:
        if isinstance(nav, str):
            return [nav]
        if isinstance(nav, dict):
            return [p for value in nav.values() for p in pages(value)]
        if isinstance(nav, list):
            return [p for item in nav for p in pages(item)]
        return []

    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    in_nav = set(pages(config["nav"]))
    on_disk = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert on_disk - in_nav == set(), "docs pages missing from mkdocs.yml's nav"
    assert in_nav - on_disk == set(), "mkdocs.yml's nav names pages that do not exist"
