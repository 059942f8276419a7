"""Releasing old registered versions (``store.keep_versions``): the MLflow copy and the store's copies
go, the version's record stays, readers refuse it, and alias-holding versions always stay."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from qerl.pipeline.registry import adapters, promotion, release
from qerl.pipeline.registry import tracking as registry
from qerl.pipeline.registry.lock import RegistryError
from qerl.pipeline.store import releases, retention
from qerl.pipeline.store.artifact_store import ArtifactStore
from qerl.pipeline.store.manifest import Manifest

from tests.pipeline.test_gc import ADAPTER, fake_registration, fake_run, pruned_names

NAME = "qerl-adapter"


def _night(
    work: Path,
    run: str,
    keep: int | None,
    status: str = "completed",
    champion: bool = False,
    uri: str | None = None,
):
    """A completed two-step run whose final adapter is registered (a real sqlite registry, or the
    tracking server at ``uri``), with the run record's ``registration`` as the flow writes it; made
    champion when asked."""
    store_section = {} if keep is None else {"keep_versions": keep}
    config = {"store": store_section, "loop": {"eval_every": 1}, "registry": {"tracking_uri": uri}}
    steps = fake_run(work, run, 2, status="completed", salt=len(list(work.glob("runs/*"))) * 2, config=config)
    final = steps[-1]
    reg = registry.connect(registry.RegistryConfig(tracking_uri=uri), work)
    mlflow_run = registry.start_run(reg, run_name=run)
    lineage = {"base_digest": "base", "quant_recipe": "q", "dataset_digest": "d", "code_version": "c",
               "flow_run_id": run, "adapter_digest": final.digest}  # fmt: skip
    version, _ = promotion.register_adapter(
        reg, mlflow_run, final.dir / "adapter", None, {"benchmark": "b", "accuracy": 0.5}, lineage
    )
    if champion:
        promotion.promote(reg, NAME, version)
    fake_registration(ArtifactStore(work / "store"), final)
    path = work / "runs" / run / "run.json"
    record = json.loads(path.read_text())
    record.update(status=status, registration={"model_name": NAME, "version": int(version)})
    path.write_text(json.dumps(record))
    return steps, version


def _three_nights(work: Path) -> list[tuple[list[Manifest], str]]:
    """Nights n1 (champion), n2 and n3 under ``keep_versions: 1``: v2 is the one to release."""
    return [_night(work, f"n{i}", 1, champion=i == 1) for i in (1, 2, 3)]


def _source_dir(version: str) -> Path:
    source = MlflowClient().get_model_version(NAME, version).source
    return Path(source.removeprefix("file://"))


def test_gc_releases_versions_beyond_keep_versions_and_their_copies(tmp_path, capsys):
    from qerl.flows.cli import main

    work = tmp_path
    (s1, v1), (s2, v2), (s3, v3) = _three_nights(work)
    assert (v1, v2, v3) == ("1", "2", "3")
    store = ArtifactStore(work / "store")
    copy, _ = adapters.fetch_adapter(
        MlflowClient().get_model_version(NAME, v2), store
    )  # a warm start read v2

    assert main(["gc", "--dry-run", "--work-dir", str(work)]) == 0
    out = capsys.readouterr().out
    assert f"release {NAME} v2 in sqlite:///" in out and "store.keep_versions 1" in out
    assert f"kept {NAME} v1: it holds @champion" in out and "v3" not in out.split("release")[0]
    assert "would free" in out and "and 1 release" in out
    assert _source_dir(v2).is_dir() and "released" not in MlflowClient().get_model_version(NAME, v2).tags

    assert main(["gc", "--work-dir", str(work)]) == 0
    out = capsys.readouterr().out
    assert "and 1 release" in out
    mv2 = MlflowClient().get_model_version(NAME, v2)
    assert "store.keep_versions 1" in mv2.tags["released"] and mv2.tags["base_digest"] == "base"
    assert not _source_dir(v2).exists() and _source_dir(v1).is_dir() and _source_dir(v3).is_dir()
    assert ADAPTER <= pruned_names(s2[-1]) and ADAPTER <= pruned_names(s2[0])  # final one included
    assert not ADAPTER & pruned_names(s1[-1]) and not ADAPTER & pruned_names(s3[-1])
    assert {"adapter/adapter_config.json", "adapter/adapter_model.safetensors"} <= set(
        Manifest.load(copy.dir).pruned
    )
    assert [(r.model_name, r.version, r.runs) for r in releases.load(store)] == [(NAME, "2", ["n2"])]

    assert main(["gc", "--work-dir", str(work)]) == 0  # done: nothing planned again
    assert "nothing to delete" in capsys.readouterr().out
    assert main(["gc", "--keep-versions", "0", "--work-dir", str(work)]) == 2
    assert "--keep-versions 0: Input should be greater than or equal to 1" in capsys.readouterr().err
    assert main(["versions", "--work-dir", str(work)]) == 0  # what an operator sees
    listed = capsys.readouterr().out.splitlines()
    assert listed[0].startswith(f"{NAME} in sqlite:///") and "3 versions" in listed[0]
    assert [line.split()[:2] for line in listed[1:]] == [
        ["v3", "-"],
        ["v2", "-"],
        ["v1", "@champion"],
    ]
    assert (
        listed[2].split()[-2:][0] == "released" and listed[1].endswith("kept") and listed[3].endswith("kept")
    )

    # readers refuse it, naming the release
    with pytest.raises(RegistryError, match=r"qerl-adapter v2 was released by retention \(.*keep_versions 1"):
        release.check_not_released(MlflowClient().get_model_version(NAME, v2))
    assert main(["promote", NAME, v2, "--work-dir", str(work)]) == 2
    assert "v2 was released by retention" in capsys.readouterr().err
    assert str(MlflowClient().get_model_version_by_alias(NAME, "champion").version) == v1
    cli_eval = ["eval", "--adapter", f"models:/{NAME}/{v2}", "--base", str(work / "no-base")]
    assert main([*cli_eval, "--work-dir", str(work)]) == 2  # refused before the base is looked at
    assert "v2 was released by retention" in capsys.readouterr().err


def test_a_version_that_took_an_alias_or_whose_run_is_unfinished_is_not_released(tmp_path):
    work = tmp_path
    _night(work, "n1", 1, champion=True)
    s2, v2 = _night(work, "n2", 1)
    _night(work, "n3", 1, status="failed")  # may be resumed: its version stays
    s4, _ = _night(work, "n4", 1)
    notes: list[str] = []
    planned = release.plan_releases(work, notes=notes)
    assert [r.label for r in planned] == [f"{NAME} v2"]
    gc_plan = retention.plan(work, releasing=planned)
    waiting = [d for d in gc_plan.deletions if d.release]
    assert waiting and {d.key for d in waiting} <= {m.key for m in s2}

    MlflowClient().set_registered_model_alias(NAME, "challenger", v2)  # moved after the plan
    failed: list[str] = []
    assert release.release_all(work, planned, failed) == set()
    assert "now holds @challenger: not released" in failed[0]
    assert "released" not in MlflowClient().get_model_version(NAME, v2).tags and _source_dir(v2).is_dir()
    assert releases.load(ArtifactStore(work / "store")) == []


def test_unset_keep_versions_releases_nothing_and_the_override_applies(tmp_path):
    work = tmp_path
    for i in range(3):
        _night(work, f"n{i}", None, champion=i == 0)
    assert release.plan_releases(work) == []
    assert [r.version for r in release.plan_releases(work, {"keep_versions": 1})] == ["2"]


def test_the_flows_release_pass_releases_and_prunes_what_gc_would(tmp_path):
    work = tmp_path
    s2, v2 = _three_nights(work)[1]
    freed, released = release.release_old_versions(work)
    assert freed > 0 and released == [f"{NAME} v2"]
    assert ADAPTER <= pruned_names(s2[-1]) and not _source_dir(v2).exists()
    assert release.release_old_versions(work) == (0, [])


def test_the_flows_release_pass_never_fails_the_run_it_follows(tmp_path, monkeypatch, caplog):
    from qerl.pipeline.store.manifest import ArtifactError

    s2, _ = _three_nights(tmp_path)[1]

    def broken(*_args, **_kwargs):
        raise ArtifactError("a manifest went bad")

    monkeypatch.setattr(retention, "apply", broken)
    with caplog.at_level("WARNING", logger="qerl.registry"):
        _, released = release.release_old_versions(tmp_path)  # returns: the run does not fail
    assert released == [f"{NAME} v2"] and not ADAPTER & pruned_names(s2[-1])  # released in MLflow only
    assert "release pass stopped (ArtifactError: a manifest went bad); qerl gc finishes it" in caplog.text
    monkeypatch.undo()
    retention.apply(tmp_path, retention.plan(tmp_path))  # qerl gc, by the ledger line
    assert ADAPTER <= pruned_names(s2[-1])


def test_a_release_cut_before_its_ledger_line_is_finished_by_the_next_pass(tmp_path, monkeypatch):
    work = tmp_path
    s2, v2 = _three_nights(work)[1]

    def cut(*_args, **_kwargs):
        raise OSError("killed")

    monkeypatch.setattr(releases, "record", cut)
    release.release_old_versions(work)
    assert "released" in MlflowClient().get_model_version(NAME, v2).tags
    assert not ADAPTER & pruned_names(s2[-1])  # no ledger line: the store copies wait
    monkeypatch.undo()
    planned = release.plan_releases(work)
    assert [(r.version, r.already) for r in planned] == [("2", True)]
    release.release_old_versions(work)
    assert ADAPTER <= pruned_names(s2[-1])


def test_a_warm_start_from_a_released_version_is_refused(tmp_path):
    from types import SimpleNamespace

    from qerl.pipeline.planning.errors import RunPlanError
    from qerl.pipeline.planning.warm_start import warm_start_adapter

    _three_nights(tmp_path)
    release.release_old_versions(tmp_path)
    cfg = SimpleNamespace(registry=registry.RegistryConfig(), train=None)
    store = ArtifactStore(tmp_path / "store")
    with pytest.raises(RunPlanError, match=r"started from qerl-adapter v2, which retention released \(.*"
                       r"its store copy is gone too"):  # fmt: skip
        warm_start_adapter(cfg, tmp_path, store, "base", version="2")
    MlflowClient().set_registered_model_alias(NAME, "champion", "2")  # moved onto it by hand
    with pytest.raises(RunPlanError, match="qerl-adapter v2 was released by retention"):
        warm_start_adapter(cfg, tmp_path, store, "base")


def test_a_version_a_run_started_from_stays_while_the_run_may_resume_and_its_copy_while_the_run_is_kept(
    tmp_path,
):
    work = tmp_path
    v2 = _three_nights(work)[1][1]
    store = ArtifactStore(work / "store")
    copy, _ = adapters.fetch_adapter(MlflowClient().get_model_version(NAME, v2), store)
    started = {"from": "champion", "version": v2, "digest": copy.digest}
    plan = {"stream": "s", "start_slot": 0, "end_slot": 1, "epochs": [0], "warm_start": started}
    fake_run(work, "resumable", 1, status="failed", salt=100, plan=plan)
    notes: list[str] = []
    assert release.plan_releases(work, notes=notes) == []
    assert f"kept {NAME} v2: unfinished run resumable started from it" in notes

    record = json.loads((work / "runs" / "resumable" / "run.json").read_text())
    record["status"] = "completed"  # completed and kept (it registered nothing): v2 goes, its copy stays
    (work / "runs" / "resumable" / "run.json").write_text(json.dumps(record))
    assert release.release_old_versions(work)[1] == [f"{NAME} v2"]
    assert Manifest.load(copy.dir).pruned == {}
    gc_plan = retention.plan(work)
    assert f"kept the warm-start copy of {NAME} v2: run resumable started from it" in gc_plan.notes


def test_a_registry_out_of_reach_releases_nothing_and_gc_goes_on(tmp_path, capsys):
    from qerl.flows.cli import main

    config = {"store": {"keep_versions": 1}, "registry": {"tracking_uri": "http://127.0.0.1:9"}}
    for i in range(2):  # two completed nights registered on a server that no longer answers
        fake_run(tmp_path, f"n{i}", 2, status="completed", salt=2 * i, config=config,
                 registration={"model_name": NAME, "version": i + 1})  # fmt: skip
    notes: list[str] = []
    assert release.plan_releases(tmp_path, notes=notes) == []
    assert notes[0].startswith(
        f"released no version of {NAME}: the registry http://127.0.0.1:9 cannot be read"
    )
    assert main(["gc", "--work-dir", str(tmp_path)]) == 0  # the rest of gc still runs
    out = capsys.readouterr().out
    assert "cannot be read" in out and "freed" in out and "release" not in out.split("cannot be read")[1]
