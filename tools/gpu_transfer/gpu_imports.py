#!/usr/bin/env python3
"""Which distributions `import vllm` needs beyond the GPU image: a static import scan. Standard
library only (it reads source, it imports nothing it scans).

From root modules, the scan follows the imports that run at import time: module level, class bodies,
`if`/`try`/`with` blocks; not function bodies, not `if TYPE_CHECKING:`. It resolves relative imports,
and reports the top-level names that the scanned trees do not hold, mapped to distributions (a wheel's
top_level.txt or RECORD, else the running interpreter's metadata, else a table, else the name itself),
minus the standard library and minus the GPU image's distributions (`gpu_image_packages.txt`, or
`--installed` on the image itself). It also reports the modules of the trees that are imported but
absent: a file the drop list removed that is still needed shows up here.

Each external name is classed: "needed" (an unguarded import in a module that unguarded imports
reach), "conditional" (under a module-level `if`, or only in modules reached through one: the scan
reports the condition, a person decides), "optional" (only inside `try` blocks that catch
ImportError). A module bound lazily (vLLM's ``LazyLoader``) counts as imported where the module uses
it at import time, in an annotation that Python evaluates, say (tools/gpu_transfer/gpu_lazy.py). A static scan
cannot see `importlib.import_module(name)` with a computed name; gpu_offline.sh's import of every root
on the machine (tools/gpu_transfer/gpu_import_roots.py) is the check that it missed nothing.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import sys
import zipfile
from collections import deque
from collections.abc import Callable
from pathlib import Path

from gpu_lazy import eager_lazy_modules

IMAGE_FILE = Path(__file__).with_name("gpu_image_packages.txt")

# Import names whose distribution is not the name itself (used when neither a wheel nor the running
# environment says; a wheel's top_level.txt / RECORD or importlib.metadata wins over this table).
KNOWN_DISTS = {
    "yaml": "pyyaml", "PIL": "pillow", "cv2": "opencv-python-headless", "google": "protobuf",
    "zmq": "pyzmq", "cpuinfo": "py-cpuinfo", "dateutil": "python-dateutil", "sklearn": "scikit-learn",
    "skimage": "scikit-image", "pynvml": "nvidia-ml-py", "cuda": "cuda-bindings", "attr": "attrs",
    "jwt": "pyjwt", "dotenv": "python-dotenv", "multipart": "python-multipart", "pythonjsonlogger":
    "python-json-logger", "lm_format_enforcer": "lm-format-enforcer", "huggingface_hub": "huggingface-hub",
    "typing_extensions": "typing-extensions", "pydantic_core": "pydantic-core", "msgspec": "msgspec",
    "flashinfer": "flashinfer-python", "cutlass": "nvidia-cutlass-dsl", "tvm_ffi": "apache-tvm-ffi",
    "quack": "quack-kernels", "humming": "humming-kernels", "openai_harmony": "openai-harmony",
    "mistral_common": "mistral-common", "partial_json_parser": "partial-json-parser",
    "compressed_tensors": "compressed-tensors", "prometheus_client": "prometheus-client",
    "prometheus_fastapi_instrumentator": "prometheus-fastapi-instrumentator", "outlines_core":
    "outlines-core", "annotated_types": "annotated-types", "typing_inspection": "typing-inspection",
    "cachetools": "cachetools", "setproctitle": "setproctitle", "pkg_resources": "setuptools",
    "_distutils_hack": "setuptools", "mpl_toolkits": "matplotlib", "jinja2": "jinja2", "nvtx": "nvtx",
    "cudnn": "nvidia-cudnn-frontend", "tokenspeed_mla": "tokenspeed-mla", "opentelemetry":
    "opentelemetry-api", "ray": "ray", "xgrammar": "xgrammar", "llguidance": "llguidance",
}  # fmt: skip


def norm(dist: str) -> str:
    """PEP 503 normalised distribution name."""
    return re.sub(r"[-_.]+", "-", dist).lower()


EXT_RE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(\.[A-Za-z0-9_-]+)*\.(so|pyd)$")


def index_tree(trees: list[Path]) -> dict[str, Path]:
    """Module name -> file for every .py and extension module under the trees (a package is named by
    its __init__.py; a folder with no __init__.py is a namespace package, named by the folder)."""
    index: dict[str, Path] = {}
    for tree in trees:
        for dirpath, dirnames, filenames in os.walk(tree, followlinks=True):
            dirnames[:] = [d for d in dirnames if d.isidentifier()]
            rel = Path(dirpath).relative_to(tree)
            parts = [p for p in rel.parts]
            if parts:
                index.setdefault(".".join(parts), Path(dirpath))  # namespace package until __init__
            for fn in filenames:
                path = Path(dirpath) / fn
                if fn == "__init__.py":
                    if parts:
                        index[".".join(parts)] = path
                elif fn.endswith(".py") and fn[:-3].isidentifier():
                    index[".".join([*parts, fn[:-3]])] = path
                elif m := EXT_RE.match(fn):
                    index.setdefault(".".join([*parts, m.group(1)]), path)
    return index


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _catches_import_error(handlers: list[ast.ExceptHandler]) -> bool:
    names = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException", "OSError"}
    for h in handlers:
        if h.type is None:
            return True
        types = h.type.elts if isinstance(h.type, ast.Tuple) else [h.type]
        for t in types:
            if (isinstance(t, ast.Name) and t.id in names) or (
                isinstance(t, ast.Attribute) and t.attr in names
            ):
                return True
    return False


def module_imports(path: Path, modname: str, is_package: bool) -> list[tuple[str, list[str], str]]:
    """The imports that run when the module is imported: (base module, imported names, guard), guard
    "" for a plain import, "try" inside a `try` that catches ImportError (or broader), else the source
    of the module-level `if` test it sits under ("not (...)" in an else branch)."""
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError):
        return []
    package = modname if is_package else modname.rpartition(".")[0]
    found: list[tuple[str, list[str], str]] = []

    def resolve(level: int, module: str | None) -> str | None:
        if level == 0:
            return module
        parts = package.split(".") if package else []
        if level - 1 > len(parts):
            return None
        base = parts[: len(parts) - (level - 1)]
        return ".".join([*base, module] if module else base) or None

    def visit(stmts: list[ast.stmt], guard: str) -> None:
        for node in stmts:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    found.append((alias.name, [], guard))
            elif isinstance(node, ast.ImportFrom):
                base = resolve(node.level, node.module)
                if base:
                    found.append((base, [a.name for a in node.names if a.name != "*"], guard))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue  # runs when called, not when imported
            elif isinstance(node, ast.If):
                test = ast.unparse(node.test)
                if not _is_type_checking(node.test):
                    visit(node.body, guard or test)
                visit(node.orelse, guard or f"not ({test})")
            elif isinstance(node, ast.Try) or type(node).__name__ == "TryStar":
                inner = "try" if _catches_import_error(node.handlers) else guard
                visit(node.body, guard if guard and guard != "try" and inner == guard else inner)
                for h in node.handlers:
                    visit(h.body, guard)
                visit(node.orelse, inner)
                visit(node.finalbody, guard)
            elif isinstance(node, (ast.ClassDef, ast.With, ast.AsyncWith, ast.For, ast.AsyncFor, ast.While)):
                visit(node.body, guard)
                visit(getattr(node, "orelse", []), guard)
            elif type(node).__name__ == "Match":
                for case in node.cases:  # type: ignore[attr-defined]
                    visit(case.body, guard or "match")

    visit(tree.body, "")
    # a lazily bound module that an annotation, decorator or module-level statement uses is imported
    # when this module is (tools/gpu_transfer/gpu_lazy.py)
    found += [(mod, [], "") for mod in eager_lazy_modules(tree)]
    return found


def _stdlib() -> set[str]:
    names = set(getattr(sys, "stdlib_module_names", ())) | set(sys.builtin_module_names)
    return names | {"__future__", "_typeshed"}


def _classify_externals(
    parent: dict[str, str | None],
    core: dict,
    edges: dict,
    tree_tops: set[str],
    stdlib: set[str],
    chain: Callable[[str], list[str]],
) -> dict[str, dict]:
    """Each external top-level name the reached modules import, classed as ``scan`` says, with up to
    five importers, three guards and the import chain of its first importer."""
    rank = {"needed": 0, "conditional": 1, "optional": 2}
    externals: dict[str, dict] = {}
    for mod in parent:
        for base, _names, guard in edges.get(mod, []):
            top = base.split(".")[0]
            if not top or top in tree_tops or top in stdlib:
                continue
            if guard == "try":
                kind, why = "optional", ""
            elif guard:
                kind, why = "conditional", f"if {guard}"
            elif mod in core:
                kind, why = "needed", ""
            else:
                kind, why = "conditional", "in a module reached only through a guarded import"
            entry = externals.setdefault(top, {"kind": kind, "importers": [], "guards": []})
            if rank[kind] < rank[entry["kind"]]:
                entry["kind"] = kind
            if len(entry["importers"]) < 5 and mod not in entry["importers"]:
                entry["importers"].append(mod)
            if why and why not in entry["guards"] and len(entry["guards"]) < 3:
                entry["guards"].append(why)
    for entry in externals.values():
        entry["chain"] = chain(entry["importers"][0])
    return externals


def _closure(
    index: dict[str, Path], edges: dict, roots: list[str], plain_only: bool
) -> tuple[dict[str, str | None], dict[str, tuple[str, str]]]:
    """Breadth-first import closure from the roots over the indexed modules: (module -> the module
    that first imported it, absent module -> (importer, guard)). With plain_only, guarded imports are
    not followed. `edges` caches each module's imports across calls."""
    tree_tops = {name.split(".")[0] for name in index}
    parent: dict[str, str | None] = {}
    missing: dict[str, tuple[str, str]] = {}
    queue: deque[str] = deque()

    def reach(name: str, via: str | None) -> bool:
        parts = name.split(".")
        for i in range(1, len(parts) + 1):  # importing a.b.c runs a/__init__ and a/b/__init__ first
            mod = ".".join(parts[:i])
            if mod in parent:
                continue
            if mod not in index:
                return False
            parent[mod] = via
            queue.append(mod)
        return True

    for root in roots:
        if not reach(root, None):
            missing[root] = ("(root)", "")
    while queue:
        mod = queue.popleft()
        path = index[mod]
        if path.is_dir() or path.suffix != ".py":
            continue
        if mod not in edges:
            edges[mod] = module_imports(path, mod, path.name == "__init__.py")
        for base, names, guard in edges[mod]:
            if (plain_only and guard) or base.split(".")[0] not in tree_tops:
                continue
            if base in index:
                reach(base, mod)
                for n in names:
                    if f"{base}.{n}" in index:
                        reach(f"{base}.{n}", mod)
            elif guard != "try" and base not in missing:
                head = base.rsplit(".", 1)[0]
                if head in index and index[head].is_file() and index[head].name != "__init__.py":
                    continue  # `from a.b.mod.attr import x` names an attribute, not a module
                missing[base] = (mod, guard)
                reach(base, mod)
    return parent, missing


def scan(trees: list[Path], roots: list[str]) -> dict:
    """Import closure from the roots over the trees' modules, twice: following every import that runs
    at import time (`reached`), and following only unguarded ones (`core`: what is certainly imported).
    Each external top-level name is classed as the module docstring says."""
    index = index_tree(trees)
    tree_tops = {name.split(".")[0] for name in index}
    edges: dict[str, list[tuple[str, list[str], str]]] = {}
    core, _ = _closure(index, edges, roots, plain_only=True)
    parent, missing = _closure(index, edges, roots, plain_only=False)

    def chain(mod: str) -> list[str]:
        out = [mod]
        while (p := parent.get(out[-1])) is not None:
            out.append(p)
        return out[::-1]

    externals = _classify_externals(parent, core, edges, tree_tops, _stdlib(), chain)
    reached = sorted(parent)
    packages = {}
    for mod in reached:  # the tree's top-level packages, each with how it is first reached
        top = mod.split(".")[0]
        if top not in packages:
            packages[top] = {"core": top in core, "chain": chain(mod)}
    return {
        "roots": roots,
        "packages": packages,
        "reached": reached,
        "core": sorted(core),
        "extensions": sorted(m for m in reached if index[m].suffix in (".so", ".pyd")),
        "core_extensions": sorted(m for m in core if index[m].suffix in (".so", ".pyd")),
        "externals": externals,
        "missing": {
            k: {"chain": chain(v) if v != "(root)" else [], "guard": g} for k, (v, g) in missing.items()
        },
    }


def dist_map_from_wheels(wheel_dir: Path | None) -> dict[str, str]:
    """Top-level import name -> distribution, read from the wheels' top_level.txt (or RECORD)."""
    out: dict[str, str] = {}
    if not wheel_dir or not wheel_dir.is_dir():
        return out
    for whl in sorted(wheel_dir.glob("*.whl")):
        dist = norm(whl.name.split("-")[0])
        with zipfile.ZipFile(whl) as zf:
            tops: set[str] = set()
            names = zf.namelist()
            tl = [n for n in names if n.endswith(".dist-info/top_level.txt")]
            if tl:
                tops |= {t.strip() for t in zf.read(tl[0]).decode().splitlines() if t.strip()}
            for n in names:
                first = n.split("/")[0]
                if first.endswith((".dist-info", ".data")):
                    continue
                if "/" in n:
                    tops.add(first)
                elif m := EXT_RE.match(first):
                    tops.add(m.group(1))
                elif first.endswith(".py"):
                    tops.add(first[:-3])
        for t in tops:
            out.setdefault(t, dist)
    return out


def dist_map_from_env() -> dict[str, str]:
    from importlib import metadata

    out: dict[str, str] = {}
    for top, dists in metadata.packages_distributions().items():
        if dists:
            out[top] = norm(dists[0])
    return out


def map_externals(result: dict, image: set[str], wheel_dir: Path | None, use_env: bool) -> dict:
    wheels = dist_map_from_wheels(wheel_dir)
    env = dist_map_from_env() if use_env else {}
    for top, entry in result["externals"].items():
        if top in wheels:
            dist, how = wheels[top], "wheel"
        elif top in env:
            dist, how = env[top], "environment"
        elif top in KNOWN_DISTS:
            dist, how = norm(KNOWN_DISTS[top]), "table"
        else:
            dist, how = norm(top), "guess"
        entry.update(dist=dist, mapped_by=how, in_image=dist in image)
    return result


def image_packages(path: Path = IMAGE_FILE) -> set[str]:
    """The normalised distribution names of a list file: whitespace-separated, `#` starts a comment."""
    return {norm(x) for line in path.read_text().splitlines() for x in line.split("#", 1)[0].split()}


def image_set(args: argparse.Namespace) -> set[str]:
    if getattr(args, "installed", False):
        from importlib import metadata

        return {norm(d.metadata["Name"]) for d in metadata.distributions() if d.metadata["Name"]}
    return image_packages(Path(args.image) if getattr(args, "image", None) else IMAGE_FILE)


def cmd_scan(args: argparse.Namespace) -> int:
    roots = list(args.root)
    if args.roots_file:
        roots += [r.split("#")[0].strip() for r in Path(args.roots_file).read_text().splitlines()]
        roots = [r for r in roots if r]
    result = scan([Path(t) for t in args.tree], roots)
    map_externals(result, image_set(args), Path(args.wheels) if args.wheels else None, args.env)
    needed = sorted(
        {e["dist"] for e in result["externals"].values() if not e["in_image"] and e["kind"] == "needed"}
    )
    result["needed_dists"] = needed
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print(f"scan: {len(result['reached'])} modules reached from {len(roots)} roots, "
          f"{len(result['core'])} through unguarded imports alone", file=sys.stderr)  # fmt: skip
    print(f"extension modules reached: {', '.join(result['extensions']) or '-'}", file=sys.stderr)
    print(f"  of which unguarded: {', '.join(result['core_extensions']) or '-'}", file=sys.stderr)
    order = {"needed": 0, "conditional": 1, "optional": 2}
    for top, e in sorted(
        result["externals"].items(), key=lambda kv: (kv[1]["in_image"], order[kv[1]["kind"]], kv[1]["dist"])
    ):
        flag = "image" if e["in_image"] else e["kind"].upper()
        guards = f" [{'; '.join(e['guards'])}]" if e["guards"] and e["kind"] == "conditional" else ""
        print(
            f"  {flag:11} {top:24} -> {e['dist']:26} ({e['mapped_by']}) via {' > '.join(e['chain'])}{guards}"
        )
    for top, p in sorted(result["packages"].items()):
        if p["chain"][0].split(".")[0] != top:
            kind = "TREE" if p["core"] else "TREE-GUARDED"
            print(f"  {kind:11} {top:24} via {' > '.join(p['chain'][:-1])}")
    for mod, m in sorted(result["missing"].items()):
        print(
            f"  ABSENT      {mod} via {' > '.join(m['chain'])}{' [if ' + m['guard'] + ']' if m['guard'] else ''}"
        )
    print(f"needed, not in the image: {' '.join(needed) or '-'}", file=sys.stderr)
    if args.fail_on_needed:
        allowed = {norm(x) for x in args.allow}
        left = [d for d in needed if d not in allowed]
        absent = [m for m, v in result["missing"].items() if not v["guard"]]
        if left or absent:
            print(f"scan: needed but not provided: {left}; absent modules: {absent}", file=sys.stderr)
            return 1
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """The `scan` subcommand, for gpu_bundle.py's command line."""
    p = sub.add_parser("scan", help="static import closure -> distributions")
    p.add_argument("--tree", action="append", required=True, help="folder holding top-level packages")
    p.add_argument("--root", action="append", default=[], help="root module (repeatable)")
    p.add_argument("--roots-file", help="file of root modules, one a line")
    p.add_argument("--wheels", help="folder of wheels: their top-level names map names to distributions")
    p.add_argument("--env", action="store_true", help="also map names with this interpreter's distributions")
    p.add_argument("--image", help=f"file listing the image's distributions (default: {IMAGE_FILE.name})")
    p.add_argument("--installed", action="store_true", help="the image is this interpreter's distributions")
    p.add_argument("--json", help="write the full result here")
    p.add_argument("--fail-on-needed", action="store_true", help="exit 1 if a needed dist is not --allow'ed")
    p.add_argument("--allow", action="append", default=[], help="distribution provided by the bundle")
    p.set_defaults(func=cmd_scan)
