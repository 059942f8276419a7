"""The register stage: MLflow run contents, version + aliases, idempotence, partial runs."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from qerl.pipeline.registry import promotion
from qerl.pipeline.registry import tracking as reg
from qerl.pipeline.store.artifact_store import ArtifactStore
from qerl.pipeline.store.manifest import BuildResult, Manifest
from qerl.stages import register

HISTORY = [
    {"step": s, "reward_mean": 0.2 + 0.1 * s, "reward_std": 0.3, "entropy": 1.5 - 0.2 * s, "kl": 0.01 * s,
     "clip_frac_low": 0.0, "sigma": [0.0, 0.01, 0.005][s], "tokens_per_s": 100.0 + s, "time_rollout_s": 1.5}
    for s in range(3)
]  # fmt: skip


def fake_train(store: ArtifactStore, tag: str) -> Manifest:
    def build(tmp: Path) -> BuildResult:
        (tmp / "adapter").mkdir()
        (tmp / "adapter" / "adapter_config.json").write_text(json.dumps({"r": 8, "tag": tag}))
        (tmp / "adapter" / "adapter_model.safetensors").write_bytes(tag.encode() * 16)
        return BuildResult(mode="test", metrics={"loss": 0.1})

    return store.produce("train", {"lora": {"r": 8}, "tag": tag}, {}, "code", build)[0]


def fake_eval(store: ArtifactStore, accuracy: float, bench: str = "arithmetic/test@abc") -> Manifest:
    def build(tmp: Path) -> BuildResult:
        rows = [{"id": "q1", "sample": 0, "correct": True}, {"id": "q2", "sample": 0, "correct": False}]
        pq.write_table(pa.Table.from_pylist(rows), tmp / "results.parquet")
        also = [{"benchmark": "gsm8k/test@def", "benchmark_name": "gsm8k", "split": "test", "accuracy": 0.25,
                 "stderr": 0.1, "n_items": 4}]  # fmt: skip
        summary = {
            "benchmark": bench,
            "accuracy": accuracy,
            "k": 1,
            "stderr": 0.05,
            "n_items": 2,
            "also": also,
        }
        (tmp / "summary.json").write_text(json.dumps(summary))
        return BuildResult(metrics={"accuracy": accuracy})

    return store.produce("evaluate", {"acc": accuracy, "bench": bench}, {}, "code", build)[0]


LINEAGE = {
    "base_digest": "b" * 16,
    "quant_recipe": "nvfp4a16",
    "dataset_digest": "d" * 16,
    "code_version": "c" * 16,
    "flow_run_id": "flow-1",
    "validation_digest": "v" * 64,
    "heldout_lineage": "v" * 64,  # a run from the bare base: its lineage held out its validation items
}


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("register-work")


@pytest.mark.slow
def test_register_stage(work):
    store = ArtifactStore(work / "store")
    cfg = reg.RegistryConfig(model_name="stage-adapter")
    train1, eval1 = fake_train(store, "one"), fake_eval(store, 0.5)
    m1 = register.run(cfg, train1, eval1, LINEAGE, HISTORY, work, True, store)
    record = json.loads(m1.file("registration.json").read_text())
    assert record["version"] == "1" and record["created"] and record["promoted"]
    assert record["aliases"] == ["challenger", "champion"] and m1.mode == "mlflow-sqlite"

    client = reg.MlflowClient()
    run = client.get_run(record["run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params["lora.r"] == "8" and run.data.tags["flow_run_id"] == "flow-1"
    for key in ("reward_mean", "reward_std", "entropy", "kl", "sigma", "tokens_per_s", "time_rollout_s"):
        assert len(client.get_metric_history(run.info.run_id, key)) == 3, key
    assert run.data.metrics["eval_accuracy"] == 0.5
    got = {k: v for k, v in run.data.metrics.items() if k.startswith("eval_")}
    assert got == {"eval_accuracy": 0.5, "eval_accuracy_stderr": 0.05, "eval_stderr": 0.05, "eval_n_items": 2,
                   "eval_k": 1, "eval_gsm8k_test_accuracy": 0.25, "eval_gsm8k_test_accuracy_stderr": 0.1,
                   "eval_gsm8k_test_n_items": 4}  # fmt: skip
    listed = {a.path for top in ("plots", "adapter", "adapter_manifest", "evaluation")
              for a in client.list_artifacts(run.info.run_id, top)}  # fmt: skip
    assert {"plots/reward.png", "plots/entropy.png", "plots/sigma.png", "adapter/adapter_config.json",
            "adapter/adapter_model.safetensors", "adapter_manifest/manifest.json",
            "evaluation/results.parquet", "evaluation/summary.json"} <= listed  # fmt: skip
    info = promotion.version_info(cfg, "1")
    assert info["tags"]["adapter_digest"] == train1.digest and info["tags"]["base_digest"] == "b" * 16

    # same inputs: the cached manifest, no new version
    assert register.run(cfg, train1, eval1, LINEAGE, HISTORY, work, True, store).key == m1.key
    # store lost (or a resumed run with a new flow run id): the registry still knows this adapter
    fresh = ArtifactStore(work / "store2")
    again = register.run(cfg, train1, eval1, {**LINEAGE, "flow_run_id": "flow-2"}, HISTORY, work, True, fresh)
    assert json.loads(again.file("registration.json").read_text())["created"] is False
    assert again.metrics["version"] == 1
    assert len(client.search_model_versions("name = 'stage-adapter'")) == 1

    # a worse run: registered, challenger, not champion
    m2 = register.run(
        cfg, fake_train(store, "two"), fake_eval(store, 0.4), LINEAGE, HISTORY, work, True, store
    )
    rec2 = json.loads(m2.file("registration.json").read_text())
    assert (rec2["version"], rec2["promoted"], rec2["aliases"]) == ("2", False, ["challenger"])
    # a partial run, however good: registered without aliases, never promoted
    m3 = register.run(
        cfg, fake_train(store, "three"), fake_eval(store, 0.99), LINEAGE, HISTORY, work, False, store
    )
    rec3 = json.loads(m3.file("registration.json").read_text())
    assert (rec3["version"], rec3["promoted"], rec3["aliases"]) == ("3", False, [])
    assert client.get_run(rec3["run_id"]).info.status == "FAILED"
    assert promotion.version_info(cfg, "3")["tags"]["complete"] == "false"
    assert str(promotion.alias_version(cfg, "champion").version) == "1"
    # a better complete run on the same benchmark takes over
    m4 = register.run(
        cfg, fake_train(store, "four"), fake_eval(store, 0.6), LINEAGE, HISTORY, work, True, store
    )
    assert m4.metrics["promoted"] and str(promotion.alias_version(cfg, "champion").version) == "4"


def test_register_rejects_bad_inputs(work):
    store = ArtifactStore(work / "store")
    cfg = reg.RegistryConfig(model_name="stage-bad")
    train, evaluation = fake_train(store, "bad"), fake_eval(store, 0.5)
    with pytest.raises(ValueError, match="lacks"):
        register.run(cfg, train, evaluation, {"base_digest": "x"}, HISTORY, work, True, store)
    with pytest.raises(ValueError, match="not train's digest"):
        register.run(
            cfg, train, evaluation, {**LINEAGE, "adapter_digest": "other"}, HISTORY, work, True, store
        )
    with pytest.raises(Exception, match="no adapter"):
        register.run(cfg, evaluation, evaluation, LINEAGE, HISTORY, work, True, store)


def test_register_is_idempotent_per_run_and_weights(work):
    """A rebuilt train step whose adapter_config.json differs (a new train digest) but whose weights are
    the same bytes is the same registration for the same run: no second version, no alias moves. Another
    run with the same weights is a version of its own; a later run with the very same adapter reuses
    that version and names the run that registered it."""
    from qerl.flows.report import registered_line
    from qerl.pipeline.store.run_record import RunRecord

    store = ArtifactStore(work / "store-weights")
    cfg = reg.RegistryConfig(model_name="weights-adapter")

    def train_with(config: dict) -> Manifest:
        def build(tmp: Path) -> BuildResult:
            (tmp / "adapter").mkdir()
            (tmp / "adapter" / "adapter_config.json").write_text(json.dumps(config))
            (tmp / "adapter" / "adapter_model.safetensors").write_bytes(b"same weights" * 8)
            return BuildResult(mode="test")

        return store.produce("train", {"config": config}, {}, "code", build)[0]

    lineage = {**LINEAGE, "run_id": "night-abc-20260101"}
    first = train_with({"r": 8, "target_modules": ["q_proj", "v_proj"]})
    rebuilt = train_with({"r": 8, "target_modules": ["v_proj", "q_proj"]})
    assert first.digest != rebuilt.digest
    m1 = register.run(cfg, first, fake_eval(store, 0.5), lineage, HISTORY, work, True, store)
    m2 = register.run(cfg, rebuilt, fake_eval(store, 0.5), lineage, HISTORY, work, True, store)
    rec = json.loads(m2.file("registration.json").read_text())
    assert (rec["version"], rec["created"]) == ("1", False) and m1.metrics["version"] == 1
    client = reg.MlflowClient()
    assert len(client.search_model_versions("name = 'weights-adapter'")) == 1
    assert str(promotion.alias_version(cfg, "challenger").version) == "1"
    tags = promotion.version_info(cfg, "1")["tags"]
    assert tags["adapter_weights_digest"] == promotion.weights_digest(first.dir / "adapter")
    # the same weights from another run: its own version
    other = register.run(
        cfg, rebuilt, fake_eval(store, 0.5), {**lineage, "run_id": "night-abc-20260102"}, HISTORY, work,
        True, store,
    )  # fmt: skip
    assert json.loads(other.file("registration.json").read_text())["created"] is True
    assert len(client.search_model_versions("name = 'weights-adapter'")) == 2
    # a later night whose training left that adapter byte-identical reuses its version, and says whose
    later = register.run(
        cfg, rebuilt, fake_eval(store, 0.5), {**lineage, "run_id": "night-abc-20260103"}, HISTORY, work,
        True, store,
    )  # fmt: skip
    rec = json.loads(later.file("registration.json").read_text())
    assert (rec["version"], rec["created"], rec["registered_by"]) == ("2", False, "night-abc-20260102")
    record = RunRecord.model_validate(
        {"run_id": "night-abc-20260103", "registration": {**later.extra, **later.metrics}}
    )
    assert record.earlier_registration() == "night-abc-20260102"
    assert registered_line(record.registration, "night-abc-20260102") == (
        "already registered: weights-adapter v2, by run night-abc-20260102 (the same adapter), not champion"
    )
    own = RunRecord.model_validate(
        {"run_id": "night-abc-20260102", "registration": {**other.extra, **other.metrics}}
    )
    assert own.earlier_registration() is None and registered_line(own.registration, None).startswith(
        "registered weights-adapter v2, "
    )


def test_a_reused_version_keeps_its_promotion_decision(work, monkeypatch):
    """A registration rebuilt after its key changed (an upgrade of this stage), with no champion
    evaluation passed (a re-run of a registered night), reuses the version and keeps its decision:
    its higher recorded accuracy does not crown it over the champion it was never shown to beat."""
    store = ArtifactStore(work / "store-keep")
    cfg = reg.RegistryConfig(model_name="keep-adapter")
    champion = register.run(
        cfg, fake_train(store, "k1"), fake_eval(store, 0.5), LINEAGE, HISTORY, work, True, store
    )
    assert champion.metrics["promoted"]
    lineage = {**LINEAGE, "run_id": "night-keep-2"}
    train2, eval2 = fake_train(store, "k2"), fake_eval(store, 0.75)
    lost = register.run(
        cfg, train2, eval2, lineage, HISTORY, work, True, store, champion_eval="its base differs"
    )  # fmt: skip
    assert not lost.metrics["promoted"]
    reason = promotion.version_info(cfg, "2")["tags"]["promotion"]

    monkeypatch.setattr(register, "code_version", lambda module: "an upgraded register stage")
    again = register.run(cfg, train2, eval2, lineage, HISTORY, work, True, store)
    assert again.key != lost.key and again.metrics == {"version": 2, "promoted": False, "created": False}
    assert str(promotion.alias_version(cfg, "champion").version) == "1"
    assert promotion.version_info(cfg, "2")["tags"]["promotion"] == reason


def test_registration_completes_the_live_run(work):
    """The MLflow run the flow logged steps into becomes the registered version's run: the steps it
    has are not logged twice, the rest are, and it ends FINISHED."""
    from qerl.pipeline.registry import live

    store = ArtifactStore(work / "store-live")
    cfg = reg.RegistryConfig(model_name="live-adapter")
    from qerl.pipeline.store.run_record import RunRecord

    record = RunRecord.model_validate({"run_id": "tiny-live", "flow_run_id": "flow-live",
                                       "config": {"loop": {"steps": 3}}, "steps": HISTORY[:2]})  # fmt: skip
    opened = live.open_run(cfg, work, record, None, {"night": "2026-01-01"})
    assert live.log_record(opened, record) > 0 and record.mlflow_run_id == opened.run_id
    lineage = {**LINEAGE, "run_id": "tiny-live"}
    m = register.run(
        cfg, fake_train(store, "live"), fake_eval(store, 0.5), lineage, HISTORY, work, True, store,
        mlflow_run_id=opened.run_id,
    )  # fmt: skip
    assert m.extra["run_id"] == opened.run_id
    client = reg.MlflowClient()
    assert sorted(p.step for p in client.get_metric_history(opened.run_id, "reward_mean")) == [0, 1, 2]
    assert [p.step for p in client.get_metric_history(opened.run_id, "eval_accuracy")] == [2]
    run = client.get_run(opened.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["complete"] == "true"
    assert run.data.tags["night"] == "2026-01-01" and run.data.params["lora.r"] == "8"
    live.end_run(opened, failed=False)  # registration ended it: stays FINISHED
    assert client.get_run(opened.run_id).info.status == "FINISHED"


def test_an_ablations_version_reused_by_a_candidate_is_decided(work):
    """The same adapter registered first by an ablation's arm (never a candidate) and then by a plain
    run: the plain run's registration reuses the version and decides its promotion."""
    store = ArtifactStore(work / "store-arm")
    cfg = reg.RegistryConfig(model_name="arm-adapter")
    train, evaluation = fake_train(store, "arm"), fake_eval(store, 0.5)
    arm = register.run(cfg, train, evaluation, LINEAGE, HISTORY, work, True, store, promote=False)
    assert not arm.metrics["promoted"] and promotion.alias_version(cfg, "champion") is None
    plain = register.run(cfg, train, evaluation, LINEAGE, HISTORY, work, True, store)
    assert plain.metrics == {"version": 1, "promoted": True, "created": False}
