#!/usr/bin/env bash
# Build what an offline GPU machine image needs (run on a connected machine; tools/gpu_transfer/README.md
# says how the bundles are carried, unpacked and checked). With no option: the small wheel set alone, into
# .gpu-wheels/ (git-ignored), which tools/gpu_transfer/gpu_offline.sh installs when it finds it there:
#   bash tools/gpu_transfer/fetch_gpu_wheels.sh            then carry .gpu-wheels/ with the checkout
#
# The GPU image has Python 3.12, torch (CUDA), triton, transformers, peft, safetensors, accelerate,
# numpy, pyarrow, pandas, pyyaml and numba, but no pydantic (our configs) and no pytest. Only those
# are fetched: cp312 manylinux or pure-Python wheels, no dependencies resolved (--no-deps: the list is
# the closure), at the versions of the CPU environment (requirements/cpu.txt resolves to these).
# The total stays under --max-mib, for transfers limited to 64 MiB.
#
# Options: --dest DIR (default .gpu-wheels)  --max-mib N (default 48, leaving room under 64)
#          --only NAME (repeatable: just these of the list)  --extra SPEC (repeatable: e.g.
#          --extra transformers==5.19.0 if the image's version turns out incompatible)  --list
#
# --vllm: build the vLLM bundle instead (issue 23): download the wheels pinned in
#   tools/gpu_transfer/gpu_vllm_requirements.txt (vllm 0.26.0 and the few distributions the image lacks that an
#   offline LLM(...).generate with LoRA on an NVFP4A16 checkpoint imports, each with its reason) into
#   .gpu-vllm-build/wheels (kept: a second run downloads nothing), unpack them into a staging folder,
#   delete what Hopper's dense path never loads (tools/gpu_transfer/gpu_vllm_drop.txt, each with what was
#   checked), give the modules in tools/gpu_transfer/gpu_vllm_defer_annotations.txt `from __future__ import
#   annotations` (tools/gpu_transfer/gpu_lazy.py), re-run the static import scan on the staged tree (tools/gpu_transfer/gpu_bundle.py scan, roots in
#   tools/gpu_transfer/gpu_vllm_roots.txt: it fails if a needed distribution or module is missing), then tar + xz
#   it and split it into chunks of at most 50 MiB in .gpu-vllm/ (part-01, part-02, ...) with
#   .gpu-vllm/manifest.json (each chunk's size and sha256, the archive's, the dependency list, the
#   dropped files). The chunks can travel one at a time: see tools/gpu_transfer/README.md.
#   Options with --vllm: --vllm-dest DIR (default .gpu-vllm)  --chunk-mib N (default 50: a chunk, the
#   manifest and the working tree fit a transfer of 64 MiB)
#   --xz-preset N (default 6: 285 MiB -> 74.5 MiB in ~4.5 min on 2 busy cores; 3 gives 78.2 MiB in
#   2.4 min, the same 2 chunks; the 75 MiB _C extension is already compressed and does not shrink)
#   --vllm-wheel PATH (an already downloaded vllm wheel: linked, not fetched)
#   To redo the scan by hand (here, or on the GPU image with --installed instead of the built-in list):
#     python3 tools/gpu_transfer/gpu_bundle.py scan --tree .gpu-vllm-build/site --roots-file tools/gpu_transfer/gpu_vllm_roots.txt
#   (build with --keep-stage via GPU_BUNDLE_KEEP_STAGE=1 to keep .gpu-vllm-build/site).
#
# --run: build the run bundle (after --vllm): what `qerl run` needs on the GPU image beyond it and the
#   vLLM bundle (Prefect, MLflow, math-verify, pinned in tools/gpu_transfer/gpu_run_requirements.txt, which says
#   why the whole resolved closure travels rather than a scanned one). pip resolves the pins for
#   Python 3.12 manylinux with the vLLM bundle's versions as constraints, into .gpu-run-build/wheels;
#   the build leaves out the image's distributions and the vLLM bundle's, drops the web UIs
#   (tools/gpu_transfer/gpu_run_drop.txt) and packs the rest into .gpu-run/ (part-01, ..., manifest.json).
#   Options with --run: --run-dest DIR (default .gpu-run), --chunk-mib, --xz-preset as above.
set -euo pipefail
cd "$(dirname "$0")/../.."

PINS=(
  pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5
  typing-extensions==4.16.0
  pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 pygments==2.21.0 pytest-timeout==2.4.0 packaging==26.2
)
DEST=.gpu-wheels
MAX_MIB=48
ONLY=()
EXTRA=()
VLLM=0
VLLM_DEST=.gpu-vllm
CHUNK_MIB=50
XZ_PRESET=6
VLLM_WHEEL=""
RUN=0
RUN_DEST=.gpu-run
while (($#)); do
  case "$1" in
    --vllm) VLLM=1; shift ;;
    --vllm-dest) VLLM_DEST=$2; shift 2 ;;
    --run) RUN=1; shift ;;
    --run-dest) RUN_DEST=$2; shift 2 ;;
    --chunk-mib) CHUNK_MIB=$2; shift 2 ;;
    --xz-preset) XZ_PRESET=$2; shift 2 ;;
    --vllm-wheel) VLLM_WHEEL=$2; shift 2 ;;
    --dest) DEST=$2; shift 2 ;;
    --max-mib) MAX_MIB=$2; shift 2 ;;
    --only) ONLY+=("$2"); shift 2 ;;
    --extra) EXTRA+=("$2"); shift 2 ;;
    --list) printf '%s\n' "${PINS[@]}"; exit 0 ;;
    -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1' "$0"; exit 0 ;;
    *) echo "fetch_gpu_wheels: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
done

PY=${PYTHON:-}
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
PLATFORM_ARGS=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64)

if ((VLLM)); then
  REQ=tools/gpu_transfer/gpu_vllm_requirements.txt
  BUILD=.gpu-vllm-build
  mkdir -p "$BUILD/wheels"
  if [[ -n "$VLLM_WHEEL" ]]; then
    [[ -f "$VLLM_WHEEL" ]] || { echo "fetch_gpu_wheels: no such wheel: $VLLM_WHEEL" >&2; exit 2; }
    ln -sf "$(cd "$(dirname "$VLLM_WHEEL")" && pwd)/$(basename "$VLLM_WHEEL")" "$BUILD/wheels/"
  fi
  mapfile -t VSPECS < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' "$REQ" | grep -v '^$')
  echo "fetch_gpu_wheels: ${#VSPECS[@]} pinned wheels (vLLM bundle) into $BUILD/wheels" >&2
  # pip reuses a file already in the folder ("File was already downloaded"): a rerun fetches nothing
  "$PY" -m pip download --quiet --disable-pip-version-check --no-deps "${PLATFORM_ARGS[@]}" \
    -d "$BUILD/wheels" "${VSPECS[@]}" || exit 1
  KEEP=()
  [[ -n "${GPU_BUNDLE_KEEP_STAGE:-}" ]] && KEEP=(--keep-stage)
  # xz over ~300 MiB on a shared machine: be nice to the neighbours
  exec nice -n 10 "$PY" tools/gpu_transfer/gpu_bundle.py build --wheels "$BUILD/wheels" --requirements "$REQ" \
    --drop tools/gpu_transfer/gpu_vllm_drop.txt --defer-annotations tools/gpu_transfer/gpu_vllm_defer_annotations.txt \
    --roots tools/gpu_transfer/gpu_vllm_roots.txt --stage "$BUILD/site" \
    --out "$VLLM_DEST" --chunk-mib "$CHUNK_MIB" --preset "$XZ_PRESET" "${KEEP[@]}"
fi

if ((RUN)); then
  REQ=tools/gpu_transfer/gpu_run_requirements.txt
  BUILD=.gpu-run-build
  [[ -f "$VLLM_DEST/manifest.json" ]] || {
    echo "fetch_gpu_wheels: build the vLLM bundle first (--vllm): the run bundle leaves out what it carries" >&2
    exit 2
  }
  mkdir -p "$BUILD/wheels"
  # the vLLM bundle's versions constrain the resolution: both bundles sit on one sys.path
  "$PY" - "$VLLM_DEST/manifest.json" >"$BUILD/constraints.txt" <<'PYEOF'
import json, sys
for d in json.load(open(sys.argv[1]))["dependencies"]:
    print(d["dist"] + "==" + d["version"])
PYEOF
  mapfile -t RSPECS < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' "$REQ" | grep -v '^$')
  echo "fetch_gpu_wheels: ${RSPECS[*]} and their dependencies (run bundle) into $BUILD/wheels" >&2
  "$PY" -m pip download --quiet --disable-pip-version-check "${PLATFORM_ARGS[@]}" \
    -c "$BUILD/constraints.txt" -d "$BUILD/wheels" "${RSPECS[@]}" || exit 1
  KEEP=()
  [[ -n "${GPU_BUNDLE_KEEP_STAGE:-}" ]] && KEEP=(--keep-stage)
  exec nice -n 10 "$PY" tools/gpu_transfer/gpu_bundle.py build --resolved --provided "$VLLM_DEST/manifest.json" \
    --wheels "$BUILD/wheels" --requirements "$REQ" --drop tools/gpu_transfer/gpu_run_drop.txt --stage "$BUILD/site" \
    --out "$RUN_DEST" --chunk-mib "$CHUNK_MIB" --preset "$XZ_PRESET" "${KEEP[@]}"
fi

SPECS=()
if ((${#ONLY[@]})); then
  for name in "${ONLY[@]}"; do
    match=""
    for pin in "${PINS[@]}"; do [[ "${pin%%==*}" == "$name" ]] && match=$pin; done
    [[ -n "$match" ]] || { echo "fetch_gpu_wheels: '$name' is not in the list: ${PINS[*]}" >&2; exit 2; }
    SPECS+=("$match")
  done
else
  SPECS=("${PINS[@]}")
fi
SPECS+=("${EXTRA[@]}")

mkdir -p "$DEST"
rm -f "$DEST"/*.whl "$DEST"/wheels.json
echo "fetch_gpu_wheels: ${#SPECS[@]} wheels for cp312 manylinux x86_64 into $DEST" >&2
"$PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  -d "$DEST" "${SPECS[@]}"

# the manifest (names, sizes, sha256) and the size check
"$PY" - "$DEST" "$MAX_MIB" <<'EOF'
import hashlib
import json
import os
import sys
from pathlib import Path

dest, limit_mib = Path(sys.argv[1]), float(sys.argv[2])
wheels = sorted(dest.glob("*.whl"))
rows = [
    {"file": w.name, "bytes": w.stat().st_size, "sha256": hashlib.sha256(w.read_bytes()).hexdigest()}
    for w in wheels
]
total = sum(r["bytes"] for r in rows)
manifest = {"python": "3.12", "platforms": ["manylinux2014_x86_64", "manylinux_2_17_x86_64",
            "manylinux_2_28_x86_64", "any"], "wheels": rows, "total_bytes": total}
tmp = dest / "wheels.json.tmp"
tmp.write_text(json.dumps(manifest, indent=1) + "\n")
os.replace(tmp, dest / "wheels.json")
for r in rows:
    print(f"  {r['bytes'] / 2**20:7.2f} MiB  {r['file']}", file=sys.stderr)
print(f"fetch_gpu_wheels: {len(rows)} wheels, {total / 2**20:.2f} MiB in {dest}", file=sys.stderr)
if total > limit_mib * 2**20:
    sys.exit(f"fetch_gpu_wheels: {total / 2**20:.3f} MiB is over the {limit_mib:g} MiB limit "
             "(the device tool carries 64 MiB in all)")
EOF
