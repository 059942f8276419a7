"""Store retention (``qerl gc``): what is pruned, what is protected, and that lookups and resumes still work."""

from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path

import pytest
from qerl.pipeline.store import retention, retention_policy
from qerl.pipeline.store.artifact_store import ArtifactStore
from qerl.pipeline.store.files import atomic_write_json
from qerl.pipeline.store.manifest import ArtifactError, BuildResult, Manifest
from qerl.pipeline.store.run_record import RunRecord

OPT_BYTES, ADAPTER_BYTES = 3000, 1000


def fake_step(store: ArtifactStore, run: str, step: int, prev: Manifest | None, salt: int = 0) -> Manifest:
    """A correctly formed train artifact (the real stage's file layout) with small files (``salt``
    makes their bytes differ from another run's)."""

    def build(tmp: Path) -> BuildResult:
        (tmp / "adapter").mkdir()
        (tmp / "adapter" / "adapter_config.json").write_text(json.dumps({"r": 8}))
        (tmp / "adapter" / "adapter_model.safetensors").write_bytes(
            bytes([(step + salt) % 251]) * ADAPTER_BYTES
        )
        (tmp / "optimizer.safetensors").write_bytes(bytes([step % 251]) * OPT_BYTES)
        (tmp / "trainer_state.json").write_text(json.dumps({"step": step + 1}))
        return BuildResult(mode="test", extra={"step": step, "adapter": "adapter"})

    inputs = {"prev": prev.digest if prev else "none"}
    return store.produce("train", {"run": run, "step": step}, inputs, "code", build)[0]


def fake_run(
    work: Path, run: str, steps: int, status: str = "failed", age_h: float = 0.0, salt: int = 0, **extra
) -> list[Manifest]:
    """A run record over fake steps; a failed run by default (it keeps what its resume needs)."""
    store = ArtifactStore(work / "store")
    out: list[Manifest] = []
    for step in range(steps):
        out.append(fake_step(store, run, step, out[-1] if out else None, salt))
    updated = _dt.datetime.now(_dt.UTC) - _dt.timedelta(hours=age_h)
    record = {
        "run_id": run,
        "status": status,
        "config": extra.pop("config", {}),
        "steps": [{"step": s, "manifests": {"train": m.key}} for s, m in enumerate(out)],
        "evaluations": [],
        "updated_at": updated.isoformat(timespec="seconds"),
        **extra,
    }
    if status == "completed":
        record["final_adapter"] = str(out[-1].dir / "adapter")
    atomic_write_json(work / "runs" / run / "run.json", record)
    return out


def fake_registration(store: ArtifactStore, train: Manifest) -> None:
    def build(tmp: Path) -> BuildResult:
        (tmp / "registration.json").write_text("{}")
        return BuildResult()

    store.produce("register", {"model": "m"}, {"train": train.digest}, "code", build)


def pruned_names(m: Manifest) -> set[str]:
    return set(Manifest.load(m.dir).pruned)


ADAPTER = {"adapter/adapter_config.json", "adapter/adapter_model.safetensors"}


def test_gc_prunes_old_optimizer_states_and_lookups_still_serve(tmp_path):
    steps = fake_run(tmp_path, "a", 5)
    store = ArtifactStore(tmp_path / "store")
    digests = [m.digest for m in steps]

    dry = retention.plan(tmp_path)
    assert [(d.key, d.files) for d in dry.deletions] == sorted(
        (m.key, ["optimizer.safetensors"]) for m in steps[:3]
    )
    assert dry.nbytes == 3 * OPT_BYTES
    assert all((m.dir / "optimizer.safetensors").is_file() for m in steps)  # a plan touches nothing

    assert retention.apply(tmp_path, dry) == 3 * OPT_BYTES
    for i, m in enumerate(steps):
        hit = store.get("train", m.key, verify="full")
        assert hit is not None, f"step {i} looked corrupt after gc"
        assert hit.digest == digests[i]  # downstream keys stay valid
        assert hit.file("adapter/adapter_model.safetensors").stat().st_size == ADAPTER_BYTES
        assert (hit.dir / "optimizer.safetensors").is_file() == (i >= 3)
    with pytest.raises(
        ArtifactError, match=r"no longer holds 'optimizer.safetensors': pruned .*last 2 steps"
    ):
        store.get("train", steps[0].key).require("optimizer.safetensors")
    store.get("train", steps[4].key).require("optimizer.safetensors", "adapter")
    # a re-run of the finished run finds every step: nothing is rebuilt
    n_builds = len(store.builds())
    again = fake_run(tmp_path, "a", 5)
    assert [m.key for m in again] == [m.key for m in steps] and len(store.builds()) == n_builds
    # idempotent; the prune is audited apart from the build log
    assert retention.plan(tmp_path).deletions == []
    gc_log = [json.loads(x) for x in (tmp_path / "store" / "gc.jsonl").read_text().splitlines()]
    assert sorted(e["key"] for e in gc_log) == sorted(m.key for m in steps[:3])


def test_gc_protects_live_registered_evaluated_and_unreferenced(tmp_path):
    store = ArtifactStore(tmp_path / "store")
    live = fake_run(tmp_path, "live", 4, status="running", age_h=0.5)
    stale = fake_run(tmp_path, "stale", 4, status="running", age_h=48)
    sparse = fake_run(tmp_path, "sparse", 7, config={"store": {"keep_adapters_every": 3}})
    record = json.loads((tmp_path / "runs" / "sparse" / "run.json").read_text())
    record["evaluations"] = [{"step": 1, "adapter": sparse[0].key, "accuracy": 0.1}]
    atomic_write_json(tmp_path / "runs" / "sparse" / "run.json", record)
    fake_registration(store, sparse[1])
    orphan = fake_step(store, "orphan", 0, None)  # no run record names it

    gc_plan = retention.plan(tmp_path)
    assert any("live run live" in n for n in gc_plan.notes)
    retention.apply(tmp_path, gc_plan)
    assert all(pruned_names(m) == set() for m in live) and pruned_names(orphan) == set()
    # a crashed run (running, but silent for 48 h) keeps only what its resume needs
    assert [pruned_names(m) for m in stale] == [{"optimizer.safetensors"}] * 2 + [set()] * 2
    # adapters: steps 2 and 5 (every 3rd), 1 (registered), 5 and 6 (last 2) stay; step 0 was evaluated,
    # but an explicit keep_adapters_every decides (by default it is the evaluation interval)
    expect = {0: {"optimizer.safetensors", *ADAPTER}, 1: {"optimizer.safetensors"}, 2: {"optimizer.safetensors"},
              3: {"optimizer.safetensors", *ADAPTER}, 4: {"optimizer.safetensors", *ADAPTER},
              5: set(), 6: set()}  # fmt: skip
    assert {i: pruned_names(m) for i, m in enumerate(sparse)} == expect
    assert not (sparse[3].dir / "adapter").exists()  # the emptied folder goes too
    assert store.get("train", sparse[3].key) is not None
    with pytest.raises(ArtifactError, match="no longer holds 'adapter/adapter_config.json'.*multiple of 3"):
        store.get("train", sparse[3].key).require("adapter")


def test_a_run_shared_with_a_live_one_is_protected_and_overrides_apply(tmp_path):
    done = fake_run(tmp_path, "done", 4)
    # a live run that re-walks the same steps (same keys) protects them from the finished run's policy
    atomic_write_json(
        tmp_path / "runs" / "again" / "run.json",
        {"run_id": "again", "status": "running", "steps": [{"step": 0, "manifests": {"train": done[0].key}}],
         "updated_at": _dt.datetime.now(_dt.UTC).isoformat()},
    )  # fmt: skip
    gc_plan = retention.plan(tmp_path, overrides={"keep_optimizer_last": 1})
    assert sorted(d.key for d in gc_plan.deletions) == sorted(m.key for m in done[1:3])
    (done[1].dir / "manifest.json").write_text("{torn")  # unreadable: left for the lookup to discard
    gc_plan = retention.plan(tmp_path, overrides={"keep_optimizer_last": 1})
    assert [d.key for d in gc_plan.deletions] == [done[2].key] and "unreadable manifest" in gc_plan.notes[-1]
    with pytest.raises(retention_policy.RetentionError, match="keep_optimizer_last"):
        retention.plan(tmp_path, overrides={"keep_optimizer_last": 0})
    (tmp_path / "runs" / "broken").mkdir()
    (tmp_path / "runs" / "broken" / "run.json").write_text("{not json")
    with pytest.raises(retention_policy.RetentionError, match="broken/run.json"):
        retention.plan(tmp_path)


def test_prune_run_is_what_the_flow_calls_after_a_step(tmp_path, caplog):
    mine = fake_run(tmp_path, "mine", 4, status="running")  # live, but it is the caller
    other = fake_run(tmp_path, "other", 3)
    freed = retention.prune_run(tmp_path, "mine", retention_policy.RetentionConfig(keep_optimizer_last=1))
    assert freed == 3 * OPT_BYTES
    assert [bool(pruned_names(m)) for m in mine] == [True, True, True, False]
    assert all(pruned_names(m) == set() for m in other)  # other runs are only protected, never pruned
    with pytest.raises(retention_policy.RetentionError, match="no run record for 'nope'"):
        retention.plan(tmp_path, only_run="nope")
    (tmp_path / "runs" / "broken").mkdir()
    (tmp_path / "runs" / "broken" / "run.json").write_text("{not json")
    with caplog.at_level("WARNING", logger="qerl.retention"):
        assert retention.prune_run(tmp_path, "mine") == 0  # cannot decide safely: deletes nothing
    assert "retention skipped for run mine: cannot read run record" in caplog.text


def test_gc_keeps_what_an_ablation_compares_and_leaves_its_files_alone(tmp_path, caplog):
    """``<work>/ablations/<id>/``: the runs it lists are ordinary runs (old optimizer states go), their
    final evaluated adapters stay whatever the policy, and gc neither deletes the ablation's files nor
    stops on an unreadable ablation record (its runs' own records are read regardless)."""
    from qerl.pipeline.store.layout import ABLATION_DIR

    config = {"loop": {"steps": 4}, "store": {"keep_adapters_every": 3}}
    arm = fake_run(tmp_path, "abl-arm-s0", 4, config=config, status="completed")
    record = json.loads((tmp_path / "runs" / "abl-arm-s0" / "run.json").read_text())
    record["evaluations"] = [{"step": 4, "adapter": arm[3].key, "accuracy": 0.5, "manifest": "x"}]
    atomic_write_json(tmp_path / "runs" / "abl-arm-s0" / "run.json", record)
    assert retention_policy.ablation_adapters(RunRecord.model_validate(record)) == {arm[3].key}
    out = tmp_path / ABLATION_DIR / "abl-1234"
    runs = [
        {"arm": "a", "replicate": 0, "run_id": "abl-arm-s0"},
        {"arm": "b", "replicate": 0, "run_id": "not-yet"},
    ]
    atomic_write_json(out / "ablation.json", {"id": "abl-1234", "status": "running", "runs": runs})
    (out / "report.md").write_text("# report\n")
    (out / "plots").mkdir()
    (out / "plots" / "reward.png").write_bytes(b"png")
    (out / "run.log").write_text("log\n")
    broken = tmp_path / ABLATION_DIR / "abl-torn"
    broken.mkdir()
    (broken / "ablation.json").write_text("{torn")
    files_before = sorted(p for p in (tmp_path / ABLATION_DIR).rglob("*"))

    later = _dt.datetime.now(_dt.UTC) + _dt.timedelta(hours=1)
    gc_plan = retention.plan(tmp_path, now=later)
    assert any("final adapters of ablation abl-1234: 1 of its 2 runs" in n for n in gc_plan.notes)
    assert any("1 of its 2 runs have not completed" in n for n in gc_plan.notes)
    assert any("skipped ablation record" in n and "abl-torn" in n for n in gc_plan.notes)
    assert gc_plan.deletions == []  # the run not started yet may continue from any of them
    fake_run(tmp_path, "not-yet", 1, status="completed")
    retention.apply(tmp_path, retention.plan(tmp_path, now=later))
    # now the run's policy applies (a completed run: no optimizer state; every 3rd adapter and the
    # final one); the compared one stays
    expect = [{"optimizer.safetensors", *ADAPTER}] * 2 + [{"optimizer.safetensors"}] * 2
    assert [pruned_names(m) for m in arm] == expect
    assert sorted(p for p in (tmp_path / ABLATION_DIR).rglob("*")) == files_before
    assert (out / "report.md").read_text() == "# report\n"
    with caplog.at_level("WARNING", logger="qerl.retention"):  # the flow's own pruning is not stopped
        retention.prune_run(tmp_path, "abl-arm-s0")
    assert "retention skipped" not in caplog.text


def test_gc_sweeps_trash_and_dead_builds_only(tmp_path):
    store = ArtifactStore(tmp_path / "store")
    (m,) = fake_run(tmp_path, "one", 1)
    (m.dir / "trainer_state.json").write_text("{}")  # corrupt: the next lookup moves it aside
    assert store.get("train", m.key) is None
    dead = store.root / "tmp" / f"train-{'a' * 32}-deadbeef"
    busy = store.root / "tmp" / f"train-{'b' * 32}-cafef00d"
    for d in (dead, busy):
        d.mkdir()
        (d / "optimizer.safetensors").write_bytes(b"x" * 500)
    assert any("less than 600 s ago" in n for n in retention.plan(tmp_path).notes)  # may still be filling
    later = _dt.datetime.now(_dt.UTC) + _dt.timedelta(hours=1)
    with store.lock(f"train-{'b' * 32}"):  # a producer holds its key's lock while it builds
        gc_plan = retention.plan(tmp_path, now=later)
        kinds = sorted((d.kind, d.path.name) for d in gc_plan.deletions)
        assert [k for k, _ in kinds] == ["tmp", "trash"] and kinds[0][1] == dead.name
        assert any("its build is running" in n for n in gc_plan.notes)
        freed = retention.apply(tmp_path, gc_plan)
    assert not dead.exists() and busy.exists() and not any((store.root / "trash").iterdir())
    assert freed == gc_plan.nbytes > 500


def test_crash_between_manifest_and_delete_is_harmless(tmp_path, monkeypatch):
    steps = fake_run(tmp_path, "c", 3)
    store = ArtifactStore(tmp_path / "store")
    real_replace = __import__("os").replace

    def crash(src, dst):
        if str(src).endswith("optimizer.safetensors"):
            raise KeyboardInterrupt("power cut")
        return real_replace(src, dst)

    monkeypatch.setattr("qerl.pipeline.store.artifact_store.os.replace", crash)
    with pytest.raises(KeyboardInterrupt):
        store.prune("train", steps[0].key, ["optimizer.safetensors"], "test")
    monkeypatch.setattr("qerl.pipeline.store.artifact_store.os.replace", real_replace)
    hit = store.get("train", steps[0].key, verify="full")  # marked pruned, file still there: fine
    assert hit is not None and "optimizer.safetensors" in hit.pruned
    gc_plan = retention.plan(tmp_path, now=_dt.datetime.now(_dt.UTC) + _dt.timedelta(hours=1))  # next gc
    retention.apply(tmp_path, gc_plan)
    assert not (steps[0].dir / "optimizer.safetensors").exists()
    assert store.get("train", steps[0].key) is not None


def test_cli_gc_dry_run_then_real(tmp_path, capsys):
    from qerl.flows.cli import main

    fake_run(tmp_path, "cli", 4)
    assert main(["gc", "--dry-run", "--work-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("optimizer.safetensors") == 2 and "would free 5.9 KiB" in out
    assert main(["gc", "--keep-optimizer-last", "1", "--work-dir", str(tmp_path)]) == 0
    assert "freed 8.8 KiB" in capsys.readouterr().out
    assert main(["gc", "--work-dir", str(tmp_path)]) == 0
    assert "nothing to delete" in capsys.readouterr().out
    assert main(["gc", "--work-dir", str(tmp_path / "nowhere")]) == 2
    assert "no artifact store under" in capsys.readouterr().err and not (tmp_path / "nowhere").exists()


def test_a_reader_racing_a_prune_does_not_discard_the_artifact(tmp_path, monkeypatch):
    """A lookup that read the manifest just before a prune sees the file gone; it must re-check
    under the key's lock (which the prune held) instead of moving a healthy artifact aside."""
    steps = fake_run(tmp_path, "r", 3)
    store = ArtifactStore(tmp_path / "store")
    stale = Manifest.load(steps[0].dir)  # what the reader loaded before gc ran
    store.prune("train", steps[0].key, ["optimizer.safetensors"], "test")
    real_load = Manifest.load.__func__
    calls = []

    def load(cls, directory):
        calls.append(directory)
        return stale.model_copy(deep=True) if len(calls) == 1 else real_load(cls, directory)

    monkeypatch.setattr(Manifest, "load", classmethod(load))
    hit = store.get("train", steps[0].key)
    assert hit is not None and "optimizer.safetensors" in hit.pruned and steps[0].dir.is_dir()
    assert len(calls) == 2


def test_real_train_steps_resume_after_gc(tiny_model_dir, tmp_path):
    """The real train stage: gc a run that died after 3 steps, re-walk it (all cache hits), continue
    from its kept checkpoint to the same adapter as an uninterrupted run; a branch from a pruned step
    fails naming the missing optimizer state."""
    from qerl.pipeline.nvfp4.recipe import QuantizeConfig
    from qerl.pipeline.rl.policy import init_state
    from qerl.pipeline.rl.train_config import TrainConfig
    from qerl.stages import quantize, train

    from tests.stages.test_train import PROMPTS, TINY, _scored_manifest, sample_batch

    def setup(work: Path) -> tuple[ArtifactStore, Manifest, list[Manifest]]:
        store = ArtifactStore(work / "store")
        base = quantize.run(QuantizeConfig(), str(tiny_model_dir), store)
        sampler = init_state(base.dir, cfg)
        batches = [sample_batch(sampler.model, PROMPTS, 3, 3, 10 + s, lambda c: c[0] % 2) for s in range(4)]
        return store, base, [_scored_manifest(store, b, f"s{i}") for i, b in enumerate(batches)]

    def walk(store: ArtifactStore, base: Manifest, scored: list[Manifest], n: int) -> list[Manifest]:
        chain: list[Manifest] = []
        for s in range(n):
            chain.append(
                train.run(
                    cfg=cfg,
                    base=base,
                    scored=scored[s],
                    prev=chain[-1] if chain else None,
                    step=s,
                    store=store,
                )
            )
        return chain

    cfg = TrainConfig(**TINY, lr=1e-2)
    ref_store, ref_base, ref_scored = setup(tmp_path / "ref")
    reference = walk(ref_store, ref_base, ref_scored, 4)[-1].file("adapter/adapter_model.safetensors")

    store, base, scored = setup(tmp_path / "work")
    chain = walk(store, base, scored, 3)
    atomic_write_json(
        tmp_path / "work" / "runs" / "died" / "run.json",
        {"run_id": "died", "status": "failed", "steps": [{"step": s, "manifests": {"train": m.key}}
                                                         for s, m in enumerate(chain)]},
    )  # fmt: skip
    freed = retention.apply(tmp_path / "work", retention.plan(tmp_path / "work", {"keep_optimizer_last": 1}))
    assert freed == sum(m.files["optimizer.safetensors"].size for m in chain[:2]) > 0
    n_builds = len(store.builds())
    again = walk(store, base, scored, 3)  # the resume re-walks the finished steps: all hits
    assert [m.key for m in again] == [m.key for m in chain] and len(store.builds()) == n_builds
    last = train.run(cfg=cfg, base=base, scored=scored[3], prev=again[-1], step=3, store=store)
    assert last.file("adapter/adapter_model.safetensors").read_bytes() == reference.read_bytes()
    with pytest.raises(ArtifactError, match="no longer holds 'optimizer.safetensors'"):
        train.run(
            cfg=cfg, base=base, scored=scored[3], prev=again[0], step=1, store=store
        )  # needs step 0's pruned optimizer state


@pytest.mark.slow
def test_gc_between_real_runs(tiny_model_factory, tmp_path, capsys):
    """A run, `qerl gc`, the run again on the tiny model (transformers engine, in this process): the
    flow prunes its past steps by the run's own `store` section as it goes, so gc afterwards finds
    nothing left, and the re-run rebuilds nothing and ends on the same adapter."""
    import torch
    from prefect_home import run_here
    from qerl.pipeline.planning.run_config import RunConfig

    from tests.flows.test_flow import _final_adapter, _journal, tiny_run_config

    cfg = tiny_run_config(tiny_model_factory(arch="qwen2", dtype=torch.float32))
    cfg["store"] = {"keep_optimizer_last": 1}
    cfg["loop"]["steps"] = 2
    run_cfg, work = RunConfig.model_validate(cfg), tmp_path / "work"
    first = run_here(run_cfg, work)
    assert first["status"] == "completed", first.get("error")
    adapter, built = _final_adapter(work), len(_journal(work))

    keys = [s["manifests"]["train"] for s in first["steps"]]
    pruned = [set(Manifest.load(work / "store" / "objects" / "train" / k).pruned) for k in keys]
    # pruned by the flow: a completed run keeps no optimizer state, and (no interim evaluations) only
    # its final adapter
    assert all({"optimizer.safetensors", *ADAPTER} <= p for p in pruned[:-1])  # (peft's README too)
    assert pruned[-1] == {"optimizer.safetensors"}

    from qerl.flows.cli import main

    capsys.readouterr()
    assert main(["gc", "--work-dir", str(work)]) == 0
    assert "nothing to delete" in capsys.readouterr().out

    again = run_here(run_cfg, work)
    assert again["status"] == "completed", again.get("error")
    assert len(_journal(work)) == built and _final_adapter(work) == adapter


def test_cli_gc_prints_its_result_without_log_lines(tmp_path):
    """A tool command's terminal holds its result (and warnings), not INFO log lines beside it; ``-v``
    shows them."""
    import subprocess
    import sys

    fake_run(tmp_path, "cli", 4)
    cmd = [sys.executable, "-m", "qerl.flows.cli", "gc", "--work-dir", str(tmp_path)]
    quiet = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert quiet.returncode == 0 and "gc: freed 5.9 KiB" in quiet.stdout, quiet.stderr
    assert "INFO" not in quiet.stdout + quiet.stderr
    loud = subprocess.run(
        [*cmd, "--keep-optimizer-last", "1", "-v"], capture_output=True, text=True, timeout=120
    )
    assert loud.returncode == 0 and "INFO qerl.retention: gc freed" in loud.stderr, loud.stderr
