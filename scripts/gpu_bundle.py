#!/usr/bin/env python3
"""Carry a trimmed vLLM to the GPU machine in pieces. Standard library only: it runs here
(Python 3.11, the project's venv) and on the GPU image (Python 3.12, nothing installed for it).

Subcommands:
  scan      the static import closure of a source tree: from root modules, follow the imports that run
            at import time (module level, class bodies, `if`/`try`/`with` blocks; not function bodies,
            not `if TYPE_CHECKING:`), resolve relative imports, and report the top-level names that
            the tree does not hold, mapped to distributions, minus the standard library and minus the
            GPU image's packages. Also the modules of the tree that are imported but absent (a dropped
            file that is still needed shows up here).
  unwheel   unpack wheels into a staging folder the way an installer lays them out (purelib/platlib
            data folders merged, scripts and headers left out), with their .dist-info.
  drop      delete files matching globs (one per line in a file, `#` comments) from a staged tree.
  pack      tar the staged tree, compress it with xz (tarfile + lzma), split it into numbered chunks
            of at most --chunk-mib, and write manifest.json (chunks with size and sha256, the whole
            archive's size and sha256, and whatever --meta JSON files add).
  verify    check the chunks of a folder against its manifest: names the missing and the corrupt.
  stage     move carried chunks (and the manifest) into a kept folder; print what is staged and what
            is still missing (the chunks the next device calls must carry).
  unpack    verify, reassemble, check the whole archive's sum, and extract (data filter: no absolute
            paths, links out of the tree or device files) into a target folder.

Exit status of verify/stage/unpack: 0 complete and sound, 3 chunks missing, 4 a chunk or the archive
corrupt, 2 usage or manifest errors.
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import hashlib
import io
import json
import lzma
import os
import re
import shutil
import sys
import tarfile
import time
import zipfile
from collections import deque
from collections.abc import Callable
from pathlib import Path

MiB = 2**20
MANIFEST = "manifest.json"
ARCHIVE = "bundle.tar.xz"
CHUNK_RE = re.compile(r"^part-(\d{2,})$")
EXIT_MISSING, EXIT_CORRUPT, EXIT_USAGE = 3, 4, 2

# The GPU image's Python distributions ('cuda' image, as listed in the device notes, read 2026-11-17).
# `scan --installed` uses the running interpreter's distributions instead (run it on the GPU image).
IMAGE_PACKAGES = """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings
cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils
execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet
httpcore httpx humanize huggingface-hub hypothesis idna imageio iniconfig interface-meta jax
jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning
lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib
mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc
nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver
nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13
nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx
optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing
pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout
pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools
shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch
torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer
typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split()

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


def human(n: float) -> str:
    return f"{n / MiB:.2f} MiB"


def sha256_file(path: Path, bufsize: int = 4 * MiB) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(bufsize):
            h.update(chunk)
    return h.hexdigest()


# -- the import scan ---------------------------------------------------------------------------------

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


def scan(trees: list[Path], roots: list[str]) -> dict:
    """Import closure from the roots over the trees' modules, twice: following every import that runs
    at import time (`reached`), and following only unguarded ones (`core`: what is certainly imported).
    Each external top-level name is classed: "needed" (an unguarded import in a core module),
    "conditional" (under a module-level `if`, or only in modules reached through one: the condition is
    reported, a person decides), "optional" (only inside try/except ImportError)."""
    index = index_tree(trees)
    stdlib = _stdlib()
    tree_tops = {name.split(".")[0] for name in index}
    edges: dict[str, list[tuple[str, list[str], str]]] = {}

    def closure(plain_only: bool) -> tuple[dict[str, str | None], dict[str, tuple[str, str]]]:
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
                if plain_only and guard:
                    continue
                if base.split(".")[0] not in tree_tops:
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

    core, _ = closure(plain_only=True)
    parent, missing = closure(plain_only=False)

    def chain(mod: str) -> list[str]:
        out = [mod]
        while (p := parent.get(out[-1])) is not None:
            out.append(p)
        return out[::-1]

    externals = _classify_externals(parent, core, edges, tree_tops, stdlib, chain)
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


def image_set(args: argparse.Namespace) -> set[str]:
    if getattr(args, "installed", False):
        from importlib import metadata

        return {norm(d.metadata["Name"]) for d in metadata.distributions() if d.metadata["Name"]}
    if getattr(args, "image", None):
        return {norm(x) for x in Path(args.image).read_text().split() if not x.startswith("#")}
    return {norm(x) for x in IMAGE_PACKAGES}


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


# -- staging -------------------------------------------------------------------------------------------


def unwheel(wheels: list[Path], dest: Path) -> list[dict]:
    """Unpack wheels like an installer into dest; returns [{dist, version, wheel}]."""
    dest.mkdir(parents=True, exist_ok=True)
    rows = []
    for whl in wheels:
        name, version = whl.name.split("-")[:2]
        with zipfile.ZipFile(whl) as zf:
            for info in zf.infolist():
                parts = info.filename.split("/")
                if parts[0].endswith(".data"):
                    if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                        continue  # scripts, headers, data: not needed for imports
                    parts = parts[2:]
                if info.is_dir() or ".." in parts or info.filename.startswith("/"):
                    continue
                target = dest.joinpath(*parts)
                target.parent.mkdir(parents=True, exist_ok=True)
                with zf.open(info) as src, open(target, "wb") as out:
                    shutil.copyfileobj(src, out, 4 * MiB)
                mode = (info.external_attr >> 16) & 0o777
                if mode:
                    os.chmod(target, mode | 0o600)
        rows.append({"dist": norm(name), "version": version, "wheel": whl.name})
    return rows


def read_list(path: Path) -> list[str]:
    """Lines of a list file, with `#` comments and blanks removed."""
    out = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            out.append(line)
    return out


def drop(tree: Path, patterns: list[str]) -> list[dict]:
    """Delete the files of tree whose relative path matches a glob; returns [{path, bytes}]."""
    dropped = []
    for path in sorted(p for p in tree.rglob("*") if p.is_file() or p.is_symlink()):
        rel = path.relative_to(tree).as_posix()
        if any(fnmatch.fnmatchcase(rel, pat) for pat in patterns):
            dropped.append({"path": rel, "bytes": path.lstat().st_size})
            path.unlink()
    for d in sorted((p for p in tree.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        if not any(d.iterdir()):
            d.rmdir()
    return dropped


def cmd_unwheel(args: argparse.Namespace) -> int:
    rows = unwheel([Path(w) for w in args.wheels], Path(args.dest))
    for r in rows:
        print(f"  {r['dist']} {r['version']}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


def cmd_drop(args: argparse.Namespace) -> int:
    patterns = read_list(Path(args.list))
    dropped = drop(Path(args.tree), patterns)
    unused = [p for p in patterns if not any(fnmatch.fnmatchcase(d["path"], p) for d in dropped)]
    total = sum(d["bytes"] for d in dropped)
    print(f"drop: {len(dropped)} files, {human(total)}", file=sys.stderr)
    if unused:
        print(f"drop: patterns that matched nothing: {unused}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps({"patterns": patterns, "files": dropped}, indent=1) + "\n")
    return 1 if unused and args.strict else 0


# -- pack / split / verify / unpack --------------------------------------------------------------------


def _tar_filter(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mtime = 0  # the same tree gives the same archive
    return None if "__pycache__" in info.name.split("/") else info


def pack(src: Path, out: Path, chunk_bytes: int, preset: int, meta: dict | None = None) -> dict:
    """tar.xz the tree's contents (sorted, normalised owners and times), split it, write the manifest."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.iterdir():
        if CHUNK_RE.match(old.name) or old.name in (MANIFEST, ARCHIVE):
            old.unlink()
    archive = out / ARCHIVE
    t0 = time.perf_counter()
    raw = 0
    with (
        lzma.open(archive, "wb", preset=preset) as xz,
        tarfile.open(fileobj=xz, mode="w", format=tarfile.PAX_FORMAT) as tar,
    ):
        for path in sorted(src.rglob("*")):
            if path.is_dir() and not path.is_symlink():
                continue
            rel = path.relative_to(src).as_posix()
            if "__pycache__" in rel.split("/"):
                continue
            raw += path.lstat().st_size
            tar.add(path, arcname=rel, recursive=False, filter=_tar_filter)
    seconds = time.perf_counter() - t0
    size = archive.stat().st_size
    chunks = []
    with open(archive, "rb") as f:
        k = 0
        while data := f.read(chunk_bytes):
            k += 1
            name = f"part-{k:02d}"
            (out / name).write_bytes(data)
            chunks.append({"name": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    manifest = {
        "format": "qerl-gpu-bundle/1",
        "archive": {"name": ARCHIVE, "bytes": size, "sha256": sha256_file(archive), "compression": f"xz preset {preset}",
                    "uncompressed_tar_payload_bytes": raw, "compress_seconds": round(seconds, 1)},
        "chunk_bytes": chunk_bytes,
        "chunks": chunks,
        **(meta or {}),
    }  # fmt: skip
    archive.unlink()  # the chunks are the archive; unpack reassembles it
    tmp = out / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, out / MANIFEST)
    return manifest


def load_manifest(folder: Path) -> dict:
    path = folder / MANIFEST
    if not path.is_file():
        raise SystemExit(f"gpu_bundle: no {MANIFEST} in {folder} (carry it with every chunk)")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != "qerl-gpu-bundle/1":
        raise SystemExit(f"gpu_bundle: {path} is not a qerl-gpu-bundle/1 manifest")
    return manifest


def verify(folder: Path, manifest: dict) -> tuple[list[str], list[str]]:
    """(missing, corrupt) chunk names: absent, or of the wrong size or sha256."""
    missing, corrupt = [], []
    for c in manifest["chunks"]:
        path = folder / c["name"]
        if not path.is_file():
            missing.append(c["name"])
        elif path.stat().st_size != c["bytes"] or sha256_file(path) != c["sha256"]:
            corrupt.append(c["name"])
    return missing, corrupt


def report(folder: Path, manifest: dict, missing: list[str], corrupt: list[str]) -> int:
    n = len(manifest["chunks"])
    for name in corrupt:
        c = next(c for c in manifest["chunks"] if c["name"] == name)
        print(f"gpu_bundle: CORRUPT chunk {folder / name}: size or sha256 differs from the manifest "
              f"({c['bytes']} bytes, sha256 {c['sha256'][:16]}...): carry it again", file=sys.stderr)  # fmt: skip
    if missing:
        print(
            f"gpu_bundle: MISSING {len(missing)} of {n} chunks in {folder}: {' '.join(missing)}",
            file=sys.stderr,
        )
        print(
            "gpu_bundle: carry next: "
            + json.dumps([f".gpu-vllm/{m}" for m in missing[:1]] + [f".gpu-vllm/{MANIFEST}"]),
            file=sys.stderr,
        )
    if corrupt:
        return EXIT_CORRUPT
    if missing:
        return EXIT_MISSING
    print(f"gpu_bundle: all {n} chunks present and sound in {folder}", file=sys.stderr)
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    folder = Path(args.dir)
    manifest = load_manifest(folder)
    return report(folder, manifest, *verify(folder, manifest))


def cmd_stage(args: argparse.Namespace) -> int:
    """Move carried chunks from --from into the kept folder --to (a sound chunk replaces nothing that
    is already sound; a corrupt carried chunk is named and left where it is)."""
    src, dst = Path(args.src), Path(args.to)
    dst.mkdir(parents=True, exist_ok=True)
    if (src / MANIFEST).is_file():
        new = load_manifest(src)
        if (dst / MANIFEST).is_file() and load_manifest(dst)["archive"]["sha256"] != new["archive"]["sha256"]:
            print(
                "gpu_bundle: the carried manifest is for another bundle: dropping the staged chunks",
                file=sys.stderr,
            )
            for old in dst.iterdir():
                if CHUNK_RE.match(old.name):
                    old.unlink()
        shutil.copyfile(src / MANIFEST, dst / MANIFEST)
    manifest = load_manifest(dst)
    by_name = {c["name"]: c for c in manifest["chunks"]}
    moved, bad = [], []
    for path in sorted(src.glob("part-*")) if src.is_dir() else []:
        c = by_name.get(path.name)
        if c and path.stat().st_size == c["bytes"] and sha256_file(path) == c["sha256"]:
            shutil.move(str(path), str(dst / path.name))
            moved.append(path.name)
        else:
            bad.append(path.name)
    if moved:
        print(f"gpu_bundle: staged {' '.join(moved)} into {dst}", file=sys.stderr)
    for name in bad:
        print(f"gpu_bundle: CORRUPT carried chunk {src / name} (not staged): carry it again", file=sys.stderr)
    missing, corrupt = verify(dst, manifest)
    have = [c["name"] for c in manifest["chunks"] if c["name"] not in missing and c["name"] not in corrupt]
    print(f"gpu_bundle: staged so far: {' '.join(have) or 'none'}", file=sys.stderr)
    rc = report(dst, manifest, missing, corrupt)
    return EXIT_CORRUPT if bad else rc


def cmd_unpack(args: argparse.Namespace) -> int:
    folder, dest = Path(args.dir), Path(args.dest)
    manifest = load_manifest(folder)
    stamp = dest / ".bundle-sha256"
    if stamp.is_file() and stamp.read_text().strip() == manifest["archive"]["sha256"] and not args.force:
        print(f"gpu_bundle: {dest} already holds this bundle", file=sys.stderr)
        return 0
    rc = report(folder, manifest, *verify(folder, manifest))
    if rc:
        return rc
    t0 = time.perf_counter()
    h = hashlib.sha256()
    buf = io.BytesIO()
    for c in manifest["chunks"]:
        data = (folder / c["name"]).read_bytes()
        h.update(data)
        buf.write(data)
    if h.hexdigest() != manifest["archive"]["sha256"] or buf.tell() != manifest["archive"]["bytes"]:
        print("gpu_bundle: CORRUPT archive: the reassembled chunks do not give the manifest's sha256 "
              "(the manifest and the chunks come from different builds?)", file=sys.stderr)  # fmt: skip
        return EXIT_CORRUPT
    if dest.exists():
        shutil.rmtree(dest)
    tmp = dest.with_name(dest.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    buf.seek(0)
    with lzma.open(buf) as xz, tarfile.open(fileobj=xz, mode="r|") as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(tmp, filter="data")
        else:  # Python < 3.11.4: refuse absolute or escaping names ourselves
            for member in tar:
                if (
                    member.name.startswith("/")
                    or ".." in member.name.split("/")
                    or not (member.isfile() or member.isdir())
                ):
                    raise SystemExit(f"gpu_bundle: unsafe member {member.name!r}")
                tar.extract(member, tmp)
    (tmp / ".bundle-sha256").write_text(manifest["archive"]["sha256"] + "\n")
    os.replace(tmp, dest)
    print(f"gpu_bundle: extracted {human(manifest['archive']['bytes'])} into {dest} in "
          f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)  # fmt: skip
    return 0


def cmd_pack(args: argparse.Namespace) -> int:
    meta: dict = {}
    for item in args.meta or []:
        key, _, path = item.partition("=")
        meta[key] = json.loads(Path(path).read_text())
    for item in args.set or []:
        key, _, value = item.partition("=")
        meta[key] = value
    if args.chunk_mib > 60:
        print(
            "gpu_bundle: chunks over 60 MiB leave no room for the working tree in a 64 MiB call",
            file=sys.stderr,
        )
        return EXIT_USAGE
    m = pack(Path(args.src), Path(args.out), int(args.chunk_mib * MiB), args.preset, meta)
    a = m["archive"]
    print(f"gpu_bundle: {human(a['uncompressed_tar_payload_bytes'])} -> {human(a['bytes'])} ({a['compression']}, "
          f"{a['compress_seconds']} s) in {len(m['chunks'])} chunks: "
          + ", ".join(f"{c['name']} {human(c['bytes'])}" for c in m["chunks"]), file=sys.stderr)  # fmt: skip
    return 0


def parse_requirements(path: Path) -> list[dict]:
    """`name==version  # reason` lines -> [{dist, version, reason}] (only exact pins are accepted)."""
    rows = []
    for line in path.read_text().splitlines():
        spec, _, reason = line.partition("#")
        spec = spec.strip()
        if not spec:
            continue
        name, sep, version = spec.partition("==")
        if not sep or not version.strip():
            raise SystemExit(f"gpu_bundle: {path}: '{spec}' is not an exact pin (name==version)")
        rows.append({"dist": norm(name.strip()), "version": version.strip(), "reason": reason.strip()})
    return rows


def match_wheels(reqs: list[dict], wheel_dir: Path) -> list[Path]:
    """The one wheel of each pinned requirement in wheel_dir (others there are ignored)."""
    by_key: dict[tuple[str, str], list[Path]] = {}
    for whl in wheel_dir.glob("*.whl"):
        name, version = whl.name.split("-")[:2]
        by_key.setdefault((norm(name), version), []).append(whl)
    out, problems = [], []
    for r in reqs:
        found = by_key.get((r["dist"], r["version"]), [])
        if len(found) != 1:
            problems.append(f"{r['dist']}=={r['version']}: {len(found)} wheels in {wheel_dir}")
        else:
            out.append(found[0])
    if problems:
        raise SystemExit("gpu_bundle: " + "; ".join(problems))
    return out


def cmd_build(args: argparse.Namespace) -> int:
    """unwheel + drop + scan check + pack, with everything the manifest records."""
    reqs = parse_requirements(Path(args.requirements))
    wheels = match_wheels(reqs, Path(args.wheels))
    image = {norm(x) for x in IMAGE_PACKAGES}
    clash = [r["dist"] for r in reqs if r["dist"] in image]
    if clash and not args.allow_image_dists:
        raise SystemExit(f"gpu_bundle: {clash} are in the GPU image: carrying them would shadow the image's "
                         "(vLLM must use the image's torch and friends)")  # fmt: skip
    stage = Path(args.stage)
    if stage.exists():
        shutil.rmtree(stage)
    t0 = time.perf_counter()
    rows = unwheel(wheels, stage)
    patterns = read_list(Path(args.drop))
    dropped = drop(stage, patterns)
    unused = [p for p in patterns if not any(fnmatch.fnmatchcase(d["path"], p) for d in dropped)]
    if unused:
        raise SystemExit(f"gpu_bundle: drop patterns that matched nothing (a changed vLLM?): {unused}")
    roots = read_list(Path(args.roots))
    result = scan([stage], roots)
    map_externals(result, image, Path(args.wheels), False)
    needed = sorted(
        {e["dist"] for e in result["externals"].values() if not e["in_image"] and e["kind"] == "needed"}
    )
    absent = sorted(m for m, v in result["missing"].items() if not v["guard"])
    if needed or absent:
        raise SystemExit(
            f"gpu_bundle: the staged tree is not closed: needed {needed}, absent modules {absent}"
        )
    top_to_dist = dist_map_from_wheels(Path(args.wheels))
    reached_dists = {top_to_dist.get(top, norm(top)) for top in result["packages"]}
    unreached = sorted(r["dist"] for r in reqs if r["dist"] not in reached_dists)
    print(f"gpu_bundle: staged {len(rows)} wheels in {time.perf_counter() - t0:.0f} s; "
          f"dropped {len(dropped)} files, {human(sum(d['bytes'] for d in dropped))}", file=sys.stderr)  # fmt: skip
    reasons = {r["dist"]: r["reason"] for r in reqs}
    meta = {
        "vllm_version": next((r["version"] for r in rows if r["dist"] == "vllm"), None),
        "python": args.python,
        "dependencies": [{**r, "reason": reasons.get(r["dist"], "")} for r in rows],
        "not_reached_at_import": unreached,
        "dropped": {"patterns": patterns, "bytes": sum(d["bytes"] for d in dropped), "files": dropped},
        "scan": {
            "roots": roots,
            "modules_reached": len(result["reached"]),
            "extensions_unguarded": result["core_extensions"],
            "extensions_reached": result["extensions"],
            "image_dists_used": sorted({e["dist"] for e in result["externals"].values() if e["in_image"]}),
            "conditional": {
                k: e["guards"] for k, e in result["externals"].items() if e["kind"] == "conditional"
            },
        },
        "built_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    m = pack(stage, Path(args.out), int(args.chunk_mib * MiB), args.preset, meta)
    a = m["archive"]
    print(f"gpu_bundle: {human(a['uncompressed_tar_payload_bytes'])} -> {human(a['bytes'])} ({a['compression']}, "
          f"{a['compress_seconds']} s) in {len(m['chunks'])} chunks: "
          + ", ".join(f"{c['name']} {human(c['bytes'])}" for c in m["chunks"]), file=sys.stderr)  # fmt: skip
    if not args.keep_stage:
        shutil.rmtree(stage)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("scan", help="static import closure -> distributions")
    p.add_argument("--tree", action="append", required=True, help="folder holding top-level packages")
    p.add_argument("--root", action="append", default=[], help="root module (repeatable)")
    p.add_argument("--roots-file", help="file of root modules, one a line")
    p.add_argument("--wheels", help="folder of wheels: their top-level names map names to distributions")
    p.add_argument("--env", action="store_true", help="also map names with this interpreter's distributions")
    p.add_argument("--image", help="file listing the image's distributions (default: the built-in list)")
    p.add_argument("--installed", action="store_true", help="the image is this interpreter's distributions")
    p.add_argument("--json", help="write the full result here")
    p.add_argument("--fail-on-needed", action="store_true", help="exit 1 if a needed dist is not --allow'ed")
    p.add_argument("--allow", action="append", default=[], help="distribution provided by the bundle")
    p.set_defaults(func=cmd_scan)
    p = sub.add_parser("unwheel", help="unpack wheels into a staging folder")
    p.add_argument("--dest", required=True)
    p.add_argument("--json")
    p.add_argument("wheels", nargs="+")
    p.set_defaults(func=cmd_unwheel)
    p = sub.add_parser("drop", help="delete files matching the globs of a list file")
    p.add_argument("--tree", required=True)
    p.add_argument("--list", required=True)
    p.add_argument("--json")
    p.add_argument("--strict", action="store_true", help="fail when a pattern matches nothing")
    p.set_defaults(func=cmd_drop)
    p = sub.add_parser("pack", help="tar + xz + split + manifest")
    p.add_argument("--src", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--chunk-mib", type=float, default=50.0)
    p.add_argument("--preset", type=int, default=6, help="xz preset 0-9 (| 0x80000000 for extreme)")
    p.add_argument("--meta", action="append", help="KEY=FILE.json: add to the manifest")
    p.add_argument("--set", action="append", help="KEY=VALUE: add to the manifest")
    p.set_defaults(func=cmd_pack)
    for name, func in (("verify", cmd_verify),):
        p = sub.add_parser(name, help="check chunks against the manifest")
        p.add_argument("--dir", required=True)
        p.set_defaults(func=func)
    p = sub.add_parser(
        "build", help="unwheel + drop + scan check + pack (what fetch_gpu_wheels.sh --vllm runs)"
    )
    p.add_argument("--wheels", required=True, help="folder holding the pinned wheels")
    p.add_argument("--requirements", required=True, help="name==version  # reason lines")
    p.add_argument("--drop", required=True, help="globs of files to leave out")
    p.add_argument("--roots", required=True, help="root modules of the import scan")
    p.add_argument("--stage", required=True, help="staging folder (emptied first)")
    p.add_argument("--out", required=True, help="chunks and manifest.json go here")
    p.add_argument("--chunk-mib", type=float, default=50.0)
    p.add_argument("--preset", type=int, default=6)
    p.add_argument("--python", default="3.12")
    p.add_argument("--keep-stage", action="store_true")
    p.add_argument("--allow-image-dists", action="store_true")
    p.set_defaults(func=cmd_build)
    p = sub.add_parser("stage", help="move carried chunks into a kept folder")
    p.add_argument("--from", dest="src", required=True)
    p.add_argument("--to", required=True)
    p.set_defaults(func=cmd_stage)
    p = sub.add_parser("unpack", help="verify, reassemble and extract")
    p.add_argument("--dir", required=True)
    p.add_argument("--dest", required=True)
    p.add_argument("--force", action="store_true")
    p.set_defaults(func=cmd_unpack)
    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
