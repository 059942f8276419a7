#!/usr/bin/env bash
# The GPU validation kit: one command, from the repository root of a CUDA machine.
#
#   bash scripts/gpu_check.sh              installs the carried wheels (.gpu-wheels, see
#                                          scripts/fetch_gpu_wheels.sh) into .gpu-site, runs the `gpu`
#                                          tests (tests/test_gpu.py) with compiled Triton, runs the GPU
#                                          benchmark (benchmarks/bench_gpu.py) and writes the results
#   bash scripts/gpu_check.sh --dry-run    the same on a CPU at tiny shapes, in about a minute (CI):
#                                          the gpu tests skip, the benchmark runs its tiny CPU shapes
#
# Results go to $OUT (the device tool's output folder; default qerl-work/gpu-check): gpu-check.md
# (the report: mode, environment, test summary, benchmark tables), gpu-check.log, gpu-tests.xml,
# gpu.md and gpu.json. A CUDA run also writes benchmarks/results/gpu.{md,json} in this tree (copy them
# from $OUT into the repository when the tree is a remote copy). A dry run never touches
# benchmarks/results. The exit status is non-zero when the tests or the benchmark failed.
#
# Options: --dry-run  --tests-only  --bench-only  --models 7b,14b,32b  --arms nvfp4,bf16
#          --steps N  --prompt N  --completion N  --skip-kernels  --merge  (these go to bench_gpu.py;
#          --merge keeps the other models' arms already in benchmarks/results/gpu.json)
# The whole default run is sized for one 10-minute device call on an H100; split it with
# --tests-only / --bench-only / --models, e.g. `--models 7b,14b` then `--bench-only --models 32b
# --skip-kernels --merge`, if it does not fit.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

DRY=0
TESTS=1
BENCH=1
BENCH_ARGS=()
while (($#)); do
  case "$1" in
    --dry-run) DRY=1; shift ;;
    --tests-only) BENCH=0; shift ;;
    --bench-only) TESTS=0; shift ;;
    --models|--arms|--steps|--prompt|--completion) BENCH_ARGS+=("$1" "$2"); shift 2 ;;
    --merge|--skip-kernels) BENCH_ARGS+=("$1"); shift ;;
    -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1' "$0"; exit 0 ;;
    *) echo "gpu_check: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
done

OUT=${OUT:-qerl-work/gpu-check}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LOG="$OUT/gpu-check.log"
: >"$LOG"
say() { echo "[gpu_check] $*" | tee -a "$LOG" >&2; }

PY=${PYTHON:-}
if [[ -z "$PY" ]]; then
  if ((DRY)) && [[ -x .venv/bin/python ]]; then PY=$ROOT/.venv/bin/python; else PY=python3; fi
fi
MODE=$( ((DRY)) && echo dry-run || echo cuda)
say "mode: $MODE, python: $PY ($("$PY" --version 2>&1)), results: $OUT"

# 1. carried wheels -> .gpu-site (a target folder first on sys.path; the image's own packages untouched)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
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
  say "no .gpu-wheels/*.whl here: using the image's packages only (run scripts/fetch_gpu_wheels.sh and carry .gpu-wheels)"
fi

# 2. environment
ENV_TXT=$("$PY" - <<'EOF' 2>&1
import importlib, platform
print(f"python {platform.python_version()} on {platform.machine()}")
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

# 3. the gpu tests (compiled Triton on CUDA; the dry run leaves the interpreter default of the suite)
TEST_RC=skipped
TEST_SUMMARY="not run (--bench-only)"
if ((TESTS)); then
  ((DRY)) || export TRITON_INTERPRET=0
  say "pytest -m gpu tests/test_gpu.py"
  "$PY" -m pytest -q -m gpu -rs -p no:cacheprovider --junitxml="$OUT/gpu-tests.xml" tests/test_gpu.py \
    >"$OUT/gpu-tests.txt" 2>&1
  TEST_RC=$?
  cat "$OUT/gpu-tests.txt" >>"$LOG"
  TEST_SUMMARY=$(grep -E "^(SKIPPED|FAILED|ERROR)|[0-9]+ (passed|failed|skipped|error)" "$OUT/gpu-tests.txt" | tail -20)
  say "tests: exit $TEST_RC"
fi

# 4. the benchmark
BENCH_RC=skipped
if ((BENCH)); then
  if ((DRY)); then
    "$PY" benchmarks/bench_gpu.py --dry-run --out-dir "$OUT" "${BENCH_ARGS[@]}" >>"$LOG" 2>&1
    BENCH_RC=$?
  else
    "$PY" benchmarks/bench_gpu.py --out-dir benchmarks/results "${BENCH_ARGS[@]}" >>"$LOG" 2>&1
    BENCH_RC=$?
    cp benchmarks/results/gpu.md benchmarks/results/gpu.json "$OUT"/ 2>/dev/null
  fi
  say "benchmark: exit $BENCH_RC"
fi

# 5. the report (written beside, then renamed: a reader never sees half of it)
{
  echo "# GPU check ($(date -u +%Y-%m-%dT%H:%M:%SZ))"
  echo
  echo "mode: $MODE; tests exit $TEST_RC; benchmark exit $BENCH_RC"
  echo
  echo '```'
  echo "$ENV_TXT"
  echo '```'
  echo
  echo "## Tests (pytest -m gpu tests/test_gpu.py)"
  echo
  echo '```'
  echo "$TEST_SUMMARY"
  echo '```'
  echo
  [[ -f "$OUT/gpu.md" ]] && cat "$OUT/gpu.md" || echo "(no benchmark results)"
} >"$OUT/gpu-check.md.tmp" && mv "$OUT/gpu-check.md.tmp" "$OUT/gpu-check.md"
say "report: $OUT/gpu-check.md"

[[ "$TEST_RC" == 0 || "$TEST_RC" == skipped ]] && [[ "$BENCH_RC" == 0 || "$BENCH_RC" == skipped ]]
