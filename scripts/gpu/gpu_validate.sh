#!/usr/bin/env bash
# Validate qerl on one NVIDIA GPU: every GPU check, in priority order, each under its own time limit,
# items 1-5 in about 12 minutes (their default limits add up to 710 s; the machine's start comes on top).
#
#   bash scripts/gpu/gpu_validate.sh             run the items below, in order, on this CUDA machine
#   bash scripts/gpu/gpu_validate.sh --dry-run   print the items, their limits and commands; run nothing
#   bash scripts/gpu/gpu_validate.sh --cpu       run the same items on a CPU at tiny shapes (a wiring check)
#
# Run it from the repository root of a GPU machine with the GPU install: .venv from requirements/gpu.txt
# (`QERL_ENV=gpu make venv`; a machine with no network installs the same set from a wheelhouse:
# docs/guide/gpu-offline.md). It runs in the environment it is given: the Python of --python, else
# $PYTHON, else .venv/bin/python when it has vLLM, else python3. Each item runs scripts/gpu/gpu_check.sh
# with that Python.
#
# The items, in this order:
#   1 qerl-run    260 s  `qerl run --config demo-gpu` to its end: the base evaluation, the registration,
#                        the champion alias
#   2 marlin-7b   210 s  FP4 Marlin against bf16 rollout tokens/s at 7B's matrix shapes (a 7B with 4 of
#                        its 28 layers), 128 concurrent sequences (--concurrency); the memory planner's
#                        vLLM rows against vLLM's log
#   3 padded       90 s  tests/gpu/test_gpu_vllm_padded.py: SmolLM2-135M's 576-wide projections through Marlin
#                        (padded to its tiles) with a LoRA, against the trainer
#   4 aqn-det-7b   90 s  one GRPO update at 7B with and without train.deterministic's kernels, then the
#                        nvfp4-aqn arm (the engine built for AQN) at item 2's shape: what exact AQN costs
#                        the compiled engine
#   5 gptq-7b      60 s  GPTQ's time on one 7B decoder layer on CUDA, and the quality report's peak GPU
#                        memory at 7B's shapes (scripts/gpu/gpu_quantize_7b.py)
#   6 nf4         150 s  QLoRA's NF4 checkpoint through vLLM's bitsandbytes support: rollout tokens/s at
#                        item 2's shape (skipped, with the reason, by a bench_vllm.py without an nf4 arm);
#                        then one GRPO update at 7B on the NF4 base, beside item 4's NVFP4 one.
#                        Items 1-5 fit about 12 minutes of run time; item 6 is last, so a run with less
#                        time left cuts it and no other item
#
# Results, in $OUT (default qerl-work/gpu-validate):
#   results.jsonl  one JSON record when an item starts and one when it ends (item, name, limit_s,
#                  seconds, outcome, exit, report, summary), appended as it happens: a run cut at any
#                  point, or given less time than the whole, keeps every item that finished
#   results.md     the same as a table, rewritten after every item
#   item-N-NAME/   that item's reports (gpu-check.md, gpu-check.log, the benchmarks' tables)
# An item's outcome: passed, failed, cut (its limit ran out; what it measured so far is kept), not
# started (no time left), skipped (with the reason).
#
# Options:
#   --items 1,3,5       only these items (still in the order above)
#   --limit N=S         item N's limit in seconds (repeatable); --concurrency C  item 2's concurrent
#                       sequences (a multiple of 8; default 128, from 64 to 256 is the useful range)
#   --python PY         the Python to run (default: $PYTHON, else .venv/bin/python when it has vLLM,
#                       else python3)
#   --dry-run  --cpu  -h/--help
# Exit: 0 every item passed or was skipped with a reason; 1 an item failed; 5 nothing failed but an
# item was cut or not started; 2 a wrong option.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD

NAMES=(qerl-run marlin-7b padded aqn-det-7b gptq-7b nf4)
LIMITS=(260 210 90 90 60 150)
ITEMS=(1 2 3 4 5 6)
DRY=0
CPU=0
CONC=128
PY=${PYTHON:-}
MIN_S=${QERL_GPU_ITEM_MIN_S:-20}  # a kit call that would get less is not started
KIT=${QERL_GPU_VALIDATE_KIT:-scripts/gpu/gpu_check.sh}  # the tests put a stand-in here
usage() { awk 'NR > 1 && !/^#/ {exit} NR > 1' "$0"; }
die() { echo "gpu_validate: $*" >&2; exit 2; }
while (($#)); do
  case "$1" in
    --dry-run) DRY=1; shift ;;
    --cpu) CPU=1; shift ;;
    --items)
      [[ "${2:-}" =~ ^[1-6](,[1-6])*$ ]] || die "--items takes item numbers 1-6, e.g. 1,3 (not '${2:-}')"
      mapfile -t ITEMS < <(tr , '\n' <<<"$2" | sort -un); shift 2 ;;
    --limit)
      [[ "${2:-}" =~ ^([1-6])=([0-9]+)$ ]] || die "--limit takes N=SECONDS with N from 1 to 6 (not '${2:-}')"
      LIMITS[BASH_REMATCH[1] - 1]=${BASH_REMATCH[2]}; shift 2 ;;
    --concurrency)
      [[ "${2:-}" =~ ^[0-9]+$ ]] && (($2 >= 8 && $2 % 8 == 0)) || die "--concurrency takes a multiple of 8 (not '${2:-}')"
      CONC=$2; shift 2 ;;
    --python) PY=${2:?}; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown option '$1' (see --help)" ;;
  esac
done
if [[ -z "$PY" ]]; then
  PY=python3
  [[ -x .venv/bin/python ]] && .venv/bin/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('vllm') is None)" 2>/dev/null && PY=$ROOT/.venv/bin/python
fi
OUT=${OUT:-qerl-work/gpu-validate}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
RESULTS=$OUT/results.jsonl

# the kit's calls: each part gets what is left of its item, with little held back (the items are short)
export QERL_GPU_PART_MIN_S=${QERL_GPU_PART_MIN_S:-10} QERL_GPU_REPORT_RESERVE_S=${QERL_GPU_REPORT_RESERVE_S:-5}
export PYTHON=$PY
VLLM_7B=(--vllm-models 7b --vllm-layers 4 --vllm-prompts $((CONC / 8)) --vllm-n 8)

nf4_reason() {  # empty when the NF4 arm exists, else why item 6 is skipped
  local arms
  arms=$(sed -n 's/^ARMS = //p' benchmarks/bench_vllm.py)
  [[ "$arms" == *'"nf4"'* ]] || echo "benchmarks/bench_vllm.py has no nf4 arm (its arms: $arms)"
}

# item N's kit calls, one a line: NAME|gpu_check.sh's arguments
item_calls() {
  case "$1" in
    1) echo "run|--run-only --run-config demo-gpu" ;;
    2) echo "marlin|--bench-only --no-bench-gpu ${VLLM_7B[*]} --vllm-arms nvfp4,bf16" ;;
    3) echo "padded|--tests-only --test-files tests/gpu/test_gpu_vllm_padded.py" ;;
    4) echo "det|--bench-only --no-vllm --models 7b --arms nvfp4,nvfp4-det --skip-kernels --merge"
       echo "aqn|--bench-only --no-bench-gpu ${VLLM_7B[*]} --vllm-arms nvfp4-aqn" ;;
    5) echo "quantize|--exec-py scripts/gpu/gpu_quantize_7b.py" ;;
    6) [[ -z "$(nf4_reason)" ]] && echo "nf4|--bench-only --no-bench-gpu ${VLLM_7B[*]} --vllm-arms nf4" &&
         echo "nf4-train|--bench-only --no-vllm --models 7b --arms nf4 --skip-kernels --merge" ;;
  esac
}

if ((DRY)); then
  echo "gpu_validate: the items ($( ((CPU)) && echo "on the CPU, tiny shapes" || echo "on this CUDA machine")), python $PY, results in $OUT"
  total=0
  for n in "${ITEMS[@]}"; do
    limit=${LIMITS[n - 1]}
    total=$((total + limit))
    echo "item $n ${NAMES[n - 1]} (limit ${limit}s)"
    calls=$(item_calls "$n")
    [[ -z "$calls" ]] && echo "  skipped: $(nf4_reason)"
    while IFS='|' read -r call args; do
      [[ -n "$call" ]] && echo "  OUT=$OUT/item-$n-${NAMES[n - 1]}/$call bash $KIT $args$( ((CPU)) && echo " --dry-run") --budget-s <left>"
    done <<<"$calls"
  done
  echo "total: ${total}s of run time"
  exit 0
fi

record() {  # record EVENT ITEM key=value...: append one JSON record to results.jsonl, redo results.md
  python3 - "$RESULTS" "$OUT/results.md" "$@" <<'PYEOF'
import json, os, sys, time

results, table, event, item, *pairs = sys.argv[1:]
rec = {"event": event, "item": int(item), "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
for pair in pairs:
    key, _, value = pair.partition("=")
    rec[key] = value.splitlines() if key == "summary" else int(value) if value.lstrip("-").isdigit() else value
with open(results, "a") as f:
    f.write(json.dumps(rec) + "\n")
    f.flush()
    os.fsync(f.fileno())
rows, started = {}, {}
for line in open(results):
    r = json.loads(line)
    if r["event"] == "start":
        started[r["item"]] = r
    elif r["event"] == "end":
        rows[r["item"]] = r
lines = ["# GPU validation", "", "| item | name | limit s | seconds | outcome | summary |", "|---:|---|---:|---:|---|---|"]
for n in sorted(set(started) | set(rows)):
    r = rows.get(n) or {**started[n], "outcome": "running (or cut before it ended)", "seconds": ""}
    summary = "<br>".join(s.replace("|", "\\|") for s in r.get("summary", [])[:8])
    lines.append(f"| {n} | {r['name']} | {r['limit_s']} | {r.get('seconds', '')} | {r['outcome']} | {summary} |")
with open(table + ".tmp", "w") as f:
    f.write("\n".join(lines) + "\n")
os.replace(table + ".tmp", table)
PYEOF
}

summary_of() {  # the lines of an item's reports that say what it found
  local dir=$1
  grep -hE "^(run |accuracy:|rollout tokens/s|registration:|champion alias:|error:)|[0-9]+ (passed|failed|skipped|error)|^GPTQ:|^Quality report:|^\| (7b|tiny)[^|]* \| |not started|cut off" \
    "$dir"/*/gpu-check.md "$dir"/*/vllm.md "$dir"/*/gpu.md 2>/dev/null | sed -E "s/^=+ | =+$//g" | awk "!seen[\$0]++" | head -20
}

CHILD=
CURRENT=
SETSID=$(command -v setsid || true)  # without it, a stop reaches the kit's own process only
on_signal() {  # the run itself is being stopped: say so for the item in progress, stop its kit call
  [[ -n "$CHILD" ]] && { kill -TERM -- "-$CHILD" 2>/dev/null || kill -TERM "$CHILD" 2>/dev/null; }
  [[ -n "$CURRENT" ]] && record end "$CURRENT" name="${NAMES[CURRENT - 1]}" limit_s="${LIMITS[CURRENT - 1]}" \
    seconds=$((SECONDS - ITEM_T0)) outcome="cut (the run was stopped)" exit=143
  exit 5
}
trap on_signal TERM INT

: >"$RESULTS"
echo "gpu_validate: python $PY, results in $OUT (results.jsonl, results.md)" >&2
FAILED=0
CUT=0
for n in "${ITEMS[@]}"; do
  name=${NAMES[n - 1]}
  limit=${LIMITS[n - 1]}
  dir=$OUT/item-$n-$name
  rm -rf "$dir"
  mkdir -p "$dir"
  CURRENT=$n
  ITEM_T0=$SECONDS
  DEADLINE=$((SECONDS + limit))
  record start "$n" name="$name" limit_s="$limit"
  echo "gpu_validate: item $n $name (limit ${limit}s)" >&2
  calls=$(item_calls "$n")
  if [[ -z "$calls" ]]; then
    record end "$n" name="$name" limit_s="$limit" seconds=0 outcome=skipped exit=0 summary="$(nf4_reason)"
    CURRENT=
    continue
  fi
  outcome=passed
  rc=0
  ran=0 worst=0
  while IFS='|' read -r call args; do
    left=$((DEADLINE - SECONDS))
    if ((left < MIN_S)); then
      echo "$call: not started (${left}s of the item's ${limit}s left)" >"$dir/$call.not-started"
      [[ "$outcome" == passed ]] && outcome="cut"
      continue
    fi
    mkdir -p "$dir/$call"
    ran=1
    read -ra argv <<<"$args"
    ((CPU)) && argv+=(--dry-run)
    # its own process group, so that a stop reaches every process the kit started
    OUT=$dir/$call $SETSID timeout -s TERM -k 10 $((left + 15)) bash "$KIT" "${argv[@]}" --budget-s "$left" \
      >"$dir/$call/console.txt" 2>&1 &
    CHILD=$!
    wait "$CHILD"
    rc=$?
    CHILD=
    case $rc in
      0) ;;
      5|124|137) [[ "$outcome" == passed ]] && outcome=cut ;;
      *) outcome=failed ;;
    esac
    if ((rc != 0 && worst == 0)); then worst=$rc; fi  # the record's exit: the first call that did not pass
  done <<<"$calls"
  rc=$worst
  ((ran)) || outcome="not started"
  summary=$(summary_of "$dir"; cat "$dir"/*.not-started 2>/dev/null)
  [[ "$outcome" == failed ]] && FAILED=1
  [[ "$outcome" == cut || "$outcome" == "not started" ]] && CUT=1
  record end "$n" name="$name" limit_s="$limit" seconds=$((SECONDS - ITEM_T0)) outcome="$outcome" exit="$rc" \
    report="item-$n-$name" summary="$summary"
  echo "gpu_validate: item $n $name: $outcome ($((SECONDS - ITEM_T0))s)" >&2
  CURRENT=
done
echo "gpu_validate: done: $OUT/results.md" >&2
((FAILED)) && exit 1
((CUT)) && exit 5
exit 0
