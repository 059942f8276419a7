"""The trainer's threads next to a vLLM engine (issue 12): what an engine start may not leave behind in
the trainer's process, and one core per intra-op thread during a train step. Timings live in
benchmarks/bench_contention.py; these tests check the state that decides them."""

from __future__ import annotations

import os
import threading

import pytest
import torch
from qerl.pipeline.runtime.threads import (
    THREAD_ENV,
    intra_op_thread_ids,
    pinned_intra_op_threads,
    preserved_thread_state,
    snapshot,
)


def _thread_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if THREAD_ENV.match(k)}


def _thread_names() -> list[str]:
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as fh:
                names.append(fh.read().strip())
        except OSError:
            pass
    return names


@pytest.fixture
def two_threads():
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two allowed CPUs")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    torch.ones(1 << 20).add_(1)  # start the pool
    yield
    torch.set_num_threads(before)


def test_intra_op_threads_get_one_cpu_each_and_it_is_undone(two_threads):
    ids = intra_op_thread_ids(2)
    assert ids is not None and ids[0] == threading.get_native_id()  # the master is this thread
    tasks_before = set(os.listdir("/proc/self/task"))
    free = {tid: os.sched_getaffinity(tid) for tid in ids.values()}
    x = torch.randn(512, 512, generator=torch.Generator().manual_seed(0))
    reference = x @ x
    with pinned_intra_op_threads("cpu") as pins:
        assert set(pins) == set(ids.values())
        assert len(set(pins.values())) == 2
        assert {tid: os.sched_getaffinity(tid) for tid in pins} == {t: {c} for t, c in pins.items()}
        assert torch.equal(x @ x, reference)  # same static split of the work, same bits
    assert {tid: os.sched_getaffinity(tid) for tid in ids.values()} == free
    # the threads found are torch's own pool: running torch ops started no other thread
    assert set(os.listdir("/proc/self/task")) == tasks_before
    with pinned_intra_op_threads("cuda:0") as pins:
        assert pins == {}


def test_preserved_thread_state_undoes_what_the_block_changed(two_threads, monkeypatch, caplog):
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    original = torch.set_num_threads
    with caplog.at_level("INFO", logger="qerl.threads"), preserved_thread_state("a test block"):
        os.environ["LD_PRELOAD"] = "/x/libgomp.so.1"  # what vLLM's CPU platform does
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
        torch.set_num_threads = lambda n: None  # what vLLM's in-process CPU worker does
    assert torch.set_num_threads is original
    assert "LD_PRELOAD" not in os.environ and os.environ["OMP_NUM_THREADS"] == "2"
    assert torch.get_num_threads() == 2
    assert "LD_PRELOAD='/x/libgomp.so.1' -> None" in caplog.text and "after a test block" in caplog.text


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory(dtype=torch.float32)


@pytest.mark.parametrize(
    "in_process", [True, pytest.param(False, marks=pytest.mark.slow, id="multiprocess")], ids=str
)
def test_engine_start_leaves_the_trainer_thread_state_alone(model_dir, in_process, two_threads):
    from qerl.pipeline.rollout.config import RolloutConfig
    from qerl.pipeline.rollout.factory import build_engine
    from qerl.pipeline.rollout.protocol import SamplingSpec
    from qerl.pipeline.store.manifest import Manifest

    twin = Manifest(
        stage="dequantize", key="test", config={}, inputs={}, code_version="test", files={}, created_at="",
        mode="nvfp4-dequantized-twin", path=str(model_dir),
    )  # fmt: skip

    cfg = RolloutConfig(
        dtype="float32", enforce_eager=True, max_new_tokens=4, max_model_len=64, kv_cache_gib=0.125,
        template="terse", enable_lora=False, in_process=in_process,
    )  # fmt: skip
    before, env, setter = snapshot(), _thread_env(), torch.set_num_threads
    for _ in range(2 if in_process else 1):  # in-process twice: a closed engine's groups are gone
        engine = build_engine(cfg, None, twin)
        try:
            assert engine.generate(["1+1="], 1, SamplingSpec(max_new_tokens=4, logprobs=False), 0)
            assert torch.set_num_threads is setter
            assert _thread_env() == env
            assert torch.get_num_threads() == before.torch_threads
            after = {
                tid: cpus for tid, cpus in snapshot().task_affinity.items() if tid in before.task_affinity
            }
            assert after == {t: c for t, c in before.task_affinity.items() if t in after}
            torch.set_num_threads(1)  # the trainer still chooses its thread count
            assert torch.get_num_threads() == 1
            torch.set_num_threads(before.torch_threads)
        finally:
            engine.close()
        assert not [n for n in _thread_names() if n.startswith(("gloo", "pt_gloo"))]


def test_fresh_process_threading_undoes_what_set_num_threads_did_to_mkl_and_restores_it(two_threads):
    """``torch.set_num_threads`` turns MKL's dynamic mode off and sets a thread-local MKL count (the
    trigger of issue 12's nested teams); the train step's context puts a fresh process's values back
    for its duration, with nested OpenMP teams off, and leaves everything as it found it."""
    from qerl.pipeline.runtime.threads import _torch_libgomp, _torch_mkl, fresh_process_threading

    gomp, mkl = _torch_libgomp(), _torch_mkl()
    if gomp is None or mkl is None:
        pytest.skip("this torch build has no libgomp/MKL")
    torch.set_num_threads(2)
    assert mkl.mkl_serv_get_dynamic() == 0  # what ATen's set_num_threads does
    levels = gomp.omp_get_max_active_levels()
    with fresh_process_threading() as old:
        assert old == {"max_active_levels": levels, "mkl_dynamic": 0, "mkl_local_threads": 2}
        assert gomp.omp_get_max_active_levels() == 1
        assert mkl.mkl_serv_get_dynamic() == 1
        x = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
        assert torch.isfinite(x @ x).all()
    assert gomp.omp_get_max_active_levels() == levels and mkl.mkl_serv_get_dynamic() == 0
    assert mkl.MKL_Set_Num_Threads_Local(2) == 2  # the thread-local count is back (returns the old one)


@pytest.mark.slow
def test_train_step_next_to_a_live_engine_starts_no_thread_per_gemm(tmp_path, monkeypatch):
    """The cause of issue 12, counted with the benchmark's own child (a live vLLM engine in worker
    processes, then demo-shaped train steps): a bare step creates thousands of tasks (MKL's nested
    OpenMP team per GEMM); a step in the train stage's ``trainer_threads`` right after it, in the
    same process, creates none. Pinning alone, the earlier fix, did not stop it once a bare step had
    run (bench_contention.py). Counts, not times. The child decodes NVFP4 on numba's OpenMP layer,
    as it did when the issue was found: on the default ``workqueue`` layer even a bare step starts
    no threads (BENCHMARKS.md), which would leave the reset untested."""
    import json
    import sys
    from pathlib import Path

    import pyarrow.parquet as pq

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import bench_contention

    inputs = bench_contention.make_inputs(tmp_path)
    # the first 4 of its 16 groups: one minibatch of 32 where the benchmark has four (a bare step
    # still starts thousands of tasks)
    pq.write_table(pq.read_table(inputs["scored"]).slice(0, 32), inputs["scored"])
    paths = tmp_path / "paths.json"
    paths.write_text(json.dumps(inputs))
    monkeypatch.setenv("NUMBA_THREADING_LAYER", "omp")
    child = bench_contention._start("engine", paths, in_process=False)
    try:
        steps = {}
        for arm in ("bare", "stage", "stage"):
            child.stdin.write(arm + "\n")
            child.stdin.flush()
            steps.setdefault(arm, []).append(bench_contention._answer(child)["tasks"])
            if steps["bare"][0] < 1000:  # nothing to show here: skip before the stage's steps
                break
    finally:
        child.stdin.write("quit\n")
        child.stdin.close()
        child.wait(timeout=120)
    if steps["bare"][0] < 1000:
        pytest.skip(f"MKL on this machine did not nest without the fix either: {steps}")
    assert max(steps["stage"]) < 200, steps
