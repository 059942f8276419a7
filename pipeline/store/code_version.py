"""Code versions: the hash of the code that computes a stage's output, part of its cache keys.

A stage's code version covers its import closure within its top-level package (``qerl``): the
stage's module, every project module it imports (module-level and function-level ``import`` /
``from ... import`` statements, found statically from the source), transitively, and the packages
above each (their ``__init__`` runs on import). Imports under ``if TYPE_CHECKING:`` are skipped (they
compute nothing). A string constant that is a whole dotted project name (vLLM's worker extension,
``"qerl.pipeline.rollout.aqn_vllm.AQNWorkerExtension"``, loaded by name in the engine's worker)
counts as an import. So editing the code a stage runs, its prompts, rewards or kernels, invalidates
that stage's caches, and nothing has to keep a list of them; downstream stages follow through their
input digests. A module chosen at run time from a value (the engine implementation of the configured
engine) is passed by the stage as another root.

The key changes when what a stage computes changes, and only then:

- Each module enters the hash as its *normalised source*: its syntax tree with docstrings removed,
  written back as source (``ast.unparse``). Comments, docstrings, blank lines and formatting change
  nothing; any change to a statement, a constant or a name does, with three exceptions that only
  people read (``_Messages``): the strings of ``raise`` statements (an error message; its type and
  any other argument still count), ``assert`` messages, and statements that only log or warn
  (``log.info(...)``, ``run.logger.warning(...)``, ``logging.getLogger(name).setLevel(...)``,
  ``warnings.warn(...)``) and loggers' names. A stage must not compute inside a logging call's
  arguments, and never does: what is logged is computed before.
- Packages that compute no stage output are left out below the roots (``SKIP_PACKAGES``): the
  orchestration (``qerl.flows``), the artifact store (where outputs are kept, not what they are),
  the registry (MLflow bookkeeping), the config machinery (``qerl.pipeline.config``: the values it
  validates are in the key already, as the stage's config) and the quality report's settings (the
  quantize config holds them as a section no checkpoint depends on). A stage that is itself in one of
  them (the warm-start copy in ``qerl.pipeline.registry.adapters``) is still hashed, its own module only.
- Other stage modules (``qerl.stages``) are left out too: a stage that imports another dispatches to
  it (``quantize`` to ``quantize_nf4``) or composes it, and each keys its own code. What two stages
  compute with lives in ``qerl.pipeline``, in both closures. So an edit of the NF4 quantizer keeps
  the NVFP4 checkpoint's key, and the other way round; code chosen at run time (the engine, a
  scheme's decoding module, ``qerl.pipeline.schemes``) is passed by the stage as another root.
- The installed qerl version is not hashed: a release whose computing code is unchanged keeps every
  cache. Neither are the dependencies' versions: a patch release of transformers would otherwise
  re-run GPTQ. Both are recorded in every manifest instead (``dependency_versions``), and ``qerl
  resume`` says what changed since a run's last attempt before it starts.

The walk parses each file once per process and again only when its size or mtime changes; a stage
call then costs a stat per file of its closure (``closure_cost`` measures it). ``modules_of`` gives
back the roots a version was computed from, which the manifest records so that a later qerl can tell
whether its code for that artifact changed.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.metadata
import importlib.util
import platform
import re
import time
from pathlib import Path
from types import ModuleType

from qerl.pipeline.store.manifest import ArtifactError

ROOT_PACKAGE = "qerl"
SKIP_PACKAGES = (
    "qerl.flows", "qerl.pipeline.store", "qerl.pipeline.registry", "qerl.pipeline.config", "qerl.stages",
    "qerl.pipeline.nvfp4.quality_config",
)  # fmt: skip
# what moves a stage's numbers or formats when it is upgraded: recorded beside every artifact
DEPENDENCIES = (
    "torch", "transformers", "tokenizers", "safetensors", "compressed-tensors", "vllm", "numpy", "numba",
    "triton", "math-verify", "peft", "bitsandbytes",
)  # fmt: skip
_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")
# what only logs (``_Messages``): a logger's methods, on a receiver named as loggers are here
_LOG_METHODS = frozenset(
    ("debug", "info", "warning", "warn", "error", "exception", "critical", "log", "setLevel", "disable")
)
_LOGGER_NAMES = frozenset(("log", "logger", "_log", "_logger", "LOG", "LOGGER"))

# (root, module, path) -> (size, mtime_ns, the root's modules its imports name, normalised digest)
_PARSED: dict[tuple[str, str, str], tuple[int, int, tuple[str, ...], str]] = {}
# module name -> (source file, is a package)
_FILES: dict[str, tuple[str, bool] | None] = {}
# code version -> the roots it was computed from (``modules_of``)
_ROOTS: dict[str, tuple[str, ...]] = {}


def package_version() -> str:
    try:
        return importlib.metadata.version("qerl")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def installed_versions(names: tuple[str, ...]) -> dict[str, str | None]:
    """Each distribution's installed version (None: not installed)."""
    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


@functools.cache
def dependency_versions() -> dict[str, str]:
    """qerl's, Python's and the installed ``DEPENDENCIES``' versions (those not installed left out)."""
    found = {k: v for k, v in installed_versions(DEPENDENCIES).items() if v is not None}
    return {"qerl": package_version(), "python": platform.python_version(), **found}


def _module_file(name: str) -> tuple[str, bool] | None:
    """(source file, is a package) of module ``name``; None if it is no module (an attribute).

    Only a name whose parent is a package is looked up, so no module is imported to find an attribute
    (``find_spec`` imports the parent package, whose ``__init__`` is in the closure anyway)."""
    if name not in _FILES:
        parent = name.rpartition(".")[0]
        above = _module_file(parent) if parent else None
        if parent and (above is None or not above[1]):
            _FILES[name] = None
            return None
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        origin = spec.origin if spec is not None else None
        ok = origin is not None and origin.endswith(".py")
        _FILES[name] = (origin, spec.submodule_search_locations is not None) if ok else None
    return _FILES[name]


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_names(tree: ast.AST, module: str, is_package: bool, root: str) -> set[str]:
    """Every dotted name an import statement of ``module`` may load (``from a import b``: a and a.b)."""
    names: set[str] = set()
    here = module if is_package else module.rpartition(".")[0]
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                base = ".".join([*parent, base] if base else parent)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names if alias.name != "*")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _DOTTED.fullmatch(node.value):
            parts = node.value.split(".")  # a module loaded by name, maybe with an attribute after it
            names.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
        stack.extend(ast.iter_child_nodes(node))
    return {n for n in names if n == root or n.startswith(root + ".")}


def _without_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                if isinstance(body[0].value.value, str):
                    node.body = body[1:] or [ast.Pass()]
    return tree


def _root_name(node: ast.AST) -> str | None:
    """The name a call chain starts from (``logging`` for ``logging.getLogger(x).setLevel``)."""
    while isinstance(node, ast.Attribute | ast.Call | ast.Subscript):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _is_logging(call: ast.AST) -> bool:
    """A call that only logs or warns: ``log.info(...)``, ``self.logger.warning(...)``,
    ``logging.getLogger(name).setLevel(...)``, ``warnings.warn(...)``."""
    if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Attribute):
        return False
    receiver, method = call.func.value, call.func.attr
    if _root_name(call.func) in ("logging", "warnings") and (method in _LOG_METHODS or method == "warn"):
        return True
    name = receiver.attr if isinstance(receiver, ast.Attribute) else getattr(receiver, "id", None)
    return name in _LOGGER_NAMES and method in _LOG_METHODS


class _Blank(ast.NodeTransformer):
    """Every string of a subtree blanked, f-strings whole (what they compute is only shown)."""

    def visit_Constant(self, node: ast.Constant) -> ast.AST:
        return ast.Constant("") if isinstance(node.value, str) else node

    def visit_JoinedStr(self, node: ast.JoinedStr) -> ast.AST:
        return ast.Constant("")


class _Messages(ast.NodeTransformer):
    """Blank what people read and no output holds: the text of ``raise`` and ``assert`` statements,
    logger names, and statements that only log or warn (module docstring)."""

    def visit_Raise(self, node: ast.Raise) -> ast.AST:
        node.exc, node.cause = (None if n is None else _Blank().visit(n) for n in (node.exc, node.cause))
        return node

    def visit_Assert(self, node: ast.Assert) -> ast.AST:
        node.msg = None
        return self.generic_visit(node)

    def visit_Expr(self, node: ast.Expr) -> ast.AST | None:
        # dropped, not replaced: a log line added or removed leaves the same text (only hashed, never run)
        return None if _is_logging(node.value) else self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> ast.AST:
        if isinstance(node.func, ast.Attribute) and node.func.attr == "getLogger":
            node.args = [ast.Constant("") for _ in node.args]
        return self.generic_visit(node)


def _parsed(name: str, path: str, is_package: bool, root: str) -> tuple[tuple[str, ...], str]:
    """(the root's modules the file's imports name, the digest of its normalised source)."""
    stat = Path(path).stat()
    hit = _PARSED.get((root, name, path))
    if hit is not None and hit[:2] == (stat.st_size, stat.st_mtime_ns):
        return hit[2], hit[3]
    tree = ast.parse(Path(path).read_bytes(), filename=path)
    found = tuple(sorted(_import_names(tree, name, is_package, root)))
    normalised = ast.unparse(_Messages().visit(_without_docstrings(tree)))
    digest = hashlib.sha256(normalised.encode()).hexdigest()
    _PARSED[(root, name, path)] = (stat.st_size, stat.st_mtime_ns, found, digest)
    return found, digest


def module_closure(
    *roots: str, root: str = ROOT_PACKAGE, skip: tuple[str, ...] = SKIP_PACKAGES
) -> dict[str, tuple[str, bool]]:
    """Module name -> (source file, is a package) for the modules ``roots`` import within ``root``,
    transitively, with the packages above each; ``skip``'s packages (and below) are left out, except
    a root itself (which is then hashed alone: what it imports from its own package is skipped too)."""
    out: dict[str, tuple[str, bool]] = {}
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in out or (name not in roots and any(name == s or name.startswith(s + ".") for s in skip)):
            continue
        found = _module_file(name)
        if found is None:
            continue
        out[name] = found
        parts = name.split(".")
        todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))
        todo.extend(_parsed(name, found[0], found[1], root)[0])
    return out


def _relative_path(name: str, is_package: bool) -> str:
    return name.replace(".", "/") + ("/__init__.py" if is_package else ".py")


def _module_name(module: ModuleType | str) -> str:
    name = module.__name__ if isinstance(module, ModuleType) else module
    source = getattr(module, "__file__", None) or ""
    if _module_file(name) is None and source.endswith(".py"):  # e.g. a test's module, run as __main__
        _FILES[name] = (source, hasattr(module, "__path__"))
    if _module_file(name) is None:
        raise ArtifactError(f"module {name} has no Python source file to hash")
    return name


def code_version(*modules: ModuleType | str | Path, root: str = ROOT_PACKAGE) -> str:
    """Hash of the normalised source of the import closure of ``modules`` (modules or dotted names;
    see the module docstring). A ``Path`` is a single file, hashed alone as its bytes."""
    digest = hashlib.sha256()
    names = [_module_name(m) for m in modules if not isinstance(m, Path)]
    closure = module_closure(*names, root=root)
    parts = {_relative_path(n, pkg): _parsed(n, path, pkg, root)[1] for n, (path, pkg) in closure.items()}
    parts.update({m.name: hashlib.sha256(m.read_bytes()).hexdigest() for m in modules if isinstance(m, Path)})
    for rel in sorted(parts):
        digest.update(f"{rel}\0{parts[rel]}\0".encode())
    version = digest.hexdigest()[:16]
    _ROOTS[version] = tuple(names)
    return version


def modules_of(version: str) -> tuple[str, ...]:
    """The module roots ``code_version`` hashed into ``version`` in this process (empty if none did)."""
    return _ROOTS.get(version, ())


def closure_cost(module: ModuleType | str, repeat: int = 5) -> dict[str, float]:
    """How long ``code_version(module)`` takes: the first call in this process (parsing) and the
    mean of ``repeat`` later calls (stat + read + hash), in seconds, and the closure's size."""
    _PARSED.clear()
    _FILES.clear()
    t0 = time.perf_counter()
    code_version(module)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(repeat):
        code_version(module)
    files = module_closure(_module_name(module))
    return {
        "first_s": first,
        "cached_s": (time.perf_counter() - t0) / repeat,
        "modules": float(len(files)),
        "bytes": float(sum(Path(p).stat().st_size for p, _ in files.values())),
    }
