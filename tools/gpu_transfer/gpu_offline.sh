#!/usr/bin/env bash
# qerl's GPU validation on a GPU machine image with no network whose packages are not
# requirements/gpu.txt: stage the bundles carried to it, build the environment that puts them after the
# image's own packages, then run the product's validation in that environment.
#
#   bash tools/gpu_transfer/gpu_offline.sh --stage-only        stage the carried chunks, unpack what is complete, stop
#   bash tools/gpu_transfer/gpu_offline.sh [OPTIONS]           then bash scripts/gpu/gpu_validate.sh OPTIONS
#   bash tools/gpu_transfer/gpu_offline.sh --check [OPTIONS]   then bash scripts/gpu/gpu_check.sh OPTIONS (one part)
#   bash tools/gpu_transfer/gpu_offline.sh --exec CMD [ARGS]   then CMD ARGS, e.g.
#                                      --exec python3 -m qerl.flows.cli run --config demo-gpu
# Run it from anywhere; it works in the repository root. --help prints this.
#
# Staging (standard library only: seconds, nothing installed into the image): .gpu-NAME/part-NN and
# manifest.json (NAME vllm or run, built by fetch_gpu_wheels.sh --NAME on a connected machine) are moved
# into .gpu-NAME-chunks/, where they stay between calls, so the chunks can come one a call. Once every
# chunk is there and sound, the archive is reassembled, its sha256 checked, and it is extracted into
# .gpu-NAME-site/. A missing chunk is named ("MISSING 1 of 2 chunks: part-02"), a corrupt one too
# ("CORRUPT chunk ...: carry it again").
#
# The environment handed on:
#   PYTHON                 $PYTHON, else python3 (the image's)
#   PYTHONPATH             .gpu-site (the small wheel set, .gpu-wheels/ from fetch_gpu_wheels.sh with no
#                          option, when carried), then .gpu-src (qerl from the checkout with no installer:
#                          gpu_src.sh), then the repository root
#   QERL_SYS_PATH_AFTER    the extracted bundles, which .gpu-src/sitecustomize.py appends AFTER the image's
#                          site-packages in every process (the image's torch must be the one that runs)
#   VLLM_USE_FLASHINFER_SAMPLER=0  the vLLM bundle leaves FlashInfer out
#   VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1  nothing outside the machine can be reached
#   QERL_GPU_ENV_NOTE      what was staged, for the product's report (its first line: the bundles' state)
# After extracting the vLLM bundle it imports every root module of the bundle's import scan on its own
# (gpu_import_roots.py, roots in gpu_vllm_roots.txt), so one call names every module the scan missed; a
# clean check is stamped in .gpu-vllm-site/.imports-ok with the roots list's sha256 and reused by later
# calls. With --dry-run or --cpu among the options (the CPU's wiring check) the bundles and wheels are
# left alone: the CPU environment has everything, and .gpu-src still goes first.
#
# Exit: --stage-only: 0 staged (complete or not), 4 a chunk is corrupt, 1 staging failed; 1 when the
# carried wheels do not install; otherwise the exit status of what it runs.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
cd "$HERE/../.."
ROOT=$PWD
KIT=tools/gpu_transfer

MODE=validate
STAGE_ONLY=0
case "${1:-}" in
  --stage-only) STAGE_ONLY=1; shift ;;
  --check) MODE=check; shift ;;
  --exec) MODE=exec; shift; (($#)) || { echo "gpu_offline: --exec takes a command" >&2; exit 2; } ;;
  -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1' "$0"; exit 0 ;;
esac
DRY=0
for arg in "$@"; do [[ "$arg" == --dry-run || "$arg" == --cpu ]] && DRY=1; done
PY=${PYTHON:-python3}
export PYTHON=$PY
say() { echo "[gpu_offline] $*" >&2; }
STAGE_LOG=$(mktemp)
trap 'rm -f "$STAGE_LOG"' EXIT  # the staging's own output, shown once a bundle is done

# the bundles: carried chunks -> .gpu-NAME-chunks (kept between calls) -> .gpu-NAME-site. NAME is vllm
# (the engine) or run (what `qerl run` adds: Prefect, MLflow, math-verify); each is staged when carried.
stage_bundle() {  # stage_bundle NAME LABEL: prints the bundle's state (one line)
  local name=$1 label=$2 rc=0
  if ((DRY && !STAGE_ONLY)); then
    echo "dry run: the $label bundle is not unpacked (the CPU environment has everything)"
    return
  fi
  if [[ ! -f ".gpu-$name/manifest.json" && ! -f ".gpu-$name-chunks/manifest.json" ]]; then
    echo "no $label bundle carried (fetch_gpu_wheels.sh --$name builds it)"
    return
  fi
  "$PY" "$KIT/gpu_bundle.py" stage --from ".gpu-$name" --to ".gpu-$name-chunks" >>"$STAGE_LOG" 2>&1 || rc=$?
  if ((rc == 0)); then
    if "$PY" "$KIT/gpu_bundle.py" unpack --dir ".gpu-$name-chunks" --dest ".gpu-$name-site" >>"$STAGE_LOG" 2>&1; then
      echo "$label bundle extracted in .gpu-$name-site"
    else
      echo "$label part skipped: the bundle did not extract (see the lines above)"
    fi
  elif ((rc == 3)); then
    echo "$label part skipped: chunks missing: $(grep -o 'MISSING.*' "$STAGE_LOG" | tail -1)"
  elif ((rc == 4)); then
    echo "$label part skipped: a chunk is corrupt: $(grep -o 'CORRUPT.*' "$STAGE_LOG" | tail -1)"
  else  # a Python error, not the chunks: say so rather than blame a chunk
    echo "$label part skipped: staging failed (exit $rc): $(tail -1 "$STAGE_LOG")"
  fi
}
VLLM_STATE=$(stage_bundle vllm vLLM)
cat "$STAGE_LOG" >&2
: >"$STAGE_LOG"
RUN_STATE=$(stage_bundle run run)
cat "$STAGE_LOG" >&2
say "$VLLM_STATE"
say "$RUN_STATE"
if ((STAGE_ONLY)); then
  # what the machine is, for the call's output (seconds; the next call does the rest)
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >&2 || true
  fi
  [[ "$VLLM_STATE$RUN_STATE" == *corrupt* ]] && exit 4
  [[ "$VLLM_STATE$RUN_STATE" == *"staging failed"* ]] && exit 1
  exit 0
fi

# qerl from this tree with no installer (the image may have no setuptools): .gpu-src first on the path,
# whose sitecustomize appends the bundles after the image's site-packages in every process started here
bash "$KIT/gpu_src.sh" .gpu-src
export PYTHONPATH="$ROOT/.gpu-src:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
AFTER=()
if ((!DRY)); then
  for b in vllm run; do [[ -f ".gpu-$b-site/.bundle-sha256" ]] && AFTER+=("$ROOT/.gpu-$b-site"); done
fi
if ((${#AFTER[@]})); then
  QERL_SYS_PATH_AFTER=$(IFS=:; echo "${AFTER[*]}")
  export QERL_SYS_PATH_AFTER
fi
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
# vLLM's sampler imports FlashInfer at engine start unless told not to
# (vllm/v1/sample/ops/topk_topp_sampler.py), and the bundle leaves it out (gpu_vllm_requirements.txt),
# so the engine would not start ("No module named 'flashinfer'"). With it off, vLLM's own PyTorch
# top-k/top-p sampling runs (qerl's defaults, top_p 1 and top_k -1, use neither).
export VLLM_USE_FLASHINFER_SAMPLER=${VLLM_USE_FLASHINFER_SAMPLER:-0}

# the small wheel set (pydantic, pytest) -> .gpu-site, a target folder first on the path; the image's
# own packages stay untouched
if ((!DRY)) && compgen -G ".gpu-wheels/*.whl" >/dev/null; then
  rm -rf .gpu-site
  if "$PY" -m pip install --quiet --no-index --no-deps --disable-pip-version-check --target .gpu-site \
    .gpu-wheels/*.whl >&2; then
    say "installed $(ls .gpu-wheels/*.whl | wc -l) carried wheels into .gpu-site with pip"
  else
    # no pip (or one that refuses): a wheel is a zip laid out for site-packages (these have no data/scripts)
    say "pip could not install .gpu-wheels: unpacking them into .gpu-site instead"
    rm -rf .gpu-site
    "$PY" -c "import sys, zipfile; [zipfile.ZipFile(w).extractall('.gpu-site') for w in sys.argv[1:]]" \
      .gpu-wheels/*.whl
  fi
  export PYTHONPATH="$ROOT/.gpu-site:$PYTHONPATH"
  "$PY" -c "import pydantic, pytest" || { say "pydantic/pytest still not importable from .gpu-site"; exit 1; }
fi

# every root of the bundle's import scan, each on its own: all the modules the scan missed show in this
# call, not only the first one an engine start hits. A later call reuses a clean check (importing the
# roots takes tens of seconds): the stamp names the roots list it checked, and a new bundle is extracted
# into a fresh folder, without the stamp. Written aside, then renamed: a call cut off mid-write leaves
# no half stamp.
VLLM_IMPORTS=""
if [[ "${QERL_SYS_PATH_AFTER:-}" == *.gpu-vllm-site* ]]; then
  STAMP=.gpu-vllm-site/.imports-ok
  ROOTS_SUM=$(sha256sum "$KIT/gpu_vllm_roots.txt" | cut -d' ' -f1)
  if [[ -f "$STAMP" && "$(head -1 "$STAMP")" == "$ROOTS_SUM" ]]; then
    VLLM_IMPORTS="$(tail -n +2 "$STAMP"), by an earlier call on this machine"
  else
    PAIRED=1
    if ! "$PY" -c "import torch, vllm, sys; sys.exit('.gpu-vllm-site' in torch.__file__ or '.gpu-vllm-site' not in vllm.__file__)"; then
      say "vLLM from .gpu-vllm-site is not importable next to the image's torch"
      PAIRED=0
    fi
    CLEAN=1
    VLLM_IMPORTS=$("$PY" "$KIT/gpu_import_roots.py" "$KIT/gpu_vllm_roots.txt") || CLEAN=0
    if ((CLEAN && PAIRED)); then
      printf '%s\n%s\n' "$ROOTS_SUM" "$(grep -m1 '^imports:' <<<"$VLLM_IMPORTS")" >"$STAMP.tmp"
      mv -f "$STAMP.tmp" "$STAMP"
    fi
  fi
  say "vLLM $VLLM_IMPORTS"
fi

QERL_GPU_ENV_NOTE="carried bundles (gpu_offline.sh): $VLLM_STATE; $RUN_STATE"
[[ -n "$VLLM_IMPORTS" ]] && QERL_GPU_ENV_NOTE+=$'\n'"vLLM $VLLM_IMPORTS"
export QERL_GPU_ENV_NOTE
rm -f "$STAGE_LOG"  # exec leaves no shell to run the trap
case $MODE in
  validate) exec bash scripts/gpu/gpu_validate.sh "$@" ;;
  check) exec bash scripts/gpu/gpu_check.sh "$@" ;;
  exec) exec "$@" ;;
esac
