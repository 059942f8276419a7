"""The benchmarks' results sections name the code they measured (``benchmarks.write_section``)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

import benchmarks


def _git(cwd, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_a_section_names_its_commit_and_says_when_the_tree_had_changes(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "code.py").write_text("x = 1\n")
    (repo / "BENCHMARKS.md").write_text("# Benchmarks\n")
    _git(repo, "add", "code.py")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    commit = _git(repo, "rev-parse", "--short", "HEAD")
    monkeypatch.setattr(benchmarks, "ROOT", repo)

    out = tmp_path / "results" / "x.md"
    out.parent.mkdir()
    benchmarks.write_section(out, "## X\n\n| a |\n")
    text = out.read_text()
    assert text.startswith("## X\n\n| a |\n\nMeasured at commit ") and f"commit {commit}, " in text
    assert "uncommitted" not in text
    _git(repo, "add", "BENCHMARKS.md")  # tracked, as results are
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "two")
    commit = _git(repo, "rev-parse", "--short", "HEAD")
    (repo / "BENCHMARKS.md").write_text("rewritten by a benchmark\n")
    assert benchmarks.provenance().startswith(f"commit {commit}, ")  # a benchmark's output is not code
    (repo / "code.py").write_text("x = 2\n")
    assert f"commit {commit} + uncommitted changes, " in benchmarks.provenance()
    monkeypatch.setattr(benchmarks, "ROOT", tmp_path / "results")  # not a checkout
    assert benchmarks.provenance().startswith("commit unknown (not a git checkout)")


def test_bench_vllm_reads_vllms_memory_log_and_sets_the_plan_beside_it():
    """What the GPU kit compares (issue 23 step 4): vLLM's start-up log lines, read as vLLM words them
    (the last of each), beside ``qerl plan``'s rows for the same model and engine config."""
    from qerl.pipeline.planning.memory_plan import VLLM_ROWS, vllm_share
    from qerl.pipeline.planning.model_shape import KNOWN_SHAPES
    from qerl.pipeline.rollout.config import RolloutConfig

    from benchmarks.bench_vllm import MODELS, tiny_model_sizes
    from benchmarks.vllm_report import report, vllm_reported

    log = (
        "INFO 11-26 [gpu_model_runner.py:5150] Model loading took 0.98 GiB memory and 2.100000 seconds\n"
        "INFO 11-26 [gpu_worker.py:760] Available KV cache memory: 31.5 GiB\n"
        "INFO 11-26 [kv_cache_utils.py:2328] GPU KV cache size: 2,752,512 tokens, Maximum concurrency ...\n"
        "INFO 11-26 [gpu_model_runner.py:6582] Graph capturing finished in 6 secs, took 0.24 GiB\n"
        "INFO 11-26 [gpu_worker.py:760] Available KV cache memory: 31.25 GiB\n"
    )
    assert vllm_reported(log) == {
        "weights": 0.98, "kv_cache": 31.25, "cuda_graphs": 0.24, "kv_cache_tokens": 2752512.0
    }  # fmt: skip
    assert vllm_reported("no memory lines") == {}
    for name in MODELS:  # FP4 Marlin's tiles: every projection's output % 64, input % 128
        z = tiny_model_sizes(name)
        kv_out = z["num_kv_heads"] * z["hidden_size"] // z["num_heads"]
        assert all(d % 64 == 0 for d in (z["hidden_size"], kv_out, z["intermediate_size"])), name
        assert all(d % 128 == 0 for d in (z["hidden_size"], z["intermediate_size"])), name
    shape, gpu = KNOWN_SHAPES["qwen2.5-0.5b"], 80 * 2**30
    cfg = RolloutConfig(gpu_memory_utilization=0.5, enforce_eager=False)
    nvfp4, bf16 = vllm_share(shape, cfg, gpu, "nvfp4"), vllm_share(shape, cfg, gpu, "bf16")
    assert tuple(nvfp4) == VLLM_ROWS and nvfp4["weights"] < bf16["weights"]
    assert abs(sum(nvfp4.values()) - 0.5 * gpu) < 1  # the KV cache gets the rest of the share
    arm = {
        "mode": "vllm-nvfp4-marlin",
        "startup_s": 40.0,
        "seconds": 2.0,
        "tokens": 4000,
        "tokens_per_s": 2000.0,
    }
    results = {
        "mode": "cuda", "prompts": 16, "n": 8, "max_new_tokens": 256, "machine": "H100",
        "models": {"0.5b": {
            "nvfp4": {**arm, "planned_gib": {k: v / 2**30 for k, v in nvfp4.items()}, "reported": vllm_reported(log)},
            "bf16": {**arm, "mode": "vllm-unquantized", "tokens_per_s": 1000.0},
            "nvfp4-aqn": {**arm, "tokens_per_s": 1900.0, "aqn_sigma": 5e-4, "aqn_sigma_realised": 4.9e-4},
        }},
    }  # fmt: skip
    text = report(results)
    assert "| 0.5b | nvfp4 | vllm-nvfp4-marlin | 40.0 | 4000 | 2.00 | 2000 | 2.00x of bf16 |" in text
    assert (
        "| 0.5b | nvfp4-aqn | vllm-nvfp4-marlin | 40.0 | 4000 | 2.00 | 1900 | 0.95x of nvfp4; realised sigma 0.980x |"
        in text
    )
    assert f"| 0.5b | nvfp4 | kv_cache | {nvfp4['kv_cache'] / 2**30:.2f} | 31.25 |" in text
    # with repeats the median call counts and the range is given
    results["repeats"] = 3
    results["models"]["0.5b"]["bf16"]["seconds_all"] = [2.1, 1.9, 2.0]
    text = report(results)
    assert "generate s: the median of 3 calls (min-max)" in text
    assert "| 0.5b | bf16 | vllm-unquantized | 40.0 | 4000 | 2.00 (1.90-2.10) | 1000 |  |" in text


def test_bench_vllm_plans_an_arm_from_the_model_directory_it_served(tmp_path):
    """The CUDA arm's plan rows, from the config.json of the model it built: the only branch of an
    arm that runs after its measurement, and CUDA-only in the arm, so checked here."""
    from qerl.pipeline.planning.memory_plan import VLLM_ROWS
    from qerl.pipeline.rollout.config import RolloutConfig

    from benchmarks.bench_vllm import planned_gib, tiny_model_sizes

    z = tiny_model_sizes("0.5b")
    config = {
        "architectures": ["Qwen2ForCausalLM"], "hidden_size": z["hidden_size"],
        "num_hidden_layers": z["num_layers"], "num_attention_heads": z["num_heads"],
        "num_key_value_heads": z["num_kv_heads"], "intermediate_size": z["intermediate_size"],
        "vocab_size": 4096, "tie_word_embeddings": z["tie_word_embeddings"],
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    cfg = RolloutConfig(gpu_memory_utilization=0.5, enforce_eager=False)
    gpu = 139.8 * 2**30
    nvfp4, bf16 = planned_gib(tmp_path, cfg, gpu, "nvfp4-aqn"), planned_gib(tmp_path, cfg, gpu, "bf16")
    assert tuple(nvfp4) == VLLM_ROWS and 0 < nvfp4["weights"] < bf16["weights"]
    assert abs(sum(nvfp4.values()) - 0.5 * 139.8) < 1e-6  # GiB: the KV cache gets the rest of the share


def test_bench_vllm_reuses_a_kept_model_and_merges_a_leases_arms(tmp_path, monkeypatch):
    """A later call of a lease reuses the model an earlier call built (minutes at 7B) unless its
    shape or its build differs, and keeps the arms measured on the same machine with the same
    settings and code, not failed ones, another machine's or those of code changed in between."""
    import qerl.pipeline.demo.tiny_model as tiny_model

    from benchmarks.bench_vllm import TINY, bench_code, bench_model, earlier_arms

    builds = []
    real = tiny_model.build_tiny_model
    monkeypatch.setattr(
        tiny_model, "build_tiny_model", lambda out, **kw: builds.append(out) or real(out, **kw)
    )
    out = tmp_path / "0.5b"
    bench_model(out, TINY, vocab_size=512)
    weights = (out / "model.safetensors").read_bytes()
    assert bench_model(out, TINY, vocab_size=512) == out and len(builds) == 1  # reused
    bench_model(out, {**TINY, "num_layers": 1}, vocab_size=512)  # another shape: rebuilt
    assert len(builds) == 2
    (out / "bench_vllm_model.json").unlink()  # a build cut off before its marker: rebuilt
    bench_model(out, TINY, vocab_size=512)
    assert len(builds) == 3 and (out / "model.safetensors").read_bytes() == weights

    settings = {"mode": "cuda", "machine": "NVIDIA H200", "torch": "2.11.0+cu130", "prompts": 16,
                "n": 8, "max_new_tokens": 256, "repeats": 3, "code": bench_code()}  # fmt: skip
    earlier = {
        **settings,
        "models": {"0.5b": {"nvfp4": {"tokens_per_s": 18072.0}, "bf16": {"error": "cut off"}}},
    }
    path = tmp_path / "vllm.json"
    assert earlier_arms(path, settings) == {}  # no earlier run
    path.write_text(json.dumps(earlier))
    assert earlier_arms(path, settings) == {"0.5b": {"nvfp4": {"tokens_per_s": 18072.0}}}
    assert earlier_arms(path, {**settings, "machine": "NVIDIA H100 80GB HBM3"}) == {}
    assert earlier_arms(path, {**settings, "code": "0" * 16}) == {}  # a fix between two calls


def test_bench_vllm_code_version_follows_the_modules_its_arms_run(tmp_path, monkeypatch):
    """The engine module the arms serve through is in the hash (the factory imports it by name at
    run time), so a fix there between two calls of a lease keeps their arms apart."""
    import qerl.pipeline.rollout.vllm_engine as engine
    from qerl.pipeline.store import code_version

    from benchmarks.bench_vllm import bench_code

    before = bench_code()
    edited = tmp_path / "vllm_engine.py"
    edited.write_text(Path(engine.__file__).read_text() + "\nFIXED = True\n")
    real = code_version._module_file
    monkeypatch.setattr(
        code_version,
        "_module_file",
        lambda name: (str(edited), False) if name == engine.__name__ else real(name),
    )
    assert bench_code() != before


def test_bench_vllm_shortens_a_model_by_its_layers_and_says_so_in_its_name():
    from benchmarks.bench_vllm import bench_shapes, tiny_model_sizes

    full = tiny_model_sizes("7b")
    assert bench_shapes(["0.5b", "7b"]) == {"0.5b": tiny_model_sizes("0.5b"), "7b": full}
    short = bench_shapes(["7b"], layers=4)
    assert short == {"7b-4l": {**full, "num_layers": 4}}  # every matrix keeps 7B's shape
    assert bench_shapes(["7b"], layers=full["num_layers"]) == {"7b": full}
    with pytest.raises(ValueError, match="--layers must be at least 1"):
        bench_shapes(["7b"], layers=0)


def test_benchmarks_md_is_what_the_sections_assemble_to():
    """BENCHMARKS.md is generated: a hand edit there is lost at the next `qerl bench`. Edit the
    section in benchmarks/results/ and run `python -m benchmarks.collect`."""
    from benchmarks.collect import ROOT, assemble

    assert (ROOT / "BENCHMARKS.md").read_text() == assemble(), (
        "BENCHMARKS.md differs from benchmarks/results/*.md: edit the section there, then run "
        "`python -m benchmarks.collect`"
    )


def test_bench_vllm_names_the_root_cause_of_a_failed_engine():
    """vLLM's engine core fails in its own process; the parent's last lines only say "Engine core
    initialization failed" (what an H200 run reported, hiding a missing module)."""
    from benchmarks.vllm_report import root_cause

    log = (
        "(EngineCore pid=7) Traceback (most recent call last):\n"
        '(EngineCore pid=7)   File "sampler.py", line 44, in flashinfer_sampler_supported\n'
        "(EngineCore pid=7) ModuleNotFoundError: No module named 'flashinfer'\n"
        "Traceback (most recent call last):\n"
        "RuntimeError: Engine core initialization failed. See root cause above.\n"
    )
    assert root_cause(log) == (
        "(EngineCore pid=7) ModuleNotFoundError: No module named 'flashinfer' ... "
        "RuntimeError: Engine core initialization failed. See root cause above."
    )
    assert root_cause("line 1\nkilled\n") == "line 1 | killed"
