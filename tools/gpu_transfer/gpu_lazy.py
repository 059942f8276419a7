#!/usr/bin/env python3
"""Lazily loaded modules that a module still needs at import time, and the patch that defers them.

vLLM binds optional dependencies lazily (``llguidance = LazyLoader("llguidance", globals(),
"llguidance")``, under the ``else`` of ``if TYPE_CHECKING``), so an import scan that follows import
statements only sees no need for them. But Python 3.12 evaluates some expressions when the module is
imported: class-body and module-level annotations and function signatures' annotations (unless the
module has ``from __future__ import annotations``), decorators, base classes, default values and
module-level statements. ``ll_matcher: llguidance.LLMatcher`` in a class body then loads llguidance
at ``import vllm.v1.structured_output``, which the offline engine imports unconditionally, so an
import scan that misses it sends a bundle that fails on the GPU (``No module named 'llguidance'``).

``eager_lazy_modules`` finds such uses, so the scan counts them as unguarded imports. Where every use
is an annotation, ``defer_annotations`` adds ``from __future__ import annotations`` to the module
(PEP 563: annotations are kept as strings), which removes the need without carrying the package; a
real use of the package (guided decoding, which qerl never asks for) still imports it, and fails
loudly if it is absent. Standard library only.
"""

from __future__ import annotations

import ast
from pathlib import Path

FUTURE_LINE = (
    "from __future__ import annotations  # qerl GPU bundle: deferred (tools/gpu_transfer/gpu_lazy.py)\n"
)


def defers_annotations(tree: ast.Module) -> bool:
    return any(
        isinstance(n, ast.ImportFrom)
        and n.module == "__future__"
        and any(a.name == "annotations" for a in n.names)
        for n in tree.body
    )


def _lazy_bindings(tree: ast.Module) -> dict[str, str]:
    """Module-level names bound to ``LazyLoader(local_name, globals(), "module")``: name -> module."""
    found: dict[str, str] = {}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)):
            continue
        func = node.value.func
        called = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
        args = node.value.args
        if (
            called == "LazyLoader"
            and args
            and isinstance(args[-1], ast.Constant)
            and isinstance(args[-1].value, str)
        ):
            found.update({t.id: args[-1].value for t in node.targets if isinstance(t, ast.Name)})
    return found


def _import_time_exprs(stmts: list[ast.stmt], deferred: bool) -> list[tuple[ast.AST, bool]]:
    """What runs at import: (expression, is_annotation). Not function bodies, not TYPE_CHECKING."""
    out: list[tuple[ast.AST, bool]] = []
    for node in stmts:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out += [
                (e, False) for e in [*node.decorator_list, *node.args.defaults, *node.args.kw_defaults] if e
            ]
            if not deferred:
                args = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
                args += [a for a in (node.args.vararg, node.args.kwarg) if a]
                out += [(a.annotation, True) for a in args if a.annotation]
                out += [(node.returns, True)] if node.returns else []
        elif isinstance(node, ast.ClassDef):
            out += [
                (e, False) for e in [*node.bases, *node.decorator_list, *(k.value for k in node.keywords)]
            ]
            out += _import_time_exprs(node.body, deferred)
        elif isinstance(node, ast.If):
            test = ast.unparse(node.test)
            checking = test in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
            negated = test in ("not TYPE_CHECKING", "not typing.TYPE_CHECKING")
            out += [] if checking or negated else [(node.test, False)]
            out += [] if checking else _import_time_exprs(node.body, deferred)
            out += [] if negated else _import_time_exprs(node.orelse, deferred)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                out += _import_time_exprs(block, deferred)
        elif isinstance(node, ast.AnnAssign):
            out += [(node.annotation, True)] if not deferred else []
            out += [(node.value, False)] if node.value is not None else []
        elif not isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append((node, False))
    return out


def eager_lazy_modules(tree: ast.Module) -> dict[str, bool]:
    """Modules bound lazily but used at import time: module -> True when every use is an annotation
    (what ``defer_annotations`` can remove), False when some use is a real evaluation."""
    lazy = _lazy_bindings(tree)
    if not lazy:
        return {}
    found: dict[str, bool] = {}
    for expr, is_annotation in _import_time_exprs(tree.body, defers_annotations(tree)):
        for sub in ast.walk(expr):
            if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id in lazy:
                mod = lazy[sub.value.id]
                found[mod] = found.get(mod, True) and is_annotation
    return found


def defer_annotations(path: Path) -> bool:
    """Add ``from __future__ import annotations`` to a module (after its docstring and any other
    ``__future__`` import). Returns False when it already has it; raises on a file that is not Python."""
    text = path.read_text()
    tree = ast.parse(text, filename=str(path))
    if defers_annotations(tree):
        return False
    after = 0  # the line after which the import goes: the docstring's or the last __future__ import's end
    for node in tree.body:
        docstring = (
            isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and node is tree.body[0]
        )
        if docstring or (isinstance(node, ast.ImportFrom) and node.module == "__future__"):
            after = node.end_lineno or node.lineno
        else:
            break
    lines = text.splitlines(keepends=True)
    if after and not lines[after - 1].endswith("\n"):
        lines[after - 1] += "\n"
    path.write_text("".join([*lines[:after], FUTURE_LINE, *lines[after:]]))
    return True
