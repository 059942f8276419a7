#!/usr/bin/env python3
"""Import every root module of a bundle's import scan in one process, and say which fail and why.

gpu_offline.sh runs this right after it extracts the vLLM bundle (seconds). The static scan
(gpu_imports.py) cannot see every import a module runs when imported, and an engine start stops at
the first one it misses, so each missing module would cost a lease's try. Importing each root on its
own, failures caught, shows every one in a single call. Standard library only.

Usage: gpu_import_roots.py ROOTS_FILE    (one module a line, `#` comments; exit 1 if any fails)
"""

from __future__ import annotations

import importlib
import sys
import time
import traceback
from pathlib import Path

from gpu_bundle import read_list


def import_each(roots: list[str]) -> dict[str, str]:
    """root -> "" when it imports, else the exception's last line (type and message)."""
    result = {}
    for name in roots:
        try:
            importlib.import_module(name)
            result[name] = ""
        except BaseException as exc:  # noqa: BLE001 - a SystemExit or a C-extension error is a finding too
            if isinstance(exc, KeyboardInterrupt):
                raise
            result[name] = traceback.format_exception_only(type(exc), exc)[-1].strip()
    return result


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    roots = read_list(Path(argv[0]))
    t0 = time.perf_counter()
    result = import_each(roots)
    failed = {k: v for k, v in result.items() if v}
    print(
        f"imports: {len(roots) - len(failed)} of {len(roots)} roots import ({time.perf_counter() - t0:.1f} s)"
    )
    for name, error in failed.items():
        print(f"  {name}: {error}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
