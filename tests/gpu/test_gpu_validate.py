"""scripts/gpu/gpu_validate.sh, the GPU checks as one prepared script, on the CPU: its options, the
items' order and time limits, and that a run cut after any item leaves a results file listing every
item that finished. A stand-in for gpu_check.sh (QERL_GPU_VALIDATE_KIT) takes the GPU's place, so no
test here needs one; tests/gpu/test_*.py's own dry runs check gpu_check.sh itself."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu" / "gpu_validate.sh"
ORDER = ["qerl-run", "marlin-7b", "padded", "aqn-det-7b", "gptq-7b", "nf4"]

# gpu_check.sh's stand-in: logs its arguments, writes a report, sleeps $FAKE_SLEEP (default 0) seconds,
# and honours --budget-s as the kit does (exit 5 when the sleep would outrun it)
FAKE_KIT = """#!/usr/bin/env bash
echo "$*" >>"$FAKE_CALLS"
budget=0; prev=
for a in "$@"; do [[ "$prev" == --budget-s ]] && budget=$a; prev=$a; done
mkdir -p "$OUT"
printf '# GPU check\\n\\nmode: fake\\n\\n3 passed in 0.1s\\n' >"$OUT/gpu-check.md"
if (( ${FAKE_SLEEP:-0} > budget )); then sleep "$budget"; exit 5; fi
sleep "${FAKE_SLEEP:-0}"
exit "${FAKE_RC:-0}"
"""


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    kit = tmp_path / "fake_kit.sh"
    kit.write_text(FAKE_KIT)
    return {
        **os.environ,
        "OUT": str(tmp_path / "out"),
        "QERL_GPU_VALIDATE_KIT": str(kit),
        "FAKE_CALLS": str(tmp_path / "calls.txt"),
        "PYTHON": sys.executable,
        **extra,
    }


def _records(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]


def test_help_says_what_a_user_runs_and_lists_the_items_in_order():
    out = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True, check=True).stdout
    assert "bash scripts/gpu/gpu_validate.sh" in out and "requirements/gpu.txt" in out
    listed = re.findall(r"^#?\s+([1-6]) ([a-z0-9-]+)\s+(\d+) s ", out, re.M)
    assert [int(n) for n, _, _ in listed] == [1, 2, 3, 4, 5, 6]
    assert [name for _, name, _ in listed] == ORDER
    limits = [int(s) for _, _, s in listed]
    assert sum(limits[:5]) <= 12 * 60, "items 1-5 fit about 12 minutes of run time"


def test_the_dry_run_prints_the_items_in_priority_order_and_runs_nothing(tmp_path):
    env = _env(tmp_path)
    out = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run"], capture_output=True, text=True, env=env, check=True
    )
    items = re.findall(r"^item (\d) ([a-z0-9-]+) \(limit (\d+)s\)$", out.stdout, re.M)
    assert [(int(n), name) for n, name, _ in items] == list(enumerate(ORDER, start=1))
    total = int(re.search(r"^total: (\d+)s of run time$", out.stdout, re.M).group(1))
    assert total == sum(int(s) for _, _, s in items) and sum(int(s) for _, _, s in items[:5]) <= 720
    text = out.stdout
    # what each item runs, in order: qerl run first, then the 7B Marlin/bf16 arms, the padded test, ...
    assert text.index("--run-only --run-config demo-gpu") < text.index("--vllm-arms nvfp4,bf16")
    assert text.index("--vllm-arms nvfp4,bf16") < text.index("tests/gpu/test_gpu_vllm_padded.py")
    assert text.index("tests/gpu/test_gpu_vllm_padded.py") < text.index("--arms nvfp4,nvfp4-det")
    assert text.index("--arms nvfp4,nvfp4-det") < text.index("--vllm-arms nvfp4-aqn")
    assert text.index("--vllm-arms nvfp4-aqn") < text.index("gpu_quantize_7b.py")
    assert "--vllm-layers 4 --vllm-prompts 16 --vllm-n 8" in text  # 7B's matrices, 128 sequences
    assert text.index("gpu_quantize_7b.py") < text.index("--vllm-arms nf4 ")  # QLoRA's rollouts, last
    assert text.index("--vllm-arms nf4 ") < text.index("--models 7b --arms nf4 ")  # then its GRPO update
    assert "skipped:" not in text  # bench_vllm.py has its nf4 arm, so item 6 runs
    assert not (tmp_path / "calls.txt").exists() and not (tmp_path / "out" / "results.jsonl").exists()


def test_options_are_checked_before_anything_runs(tmp_path):
    env = _env(tmp_path)

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env)

    sub = run("--dry-run", "--items", "5,2", "--limit", "2=30", "--concurrency", "256")
    assert sub.returncode == 0
    assert re.findall(r"^item (\d)", sub.stdout, re.M) == ["2", "5"], "a subset keeps the order"
    assert "item 2 marlin-7b (limit 30s)" in sub.stdout and "--vllm-prompts 32 --vllm-n 8" in sub.stdout
    for bad, says in (
        (["--items", "7"], "--items takes item numbers 1-6"),
        (["--limit", "9=10"], "--limit takes N=SECONDS"),
        (["--concurrency", "100"], "--concurrency takes a multiple of 8"),
        (["--bogus"], "unknown option '--bogus'"),
    ):
        proc = run(*bad)
        assert proc.returncode == 2 and says in proc.stderr, (bad, proc.stderr)
    assert not (tmp_path / "calls.txt").exists()


def test_each_item_records_when_it_ends_and_the_outcomes_follow_the_kits_exit(tmp_path):
    """Every item appends a start and an end record; the kit's exit 5 (its budget cut a part) is a cut
    item, another non-zero exit a failed one. (Item 6 would be skipped, with the reason, by a kit whose
    bench_vllm.py has no NF4 arm; this one has it.)"""
    env = _env(tmp_path)
    proc = subprocess.run(["bash", str(SCRIPT), "--limit", "3=2"], capture_output=True, text=True, env=env)
    assert proc.returncode == 5, proc.stderr  # item 3's 2 s are under the 20 s a kit call needs
    ends = {r["item"]: r for r in _records(tmp_path) if r["event"] == "end"}
    assert [r["name"] for r in ends.values()] == ORDER
    assert ends[1]["outcome"] == "passed" and "3 passed in 0.1s" in ends[1]["summary"]
    assert ends[3]["outcome"] == "not started"
    assert ends[6]["outcome"] == "passed"
    calls = (tmp_path / "calls.txt").read_text().splitlines()
    assert len(calls) == 7 and all(re.search(r"--budget-s \d+$", c) for c in calls)  # 1, 2, 4 and 6 twice, 5
    assert "--vllm-arms nf4 " in calls[-2] and "--arms nf4 " in calls[-1]
    table = (tmp_path / "out" / "results.md").read_text()
    assert re.search(r"^\| 1 \| qerl-run \| 260 \| \d+ \| passed \|", table, re.M)
    failed = subprocess.run(["bash", str(SCRIPT), "--items", "1"], capture_output=True, text=True,
                            env={**env, "FAKE_RC": "1"})  # fmt: skip
    assert failed.returncode == 1
    assert [r["outcome"] for r in _records(tmp_path) if r["event"] == "end"] == ["failed"]


@pytest.mark.parametrize("stop_in", [2, 3])
def test_a_run_stopped_during_an_item_keeps_every_item_that_finished(tmp_path, stop_in):
    """Stopped (SIGTERM, as a time limit stops it) while item ``stop_in`` runs: results.jsonl and
    results.md list the items before it as finished, and that item as cut."""
    env = _env(tmp_path)
    calls = tmp_path / "calls.txt"
    slow = {**env, "FAKE_SLEEP": "30"}  # each kit call outlasts its item unless its budget cuts it
    script = f"""
n=0
for i in $(seq 300); do
  n=$(grep -c . "{calls}" 2>/dev/null || true)
  [[ "$n" -ge {stop_in} ]] && break
  sleep 0.1
done
"""
    # the items before stop_in end by their 1 s limits; stop_in's own 60 s outlasts the stop however
    # slowly the machine gets to it
    limits = [arg for n in (1, 2, 3) for arg in ("--limit", f"{n}={1 if n < stop_in else 60}")]
    proc = subprocess.Popen(["bash", str(SCRIPT), "--items", "1,2,3", *limits],
                            env={**slow, "QERL_GPU_ITEM_MIN_S": "0"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    subprocess.run(["bash", "-c", script], timeout=60, check=True)
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    assert proc.returncode == 5
    records = _records(tmp_path)
    ends = {r["item"]: r["outcome"] for r in records if r["event"] == "end"}
    finished = {n: ends[n] for n in range(1, stop_in)}
    assert finished == dict.fromkeys(range(1, stop_in), "cut"), ends  # their 1 s limits cut them
    assert ends[stop_in] == "cut (the run was stopped)"
    assert stop_in + 1 not in ends and all(r["item"] <= stop_in for r in records)
    table = (tmp_path / "out" / "results.md").read_text()
    assert f"| {stop_in} | {ORDER[stop_in - 1]} |" in table and "cut (the run was stopped)" in table


@pytest.mark.kit
@pytest.mark.slow  # about a minute: two of the kit's own dry runs on the CPU
def test_the_cpu_wiring_check_runs_the_kit_itself(tmp_path):
    """--cpu: the real gpu_check.sh at tiny shapes for the padded test, the quantize item and the NF4
    item (its rollouts and its GRPO update)."""
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(SCRIPT), "--cpu", "--items", "3,5,6"], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=400)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    ends = {r["item"]: r for r in _records(tmp_path) if r["event"] == "end"}
    assert [ends[n]["outcome"] for n in (3, 5, 6)] == ["passed", "passed", "passed"]
    (vllm,) = (tmp_path / "out" / "item-6-nf4").rglob("vllm.json")  # QLoRA's arm, on the CPU its twin
    arms = [a for model in json.loads(vllm.read_text())["models"].values() for a in model.values()]
    assert [(a["arm"], a["mode"], a["tokens"] > 0) for a in arms] == [("nf4", "vllm-nf4-emulated", True)]
    (gpu,) = (tmp_path / "out" / "item-6-nf4").rglob("gpu.json")  # then its GRPO update, on Linear4bit
    (train,) = json.loads(gpu.read_text())["train"]
    assert train["arm"] == "nf4" and "Linear4bit" in train["layers"] and train["times"], train
    assert any(s.startswith("GPTQ: ") for s in ends[5]["summary"]), ends[5]
    data = json.loads((tmp_path / "out" / "item-5-gptq-7b" / "quantize" / "quantize-7b.json").read_text())
    assert data["device"] == "cpu" and data["gptq"]["tensors"] > 0 and data["quality"]["tokens"] > 0


def test_the_quantize_item_projects_the_whole_7b_from_its_layers():
    sys.path.insert(0, str(ROOT / "scripts" / "gpu"))
    import gpu_quantize_7b as q

    per_layer = q.layer_params(q.SHAPE_7B)
    assert 233_000_000 < per_layer < 234_000_000  # Qwen2.5-7B's 7.07B of non-embedding weights / 28
    whole = q.projected_peak(0, q.SHAPE_7B, 28, q.VOCAB_7B)
    assert whole == 0
    one = q.projected_peak(0, q.SHAPE_7B, 1, 4096)
    assert one == 27 * per_layer * 4 + (q.VOCAB_7B - 4096) * 3584 * 8
