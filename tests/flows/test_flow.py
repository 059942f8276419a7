"""The RL flow end to end on a tiny model: real Prefect (ephemeral), real vLLM, real MLflow.

The crash test SIGKILLs real ``qerl run`` processes inside rollout, score and train (the
``QERL_FAULT`` hook kills the process after a stage wrote its outputs but before its manifest, the
worst moment), re-runs the same command, and requires (a) a final adapter bit-identical to an
uninterrupted run's in another work directory and (b) no (stage, key) built twice, from the
store's build journal.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import yaml
from qerl.pipeline.config import ConfigError
from qerl.pipeline.planning.run_config import PRESET_DIR, load_run_config, preset_names


def tiny_run_config(model_dir: Path, engine: str = "hf") -> dict:
    return {
        "model": {"source": str(model_dir)},
        "data": {"dataset": "arithmetic", "levels": [1], "template": "terse", "arithmetic_size": 32},
        "rollout": {
            "engine": engine,
            "n_samples": 4,
            "max_new_tokens": 6,
            "max_model_len": 96,
            "template": "terse",
            "dtype": "float32",
            "kv_cache_gib": 0.25,
            "enforce_eager": True,
            "max_lora_rank": 8,
            "in_process": False,
            "max_num_seqs": 16,
        },  # fmt: skip
        "reward": {"answer_format": "answer_tags", "workers": 1},
        "train": {
            "lora_r": 8,
            "lora_alpha": 16,
            "lr": 1e-3,
            "total_steps": 3,
            "minibatch_size": 8,
            "dtype": "float32",
        },
        "eval": {
            "benchmark": {"dataset": "arithmetic", "levels": [1], "template": "terse", "arithmetic_size": 4},
            "k": 1,
            "max_new_tokens": 6,
        },  # fmt: skip
        "aqn": {"num_stages": 3},
        "loop": {"name": "tiny", "steps": 3, "prompts_per_step": 2, "eval_every": 0, "eval_base": False},
    }


def _qerl(
    args: list[str],
    work: Path,
    fault: str | None = None,
    source: Path | None = None,
    own_server: bool = False,
) -> subprocess.CompletedProcess:
    """Run the CLI in its own session; output goes to files, not pipes, because a SIGKILLed run
    leaves children (Prefect's temporary server, verifier workers) that would hold pipes open.
    The whole process group is killed afterwards, as a supervisor would after a crash. ``source``:
    a folder holding another ``qerl`` package to run instead of the installed one (an upgrade).
    The run talks to the test process's Prefect server (``prefect_home.shared_api_url``) unless the
    environment names one or ``own_server`` asks for the temporary server a user's run starts."""
    from prefect_home import seeded_env, shared_api_url

    env = seeded_env({**os.environ, "QERL_WORK_DIR": str(work)}, work)
    if not own_server and "PREFECT_API_URL" not in env:
        env["PREFECT_API_URL"] = shared_api_url()
    env.pop("QERL_FAULT", None)
    # the kernel tests' interpreter mode would leak into vLLM's in-process Triton kernel rebinding
    env.pop("TRITON_INTERPRET", None)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # set by in-process engines of earlier tests
    if fault:
        env["QERL_FAULT"] = fault
    if source is not None:
        env["PYTHONPATH"] = str(source)
    work.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "qerl.flows.cli", *args]
    out_path, err_path = work / f"cli-{os.getpid()}.out", work / f"cli-{os.getpid()}.err"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        # -m puts the working dir first on sys.path: the checkout's own qerl/ unless ``source``'s
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=err, start_new_session=True, cwd=source)
        try:
            code = proc.wait(timeout=900)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(cmd, code, out_path.read_text(), err_path.read_text())


def _assert_console(
    proc: subprocess.CompletedProcess,
    work: Path,
    engine_lines: tuple[str, ...],
    temporary_server: bool = True,
) -> None:
    """The console has the stage and step lines and ends with the summary; the chatter of Prefect,
    httpx and the engine (``engine_lines``: substrings of its INFO lines) is in run.log only, and so
    is the start of the run's own Prefect server where it started one (``_qerl(own_server=True)``)."""
    console = proc.stdout + proc.stderr
    for line in ("quantize", "data ", "quality", "step 1/", "evaluate", "register"):
        assert line in proc.stderr, (line, proc.stderr[-2000:])
    assert re.search(r"quantize .*NVFP4 checkpoint ", proc.stderr), proc.stderr
    # what quantization cost, measured on the run's validation texts
    assert re.search(
        r"quality +KL \d\.\d{3} nats/token, top-1 .* on \d+ validation:\S+ texts", proc.stderr
    ), proc.stderr
    assert proc.stdout.strip().splitlines()[-1].startswith("  MLflow UI:"), proc.stdout[-1000:]
    (log_path,) = (work / "runs").glob("*/run.log")
    log_text = log_path.read_text()
    server = ("Prefect server for this process on",) if temporary_server else ()
    for chatter in ("httpx: HTTP Request", "prefect.flow_runs", *server, *engine_lines):
        assert chatter not in console, (chatter, console[-3000:])
        assert chatter in log_text, (chatter, log_text[-3000:])
    assert len(console.splitlines()) < 40, console


def _final_adapter(work: Path) -> bytes:
    (record_path,) = (work / "runs").glob("*/run.json")
    record = json.loads(record_path.read_text())
    assert record["status"] == "completed", record.get("error")
    return (Path(record["final_adapter"]) / "adapter_model.safetensors").read_bytes()


def _mlflow_steps(work: Path) -> tuple[dict, list[int], str]:
    """(run record, the steps its MLflow run has of ``reward_mean``, that run's status); the
    experiment holds no other run."""
    from mlflow.tracking import MlflowClient

    (record_path,) = (work / "runs").glob("*/run.json")
    record = json.loads(record_path.read_text())
    client = MlflowClient(tracking_uri=f"sqlite:///{work / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("qerl").experiment_id])
    assert run.info.run_id == record["mlflow_run_id"]
    steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, "reward_mean"))
    return record, steps, run.info.status


def _journal(work: Path) -> list[dict]:
    path = work / "store" / "builds.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


@pytest.fixture(scope="module")
def flow_model(tiny_model_factory) -> Path:
    import torch

    return tiny_model_factory(arch="qwen2", dtype=torch.float32)


@pytest.mark.slow
def test_vllm_run_end_to_end(flow_model, tmp_path):
    """One whole run on the default engine: vLLM on the CPU serving the dequantized twin. It talks to the
    session's Prefect server; the console of a run with a temporary server of its own is checked on the
    kill test's last resume."""
    cfg_path = tmp_path / "run.yaml"
    cfg = tiny_run_config(flow_model, engine="vllm")
    cfg["loop"].update(steps=2, eval_base=True)
    cfg_path.write_text(yaml.safe_dump(cfg))
    proc = _qerl(["run", "--config", str(cfg_path)], tmp_path / "work")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "vllm-nvfp4-emulated" in proc.stdout and "MLflow UI" in proc.stdout
    # the first run of a registered model is compared with the base model, here on a handful of
    # validation items: too few to decide on (one item's standard error is 0: any gain would pass)
    assert re.search(r"registered \S+ v1, not promoted\n", proc.stdout), proc.stdout
    assert (
        "promotion: too few items to decide against the base model on arithmetic/validation@" in proc.stdout
    )
    assert re.search(r"\([1-9] items, paired\)", proc.stdout), proc.stdout
    _assert_console(
        proc, tmp_path / "work", ("vLLM engine up", "Initializing a V1 LLM engine"), temporary_server=False
    )
    (record_path,) = (tmp_path / "work" / "runs").glob("*/run.json")
    record = json.loads(record_path.read_text())
    assert record["engine_mode"] == "vllm-nvfp4-emulated"
    assert [e["adapter"] is None for e in record["evaluations"]] == [False, True]
    lift = record["lift"]  # the final adapter against the base, paired over the test items
    assert (
        lift["n_items"] == record["evaluations"][0]["n_items"] and lift["base"] == record["baseline_accuracy"]
    )
    assert re.search(r"  lift: base \d\.\d{3} -> \d\.\d{3}, [+-]\d\.\d{3} \(", proc.stdout), proc.stdout
    assert str(record["registration"]["version"]) == "1"
    rollouts = [e for e in _journal(tmp_path / "work") if e["stage"] == "rollout"]
    assert len(rollouts) == 2
    # the run has AQN, so its engine was built for it (eager here: fp32 norms from the first noisy step)
    manifests = sorted((tmp_path / "work" / "store" / "objects" / "rollout").glob("*/manifest.json"))
    assert len(manifests) == 2
    for manifest in manifests:
        engine = json.loads(manifest.read_text())["extra"]["engine"]
        assert engine["built_for_aqn"] is True and engine["aqn_norms"] == "fp32 per noisy step", engine


@pytest.mark.slow
def test_killed_runs_resume_to_the_identical_adapter(learner_model_dir, tmp_path):
    """Crash-and-resume on the transformers engine (the resume logic does not depend on the engine;
    vLLM's start-up, five times over, would cost minutes on two cores), on a model that learns: the
    clean run is shown to train before the crashed one is required to match it. The last resume is
    an upgrade night's: a newer qerl that computes the same keeps every step, and says what changed."""
    from learning import assert_trained, learning_run_config, run_record
    from qerl.pipeline.store.code_version import dependency_versions

    from tests.pipeline.test_code_version import upgraded_qerl

    cfg = learning_run_config(learner_model_dir)
    cfg_path = tmp_path / "run.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    args = ["run", "--config", str(cfg_path)]

    from prefect_home import run_here

    # the uninterrupted reference runs in this process (the crashes need real processes, it does not)
    clean = run_here(load_run_config(cfg_path), tmp_path / "clean")
    assert clean["status"] == "completed", clean.get("error")
    assert_trained(tmp_path / "clean", run_record(tmp_path / "clean"))
    reference = _final_adapter(tmp_path / "clean")

    crashed = tmp_path / "crashed"
    for fault in ("rollout:1", "score:2", "train:1"):  # the first before any step finished
        proc = _qerl(args, crashed, fault)
        assert proc.returncode == -signal.SIGKILL, (fault, proc.returncode, proc.stderr[-3000:])
        # the steps done so far are in the run's MLflow run already, each once
        record, logged, status = _mlflow_steps(crashed)
        assert logged == [e["step"] for e in record["steps"]] and status == "RUNNING", (fault, logged)
    # resumed by `qerl resume` after an upgrade: a newer qerl whose edits compute the same (comments,
    # docstrings, the store, the registry and the config machinery), and a torch said to be newer
    # than the one the killed attempt recorded
    (record_path,) = (crashed / "runs").glob("*/run.json")
    record = json.loads(record_path.read_text())
    record["versions"]["torch"] = "2.0.0"
    record_path.write_text(json.dumps(record))
    upgraded = upgraded_qerl(tmp_path / "upgraded")
    done = _qerl(["resume", record["run_id"]], crashed, source=upgraded, own_server=True)  # as a user's
    assert done.returncode == 0, done.stderr[-3000:]
    _assert_console(done, crashed, ("qerl.stages.rollout: rollout step 0",))
    said = done.stderr
    assert f"torch 2.0.0 -> {dependency_versions()['torch']}" in said, said[-3000:]
    assert f"resume {record['run_id']}: kept: the base and all {len(record['steps'])} built steps" in said
    assert _final_adapter(crashed) == reference
    # one MLflow run from the first step to the registered version, each step once across attempts
    record, logged, status = _mlflow_steps(crashed)
    assert (logged, status) == ([0, 1, 2], "FINISHED")
    assert record["registration"]["run_id"] == record["mlflow_run_id"]

    built = Counter((e["stage"], e["key"]) for e in _journal(crashed))
    assert built and max(built.values()) == 1, [k for k, n in built.items() if n > 1]
    # every stage kind really ran in the crashed directory, and resuming needed no stage twice
    assert {s for s, _ in built} >= {
        "quantize",
        "dequantize",
        "rollout",
        "score",
        "train",
        "evaluate",
        "register",
    }
    assert Counter(s for s, _ in built)["train"] == 3

    again = run_here(load_run_config(cfg_path), crashed)  # a completed run re-run: nothing is built
    assert again["status"] == "completed", again.get("error")
    assert len(_journal(crashed)) == sum(built.values())
    (record_path,) = (crashed / "runs").glob("*/run.json")
    record = json.loads(record_path.read_text())
    assert record["engine_mode"] == "hf-nvfp4-emulated"
    assert len(record["steps"]) == 3 and record["registration"]["version"]


def test_every_preset_loads():
    names = preset_names()
    assert {"demo", "qwen2.5-7b-gsm8k"} <= set(names)
    for name in names:
        cfg = load_run_config(PRESET_DIR / f"{name}.yaml")
        assert cfg.loop.steps >= 1
    assert load_run_config().model.source == "demo"  # no config: the embedded demo


def test_run_config_rejects_bad_keys_and_mismatches(tmp_path):
    with pytest.raises(ConfigError, match=r"rollout\.n_sample.*valid keys here:.*n_samples"):
        load_run_config(None, ["rollout.n_sample=3"])
    with pytest.raises(ConfigError, match="temperature"):
        load_run_config(None, ["train.temperature=0.7"])
    # a check across settings names the override that broke it, not the preset file
    with pytest.raises(ConfigError, match=r"n_samples must be >= 2.*\(from --set rollout\.n_samples=1\)$"):
        load_run_config(PRESET_DIR / "demo.yaml", ["rollout.n_samples=1", "loop.steps=3"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout:\n  n_samples: 1\n")
    with pytest.raises(ConfigError, match=rf"\(a check across settings: {bad} with --set loop.steps=3\)$"):
        load_run_config(bad, ["loop.steps=3"])


def test_step_prompts_cover_the_dataset_in_turn():
    from qerl.pipeline.planning.prompt_stream import step_prompts

    items = list(range(10))
    first_epoch = [x for step in range(5) for x in step_prompts(items, step, 2, seed=0)]
    assert sorted(first_epoch) == items
    assert step_prompts(items, 7, 2, seed=0) == step_prompts(items, 7, 2, seed=0)


def test_cli_help_lists_every_command():
    out = subprocess.run([sys.executable, "-m", "qerl.flows.cli", "--help"], capture_output=True, text=True)
    for command in (
        "quantize",
        "score",
        "run",
        "resume",
        "eval",
        "promote",
        "versions",
        "schedule",
        "bench",
        "gc",
    ):
        assert command in out.stdout


def test_an_unknown_benchmark_lists_the_benchmarks(capsys):
    from qerl.flows.cli import main

    assert main(["bench", "nosuch"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qerl bench: error: no benchmark 'nosuch'") and "quantize, rollout, score" in err


def test_a_mistyped_run_id_or_work_dir_is_named_and_nothing_is_made(tmp_path, monkeypatch, capsys):
    """The CLI's ``main`` in this process: each refusal comes before the run touches Prefect or its
    environment (the exit status of ``python -m qerl.flows.cli`` is ``main``'s, as every ``_qerl`` run
    shows)."""
    from qerl.flows.cli import main

    monkeypatch.setenv("QERL_WORK_DIR", str(tmp_path))
    assert main(["resume", "nope"]) == 2 and "no run 'nope'" in capsys.readouterr().err
    mistyped = tmp_path / "no-such-work-dir"  # an error, and no work directory made there
    assert main(["resume", "nope", "--work-dir", str(mistyped)]) == 2
    assert f"no run 'nope' under {mistyped}" in capsys.readouterr().err
    assert not mistyped.exists()
    a_file = tmp_path / "a-file"
    a_file.write_text("kept")
    assert main(["run", "--work-dir", str(a_file)]) == 2
    assert f"work directory {a_file} is not a directory" in capsys.readouterr().err
    assert a_file.read_text() == "kept"


def test_schedule_needs_a_server(tmp_path, monkeypatch):
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    proc = _qerl(["schedule", "--cron", "0 2 * * *"], tmp_path, own_server=True)
    assert proc.returncode == 2 and "prefect server start" in proc.stderr
    assert "warning: loop.deadline_h is unset" in proc.stderr  # the demo config sets none
    proc = _qerl(
        ["schedule", "--cron", "0 2 * * *", "--set", "loop.deadline_h=20"], tmp_path, own_server=True
    )
    assert proc.returncode == 2 and "warning" not in proc.stderr


def test_schedule_warns_of_a_deadline_that_lets_a_night_hold_back_the_next(tmp_path):
    """Nights run one at a time, so a night without a deadline, or with one past the next night's
    start, can hold back the nights after it: ``qerl schedule`` says so, with the gap it read."""
    from qerl.flows.orchestration import deadline_warning, nights_gap_h, prepare_environment

    prepare_environment(tmp_path)
    assert nights_gap_h("0 2 * * *") == 24.0
    assert nights_gap_h("0 2 * * 1-5") == 24.0  # the closest two nights, not Friday to Monday
    assert nights_gap_h("0 */6 * * *") == 6.0
    unset = deadline_warning(None, "0 2 * * *")
    assert "loop.deadline_h is unset" in unset and "every 24 h" in unset and "loop.deadline_h=21" in unset
    late = deadline_warning(30, "0 2 * * *")
    assert "loop.deadline_h = 30 h is not below the 24 h" in late
    assert deadline_warning(24, "0 2 * * *") is not None  # a night at its deadline meets the next
    assert deadline_warning(20, "0 2 * * *") is None
    assert "loop.deadline_h=5" in deadline_warning(None, "0 */6 * * *")
    assert "loop.deadline_h=0.9" in deadline_warning(None, "0 * * * *")


def test_schedule_weighs_the_deadline_against_the_longest_night_recorded_here(tmp_path):
    """The longest completed attempt of the schedule's nights in the work dir (start to last
    update of its record): a deadline at or under it would have stopped that night, and nights
    as long as the gap delay each other whatever the deadline."""
    from qerl.flows.commands import longest_attempt
    from qerl.flows.orchestration import deadline_warning, prepare_environment

    def record(run_id: str, status: str, name: str, start: str, end: str) -> None:
        folder = tmp_path / "runs" / run_id
        folder.mkdir(parents=True)
        rec = {"run_id": run_id, "status": status, "config": {"loop": {"name": name}},
               "started_at": start, "updated_at": end}  # fmt: skip
        (folder / "run.json").write_text(json.dumps(rec))

    prepare_environment(tmp_path)
    assert longest_attempt(tmp_path, "nightly") is None
    record(
        "nightly-a-20261120", "completed", "nightly", "2026-11-20T02:00:00+00:00", "2026-11-20T05:30:00+00:00"
    )
    record(
        "nightly-a-20261121", "completed", "nightly", "2026-11-21T02:00:00+00:00", "2026-11-21T04:00:00+00:00"
    )
    record(
        "nightly-a-20261122", "failed", "nightly", "2026-11-22T02:00:00+00:00", "2026-11-22T12:00:00+00:00"
    )
    record("other-b-20261120", "completed", "other", "2026-11-20T02:00:00+00:00", "2026-11-21T01:00:00+00:00")
    (tmp_path / "runs" / "broken").mkdir()
    (tmp_path / "runs" / "broken" / "run.json").write_text("{")
    longest = longest_attempt(tmp_path, "nightly")
    assert longest == (3.5, "nightly-a-20261120")  # completed attempts of these nights only
    short = deadline_warning(3, "0 2 * * *", longest)
    assert short == (
        "loop.deadline_h = 3 h would have stopped a night like the longest here: the longest completed "
        "night here (nightly-a-20261120) took 3.50 h"
    )
    assert deadline_warning(6, "0 2 * * *", longest) is None
    assert deadline_warning(None, "0 2 * * *", longest).endswith(
        "(the longest completed night here (nightly-a-20261120) took 3.50 h)"
    )
    too_long = deadline_warning(2, "0 */3 * * *", longest)  # nights every 3 h, one took 3.5
    assert "would have stopped a night like the longest here" in too_long
    unset_too_long = deadline_warning(None, "0 */3 * * *", longest)  # both findings, not the first only
    assert "each such night delays the next; loop.deadline_h is unset" in unset_too_long
    assert (
        "not less than the 3 h between two nights of '0 */3 * * *': each such night delays the next"
        in too_long
    )


def test_nightly_deployment_is_cron_with_concurrency_one(tmp_path):
    from qerl.flows.orchestration import nightly_deployment, prepare_environment

    prepare_environment(tmp_path)
    deployment = nightly_deployment(load_run_config(), tmp_path, "0 2 * * *")
    assert deployment.name == "nightly"
    assert deployment.schedules[0].schedule.cron == "0 2 * * *"
    assert deployment.concurrency_limit == 1
    assert deployment.parameters["work_dir"] == str(tmp_path)
    assert deployment.parameters["nightly"] is True  # each scheduled run is the night of its date
    assert deployment.entrypoint == "qerl.flows.run.rl_flow"
