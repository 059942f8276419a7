#!/usr/bin/env python3
"""A ``libcuda.so.1`` for a machine with no GPU: the CPU replica of the GPU image (scripts/gpu_replica.sh).

vLLM's CUDA extensions link the CUDA driver library directly (``_C_stable_libtorch`` names
``cuGetProcAddress_v2``, ``cuPointerGetAttribute`` and ``cuTensorMapEncodeTiled`` in vLLM 0.26), so
without one they do not load and nothing of vLLM's CUDA platform imports. The stub defines every
driver entry point that the shared objects of a tree link (``cu`` and a capital: the runtime's
``cuda*`` come from the CUDA runtime library) and ``cuInit``, and each answers CUDA_ERROR_NO_DEVICE:
the extensions load, and any call into the driver fails as it would on a machine without a device.

Usage: python3 scripts/gpu_stub_driver.py --site TREE --out DIR   (writes DIR/libcuda.so.1; needs cc, nm)
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

NO_DEVICE = 100  # CUDA_ERROR_NO_DEVICE


def driver_symbols(site: Path) -> list[str]:
    """The CUDA driver entry points (``cu*``) that the shared objects under ``site`` link directly."""
    found: set[str] = set()
    for so in sorted(site.rglob("*.so")):
        out = subprocess.run(["nm", "-D", "--undefined-only", str(so)], capture_output=True, text=True)
        found.update(m.group(1) for m in re.finditer(r"\bU (cu[A-Z]\w*)", out.stdout))
    return sorted(found)


def stub_source(symbols: list[str]) -> str:
    """C source of a ``libcuda.so.1`` that defines ``symbols`` (and ``cuInit``), each returning 100."""
    names = sorted(set(symbols) | {"cuInit"})
    lines = ["/* the replica's CUDA driver: no device, whatever is asked */"]
    lines += [f"int {name}(void) {{ return {NO_DEVICE}; }}" for name in names]
    return "\n".join(lines) + "\n"


def build_stub(site: Path, out: Path) -> Path:
    """Compile the stub for what ``site``'s shared objects link into ``out/libcuda.so.1``."""
    out.mkdir(parents=True, exist_ok=True)
    src = out / "libcuda_stub.c"
    src.write_text(stub_source(driver_symbols(site)))
    lib = out / "libcuda.so.1"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    return lib


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--site", type=Path, required=True, help="the tree whose shared objects it serves")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    print(f"stub driver: {build_stub(args.site, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
