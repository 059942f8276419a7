#!/usr/bin/env bash
# The qerl package from this tree with no installer, for a Python that has none (the GPU image):
#   bash tools/gpu_transfer/gpu_src.sh DEST
# DEST/qerl holds qerl/__init__.py and links to the top-level folders pyproject maps into it, and
# DEST/sitecustomize.py appends $QERL_SYS_PATH_AFTER after site-packages (tools/gpu_transfer/gpu_sitecustomize.py).
# Put DEST first on PYTHONPATH (gpu_offline.sh: .gpu-src; the CPU replica: .gpu-replica/src).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
DEST=${1:?usage: gpu_src.sh DEST}
rm -rf "$DEST"
mkdir -p "$DEST/qerl"
cp "$ROOT/qerl/__init__.py" "$DEST/qerl/__init__.py"
for sub in pipeline stages kernels flows; do ln -s "$ROOT/$sub" "$DEST/qerl/$sub"; done
cp "$ROOT/tools/gpu_transfer/gpu_sitecustomize.py" "$DEST/sitecustomize.py"
