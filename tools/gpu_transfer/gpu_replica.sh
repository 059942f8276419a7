#!/usr/bin/env bash
# A pre-flight for a GPU machine, on a CPU machine: build the CPU replica of the GPU image in
# .gpu-replica/ (git-ignored) and run tools/gpu_transfer/gpu_replica_check.py in it (what it checks, and where it
# stops: its docstring). Whatever fails here before the GPU is needed would fail there too, and here it
# costs no GPU time.
#
# The replica: a Python 3.12 venv with the image's torch 2.11.0+cu130 and the image's packages that
# vLLM and qerl read (tools/gpu_transfer/gpu_replica_requirements.txt), less anything pip pulled in that the image
# lacks (tools/gpu_transfer/gpu_image_packages.txt); the vLLM bundle (.gpu-vllm, from
# `tools/gpu_transfer/fetch_gpu_wheels.sh --vllm`) and the run bundle (.gpu-run, `--run`), staged and extracted
# by tools/gpu_transfer/gpu_bundle.py and put after site-packages by gpu_offline.sh's own sitecustomize
# (tools/gpu_transfer/gpu_src.sh), in every process; a libcuda.so.1 built
# here whose every entry point answers "no device" (tools/gpu_transfer/gpu_replica_build.py); and
# tools/gpu_transfer/gpu_replica_platform.py installed as two vLLM plugins (an H200's capability 9.0; a stop at
# the worker's init_device, where the GPU is first needed).
#
# --user-install: the same check on what a user's GPU install gets instead of the image: a Python 3.11
# venv in .gpu-replica-user/ filled as `QERL_ENV=gpu make venv` fills .venv (one `pip install -r
# requirements/gpu.txt`: vLLM 0.26.0's CUDA build on the CUDA 13 torch 2.11.0 it pins), from the
# package registry alone (pip --isolated: this machine's pip configuration off); no bundles. With
# --requirements requirements/gpu-untested-vllm032.txt it checks the untested newer set instead (vLLM
# 0.32 on torch 2.13.0, with FlashInfer and Humming, which 0.32 would pick for NVFP4 on an H200 without
# the engine's linear_backend): as far as that set has been checked, since no GPU has run it.
#
# Usage: bash tools/gpu_transfer/gpu_replica.sh [--user-install [--requirements FILE]] [--python PATH] [--rebuild] [--build-only]
#   --user-install  check a user's GPU install (requirements/gpu.txt) instead of the GPU image
#   --requirements FILE  the requirements file --user-install installs (default requirements/gpu.txt);
#                   the replica is rebuilt when it was built from another file
#   --python PATH   a Python 3.12 (default: python3.12 on PATH, else pyenv's newest 3.12); 3.11 with
#                   --user-install
#   --rebuild       build the venv anew (else it is topped up, and the bundles, stub and plugins refreshed)
#   --build-only    build, do not check
# Costs: ~6.3 GB of disk (torch's CUDA libraries), ~2 min to install from a near registry, the
# check ~1.5 min; --user-install ~9.6 GB and ~4 min. Output: the findings on the console; vLLM's log
# in .gpu-replica/check.log (.gpu-replica-user/check.log).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
REP=$ROOT/.gpu-replica
PYVER=3.12
PYBASE=""
REBUILD=0
BUILD_ONLY=0
USER_INSTALL=0
USER_REQS=requirements/gpu.txt
while (($#)); do
  case $1 in
    --user-install) USER_INSTALL=1; REP=$ROOT/.gpu-replica-user; PYVER=3.11; shift ;;
    --requirements) USER_REQS=$2; shift 2 ;;
    --python) PYBASE=$2; shift 2 ;;
    --rebuild) REBUILD=1; shift ;;
    --build-only) BUILD_ONLY=1; shift ;;
    -h | --help) sed -n '2,/^set -euo/{/^set -euo/!p}' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_replica: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
say() { echo "[gpu_replica] $*" >&2; }
if [[ "$USER_REQS" != requirements/gpu.txt ]]; then
  ((USER_INSTALL)) || { say "--requirements goes with --user-install"; exit 2; }
  [[ -f "$USER_REQS" ]] || { say "no requirements file '$USER_REQS'"; exit 2; }
fi
# a user-install replica built from another requirements file is built anew
if ((USER_INSTALL)) && [[ -f "$REP/.requirements" && "$(cat "$REP/.requirements")" != "$USER_REQS" ]]; then
  say "$REP was built from $(cat "$REP/.requirements"): building it anew from $USER_REQS"
  REBUILD=1
fi

PY=$REP/bin/python
is_ver() { [[ -n "$1" ]] && "$1" -c "import sys; sys.exit('%d.%d' % sys.version_info[:2] != '$PYVER')" 2>/dev/null; }
if ((REBUILD)) || [[ ! -x "$PY" ]]; then
  if [[ -z "$PYBASE" ]]; then  # pythonX.Y on PATH (a pyenv shim may not answer), else pyenv's newest X.Y
    for cand in "$(command -v "python$PYVER" 2>/dev/null)" \
      $(command -v pyenv >/dev/null && ls -d "$(pyenv root)"/versions/"$PYVER".*/bin/python"$PYVER" 2>/dev/null | sort -rV); do
      if is_ver "$cand"; then PYBASE=$cand; break; fi
    done
  fi
  if ! is_ver "$PYBASE"; then
    say "no Python $PYVER found (the $( ((USER_INSTALL)) && echo "GPU set-up" || echo "GPU image")'s): give one with --python PATH"
    exit 1
  fi
fi
if ((!USER_INSTALL)) && [[ ! -f .gpu-vllm/manifest.json ]]; then
  say "no vLLM bundle in .gpu-vllm: build it first with 'bash tools/gpu_transfer/fetch_gpu_wheels.sh --vllm'"
  exit 1
fi
if ((REBUILD)) || [[ ! -x "$PY" ]]; then
  rm -rf "$REP"
  say "venv from $PYBASE ($("$PYBASE" --version)); installing $( ((USER_INSTALL)) && echo "$USER_REQS (~10 GB)" || echo "the image's packages (~6 GB)")"
  "$PYBASE" -m venv "$REP"
  ((USER_INSTALL)) && echo "$USER_REQS" >"$REP/.requirements"
fi
SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# The plugins are off the path while pip runs (the bundles always are: only the check's environment
# names them).
rm -rf "$SITE"/qerl_replica_platform.py "$SITE"/qerl_replica_platform-0.dist-info
AFTER=()
if ((USER_INSTALL)); then
  # the README's command, from the package registry alone (no find-links, constraints or mirrors)
  if ! "$PY" -m pip --isolated install --disable-pip-version-check -r "$USER_REQS" >>"$REP/build.log" 2>&1; then
    tail -5 "$REP/build.log" >&2
    say "pip could not install $USER_REQS (the whole output: $REP/build.log)"
    exit 1
  fi
else
  # the image's packages: the list, and those the bundles were built to find there (each run: a
  # bundle rebuilt since may need one more)
  "$PY" tools/gpu_transfer/gpu_replica_build.py needs --out "$REP/requirements.txt"
  if ! "$PY" -m pip install --disable-pip-version-check -r "$REP/requirements.txt" >>"$REP/build.log" 2>&1; then
    tail -5 "$REP/build.log" >&2
    say "pip could not install the image's packages (the whole output: $REP/build.log)"
    exit 1
  fi
  # no more than the image: what pip pulled in beyond its list goes (names normalised as pip's)
  EXTRA=$("$PY" -I - <<'PYEOF'
import sys
from importlib.metadata import distributions

sys.path.insert(0, "tools/gpu_transfer")
from gpu_imports import image_packages, norm

print(" ".join(sorted({norm(d.metadata["Name"]) for d in distributions()} - image_packages() - {"pip"})))
PYEOF
  )
  if [[ -n "$EXTRA" ]]; then
    say "removing what the image lacks: $EXTRA"
    # shellcheck disable=SC2086
    "$PY" -m pip uninstall --yes $EXTRA >>"$REP/build.log" 2>&1
  fi

  # the bundles, as gpu_offline.sh stages them (a chunk at a time, then one archive with its sha256 checked)
  stage() {  # stage NAME: .gpu-NAME -> $REP/NAME-site, once per archive
    local name=$1 sha
    sha=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["archive"]["sha256"])' ".gpu-$name/manifest.json")
    if [[ "$(cat "$REP/$name-site/.bundle-sha256" 2>/dev/null)" != "$sha" ]]; then
      rm -rf "$REP/$name-carried" "$REP/$name-chunks" "$REP/$name-site"
      # staging moves what a call carried: it gets links to the chunks (a copy across file systems)
      cp -al ".gpu-$name" "$REP/$name-carried" 2>/dev/null || cp -a ".gpu-$name" "$REP/$name-carried"
      "$PY" tools/gpu_transfer/gpu_bundle.py stage --from "$REP/$name-carried" --to "$REP/$name-chunks" >&2
      "$PY" tools/gpu_transfer/gpu_bundle.py unpack --dir "$REP/$name-chunks" --dest "$REP/$name-site" >&2
      rm -rf "$REP/$name-carried" "$REP/$name-chunks"
    fi
    AFTER+=("$REP/$name-site")
  }
  stage vllm
  if [[ -f .gpu-run/manifest.json ]]; then
    stage run
  else
    say "no run bundle in .gpu-run: the check's 'qerl run' part is skipped (tools/gpu_transfer/fetch_gpu_wheels.sh --run)"
  fi
fi

# qerl and the bundles on sys.path as gpu_offline.sh puts them: .gpu-replica/src first (qerl, and a
# sitecustomize that appends $QERL_SYS_PATH_AFTER after site-packages in every process)
bash tools/gpu_transfer/gpu_src.sh "$REP/src"
QERL_SYS_PATH_AFTER=$(IFS=:; echo "${AFTER[*]}")

# the stub driver, for the driver entry points vLLM's extensions link (the bundle's, or the install's)
if ((USER_INSTALL)); then STUB_SITE=$SITE; else STUB_SITE=$REP/vllm-site; fi
"$PY" tools/gpu_transfer/gpu_replica_build.py stub --site "$STUB_SITE" --out "$REP/driver" >&2

# the plugins (the platform, the stop at the GPU): every process vLLM starts finds them by their entry points
cp tools/gpu_transfer/gpu_replica_platform.py "$SITE/qerl_replica_platform.py"
mkdir -p "$SITE/qerl_replica_platform-0.dist-info"
printf 'Metadata-Version: 2.1\nName: qerl-replica-platform\nVersion: 0\n' >"$SITE/qerl_replica_platform-0.dist-info/METADATA"
printf '%s\n' '[vllm.platform_plugins]' 'replica_h200 = qerl_replica_platform:activate' '' \
  '[vllm.general_plugins]' 'replica_stop_at_device = qerl_replica_platform:stop_at_device' \
  >"$SITE/qerl_replica_platform-0.dist-info/entry_points.txt"
printf 'qerl_replica_platform.py,,\n' >"$SITE/qerl_replica_platform-0.dist-info/RECORD"
say "replica ready: $PY ($(du -sh "$REP" | cut -f1))"
((BUILD_ONLY)) && exit 0

# CUDA_VISIBLE_DEVICES="": vLLM then keeps Triton with no active driver (as it would with one) and so
# picks the model runner the H200 gets. The sampler switch is gpu_offline.sh's, for the bundle, not a
# user's.
SAMPLER=(VLLM_USE_FLASHINFER_SAMPLER=0)
((USER_INSTALL)) && SAMPLER=()
say "checking (vLLM's log: $REP/check.log)"
set +e
env LD_LIBRARY_PATH="$REP/driver${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_VISIBLE_DEVICES="" \
  "${SAMPLER[@]}" VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 \
  PYTHONPATH="$REP/src:$ROOT" QERL_SYS_PATH_AFTER="$QERL_SYS_PATH_AFTER" \
  "$PY" tools/gpu_transfer/gpu_replica_check.py --report "$REP/report.txt" >"$REP/check.log" 2>&1
RC=$?
set -e
if [[ -f "$REP/report.txt" ]]; then cat "$REP/report.txt"; else tail -20 "$REP/check.log"; fi
exit $RC
