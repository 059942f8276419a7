#!/usr/bin/env python3
"""What building the CPU replica of the GPU image computes (tools/gpu_transfer/gpu_replica.sh); standard library.

``needs``: the replica's requirements. ``tools/gpu_transfer/gpu_replica_requirements.txt`` names the image's
packages that vLLM and qerl read; the bundles were also built to find some of the image's
distributions there (the vLLM scan's ``image_dists_used``, the run bundle's ``left_out.image``), and
the replica gets those too, so that it lacks nothing the image has that a bundle relies on.

``stub``: a ``libcuda.so.1`` for a machine with no GPU.

vLLM's CUDA extensions link the CUDA driver library directly (``_C_stable_libtorch`` names
``cuGetProcAddress_v2``, ``cuPointerGetAttribute`` and ``cuTensorMapEncodeTiled`` in vLLM 0.26), so
without one they do not load and nothing of vLLM's CUDA platform imports. The stub defines every
driver entry point that the shared objects of a tree link (``cu`` and a capital: the runtime's
``cuda*`` come from the CUDA runtime library) and ``cuInit``, and each answers CUDA_ERROR_NO_DEVICE:
the extensions load, and any call into the driver fails as it would on a machine without a device.

Usage: python3 tools/gpu_transfer/gpu_replica_build.py needs --out FILE        (the requirement lines)
       python3 tools/gpu_transfer/gpu_replica_build.py stub --site TREE --out DIR  (DIR/libcuda.so.1; needs cc, nm)
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NO_DEVICE = 100  # CUDA_ERROR_NO_DEVICE


def image_needs(requirements: Path, manifests: list[Path]) -> list[str]:
    """The replica's requirement lines: ``requirements`` (the image's packages that vLLM and qerl read,
    at the image's versions where known), then the image's distributions the bundles were built to
    find there and that it does not name: the vLLM scan's ``image_dists_used`` (names) and the run
    bundle's ``left_out.image`` (the versions its resolution chose, as the image's are not known)."""
    import json

    from gpu_imports import norm

    lines = [ln.split("#", 1)[0].strip() for ln in requirements.read_text().splitlines()]
    lines = [ln for ln in lines if ln]
    named = {norm(re.match(r"[A-Za-z0-9_.-]+", ln).group(0)) for ln in lines}
    for path in manifests:
        manifest = json.loads(path.read_text())
        extra = manifest.get("scan", {}).get("image_dists_used", [])
        extra += manifest.get("left_out", {}).get("image", [])
        for spec in extra:
            name = norm(re.match(r"[A-Za-z0-9_.-]+", spec).group(0))
            if name not in named:
                named.add(name)
                lines.append(spec)
    return lines


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
    sub = parser.add_subparsers(dest="cmd", required=True)
    needs = sub.add_parser("needs", help="write the replica's requirement lines")
    needs.add_argument("--out", type=Path, required=True)
    stub = sub.add_parser("stub", help="build the stub driver for the shared objects under --site")
    stub.add_argument("--site", type=Path, required=True, help="the tree whose shared objects it serves")
    stub.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.cmd == "needs":
        manifests = [ROOT / f".gpu-{b}/manifest.json" for b in ("vllm", "run")]
        lines = image_needs(
            ROOT / "tools/gpu_transfer/gpu_replica_requirements.txt", [m for m in manifests if m.exists()]
        )
        args.out.write_text("\n".join(lines) + "\n")
        return 0
    print(f"stub driver: {build_stub(args.site, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
