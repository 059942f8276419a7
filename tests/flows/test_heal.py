"""Runs that share a prefix of artifacts with a run whose retention pruned them (issue 13's ablation:
the AQN arm equals the no-AQN arm while sigma is 0, then needs the checkpoint the other arm pruned).
The pruned checkpoint is rebuilt, checked against its recorded digests and put back."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from qerl.pipeline.store.artifact_store import ArtifactStore
from qerl.pipeline.store.manifest import BuildResult


def _produce(store: ArtifactStore, payload: bytes, heal: bool = False):
    def build(tmp: Path) -> BuildResult:
        (tmp / "state").mkdir()
        (tmp / "state" / "opt.bin").write_bytes(payload)
        (tmp / "adapter.bin").write_bytes(b"adapter")
        return BuildResult()

    return store.produce("train", {"x": 1}, {"prev": "none"}, "code", build, heal=heal)


def test_a_pruned_artifact_is_rebuilt_and_put_back_only_with_the_same_bytes(tmp_path):
    store = ArtifactStore(tmp_path / "store")
    made, cached = _produce(store, b"moments")
    assert not cached
    store.prune("train", made.key, ["state/opt.bin"], "older than its last step")
    hit, cached = _produce(store, b"moments")
    assert cached and "state/opt.bin" in hit.pruned  # without heal a lookup serves it as it is
    healed, cached = _produce(store, b"moments", heal=True)
    assert not cached and healed.pruned == {}
    assert (healed.dir / "state" / "opt.bin").read_bytes() == b"moments"
    assert healed.digest == made.digest  # downstream keys stay valid
    events = [json.loads(line) for line in (tmp_path / "store" / "gc.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["pruned", "healed"]


def test_a_rebuild_with_other_bytes_is_rekeyed_not_a_failure(tmp_path):
    """A GPU rebuild does not reproduce the bytes: the heal stores a new artifact under a new key
    (its digest differs, so whatever is built on it gets new keys) instead of failing every time."""
    store = ArtifactStore(tmp_path / "store")
    made, _ = _produce(store, b"moments")
    store.prune("train", made.key, ["state/opt.bin"], "the run completed")
    new, cached = _produce(store, b"nondeterministic", heal=True)
    assert not cached and new.key != made.key and new.digest != made.digest and new.pruned == {}
    assert (new.dir / "state" / "opt.bin").read_bytes() == b"nondeterministic"
    assert new.extra["rekeyed_from"] == made.key and "state/opt.bin" in new.extra["rekey_reason"]
    assert new.config == made.config and new.inputs == made.inputs
    old = store.get("train", made.key)
    assert old.extra["rekeyed_to"] == new.key and "state/opt.bin" in old.pruned  # the old one stays
    again, _ = _produce(store, b"other again", heal=True)  # found, not rebuilt a second time
    assert again.key == new.key and (again.dir / "state" / "opt.bin").read_bytes() == b"nondeterministic"
    store.prune("train", new.key, ["state/opt.bin"], "the run completed")
    third, _ = _produce(store, b"third bytes", heal=True)  # the re-keyed one pruned too: re-keyed on
    assert third.extra["rekeyed_from"] == new.key and third.key not in (made.key, new.key)
    events = [json.loads(line) for line in (tmp_path / "store" / "gc.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["pruned", "rekeyed", "pruned", "rekeyed"]


@pytest.mark.slow
def test_a_run_continues_from_a_checkpoint_another_run_pruned(learner_model_dir, tmp_path):
    """Run A (AQN off, keep 1 optimizer state) prunes its step-1 checkpoint; run B (AQN on, sigma 0
    for steps 0-1) finds steps 0-1 cached, then must build step 2 from A's pruned step 1. Both learn
    (tests/learning.py), so the healed steps' bytes are a real match, not two untrained adapters."""
    from learning import assert_trained, learning_run_config
    from prefect_home import run_here
    from qerl.pipeline.planning.run_config import RunConfig

    from tests.flows.test_flow import _journal

    cfg = learning_run_config(learner_model_dir)
    cfg["loop"]["steps"] = 4
    cfg["train"]["total_steps"] = None
    cfg["aqn"] = {"num_stages": 2, "enabled": False}
    cfg["store"]["keep_optimizer_last"] = 1
    work = tmp_path / "work"
    records = []
    for aqn in (False, True):
        cfg["aqn"]["enabled"] = aqn
        records.append(run_here(RunConfig.model_validate(cfg), work))
        assert records[-1]["status"] == "completed", records[-1].get("error")
    a, b = records
    for record in records:
        assert_trained(work, record)
    keys = [[s["manifests"]["train"] for s in r["steps"]] for r in (a, b)]
    assert keys[0][:2] == keys[1][:2] and keys[0][2:] != keys[1][2:]  # a shared prefix, then apart
    gc_events = [json.loads(line) for line in (work / "store" / "gc.jsonl").read_text().splitlines()]
    # A kept step 3's optimizer state only: B rebuilds steps 0 and 1 (same bytes), then builds on
    assert [e["key"] for e in gc_events if e["event"] == "healed"] == keys[0][:2], gc_events
    assert not [e for e in gc_events if e["event"] == "rekeyed"], gc_events
    assert max(Counter((e["stage"], e["key"]) for e in _journal(work)).values()) == 1


from tests.stages.test_evaluation import FakeEngine, base  # noqa: E402,F401 (base: a fixture)

PRUNED_ADAPTER = ["adapter/adapter_config.json", "adapter/adapter_model.safetensors"]


def test_every_consumer_of_a_pruned_adapter_names_the_step_and_file(base, tmp_path):  # noqa: F811
    """Rollout, evaluate and register fail on a pruned adapter with the retention error (which
    step, which file, why) before touching the engine or MLflow; a cache hit needs no adapter."""
    from qerl.pipeline.data.datasets import load_problems
    from qerl.pipeline.data.rewards import RewardConfig
    from qerl.pipeline.evaluation import eval_config
    from qerl.pipeline.registry import tracking
    from qerl.pipeline.rollout.config import RolloutConfig
    from qerl.pipeline.store.retention_inputs import PrunedInputError
    from qerl.stages import evaluate, register, rollout

    from tests.pipeline.test_gc import fake_step
    from tests.stages.test_register import LINEAGE, fake_eval

    store, base_manifest, tokenizer = base
    step0 = fake_step(store, "r", 0, None)
    step1 = fake_step(store, "r", 1, step0)
    problems = [{"id": "p1", "question": "What is 2 + 2?", "answer": "4"}]
    ecfg = eval_config.EvalConfig.model_validate({"benchmark": {"limit": 2}, "k": 1})
    answers = {p["question"]: p["answer"] for p in [*problems, *load_problems(ecfg.benchmark)]}
    engine = FakeEngine(answers, tokenizer)

    def consume(train):
        adapter = train.dir / "adapter"
        yield lambda: rollout.run(
            cfg=RolloutConfig(n_samples=1), problems=problems, base=base_manifest, adapter_dir=adapter,
            adapter_digest=train.digest, sigma=0.0, step=2, store=store, engine=engine,
        )  # fmt: skip
        yield lambda: evaluate.run(
            ecfg, base_manifest, adapter, train.digest, store, engine, RewardConfig(workers=1)
        )
        yield lambda: register.run(
            tracking.RegistryConfig(model_name="m"),
            train,
            fake_eval(store, 0.5),
            LINEAGE,
            [],
            tmp_path,
            True,
            store,
        )

    made = [c() for c in list(consume(step1))[:2]]  # built while the adapter is whole
    store.prune("train", step1.key, PRUNED_ADAPTER, "run r step 1: not a multiple of 5 steps")
    pruned = store.get("train", step1.key)
    expect = (
        r"needs the adapter of train step 1 .*'adapter/adapter_config.json' was deleted by retention "
        r"\(pruned .*not a multiple of 5 steps\)"
    )
    for call, was in zip(consume(pruned), [*made, None], strict=True):
        if was is not None:
            assert call().key == was.key  # a cache hit: the adapter is not read
            store._discard(was.dir)  # now a miss: the consumer must build
        calls = len(engine.calls)
        with pytest.raises(PrunedInputError, match=expect) as err:
            call()
        assert (err.value.stage, err.value.key) == ("train", step1.key)
        assert len(engine.calls) == calls  # failed before the engine was touched


def test_the_flow_rebuilds_a_pruned_adapter_its_consumer_needs(monkeypatch):
    """``Chain.build_from_last``: the consumer's PrunedInputError for the last checkpoint rebuilds the
    chain (possibly re-keyed) and calls the consumer again with the rebuilt checkpoint's adapter;
    another artifact's error is not ours to heal."""
    import logging
    from types import SimpleNamespace

    from qerl.flows.steps import Chain
    from qerl.pipeline.store.retention_inputs import PrunedInputError

    prev = SimpleNamespace(stage="train", key="k1", dir=Path("/k1"), digest="d1")
    healed = SimpleNamespace(stage="train", key="k2", dir=Path("/k2"), digest="d2")
    chain = Chain(SimpleNamespace(logger=logging.getLogger("test")), None, None)
    chain.links = [("scored", prev)]
    monkeypatch.setattr(chain, "_rebuild", lambda: chain.links.__setitem__(-1, ("scored", healed)))
    seen = []

    def consumer(adapter):
        seen.append(adapter.digest)
        if adapter.digest == "d1":
            raise PrunedInputError("rollout step 2 needs the adapter of train step 1", "train", "k1")
        return "rollouts"

    assert chain.build_from_last(consumer) == "rollouts" and chain.last is healed
    assert seen == ["d1", "d2"]
    chain.links = [("scored", SimpleNamespace(stage="train", key="other", dir=Path("/o"), digest="d1"))]
    with pytest.raises(PrunedInputError):
        chain.build_from_last(consumer)


def test_a_chain_rebuilt_on_nondeterministic_hardware_is_rekeyed_and_recorded(
    tiny_model_dir, tmp_path, monkeypatch
):
    """The real train stage, as on a GPU: every rebuild's optimizer state differs in its last bit.
    ``heal_chain`` re-keys the rebuilt checkpoint, builds the next on it, names both in the run
    record, and the run goes on from them (before: the heal failed, every time)."""
    import logging
    from types import SimpleNamespace

    from qerl.flows.steps import Chain
    from qerl.pipeline.nvfp4.recipe import QuantizeConfig
    from qerl.pipeline.rl.policy import init_state
    from qerl.pipeline.rl.train_config import TrainConfig
    from qerl.pipeline.store.run_record import RunRecord
    from qerl.stages import quantize, train

    from tests.stages.test_train import PROMPTS, TINY, _scored_manifest, sample_batch

    cfg = TrainConfig(**TINY, lr=1e-2)
    store = ArtifactStore(tmp_path / "store")
    qbase = quantize.run(QuantizeConfig(), str(tiny_model_dir), store)
    sampler = init_state(qbase.dir, cfg)
    scored = [
        _scored_manifest(
            store, sample_batch(sampler.model, PROMPTS, 3, 3, 10 + s, lambda c: c[0] % 2), f"s{s}"
        )
        for s in range(3)
    ]
    chain: list = []
    for s in range(2):
        prev = chain[-1] if chain else None
        chain.append(train.run(cfg=cfg, base=qbase, scored=scored[s], prev=prev, step=s, store=store))
    for m in chain:  # the other run completed: its optimizer states went
        store.prune("train", m.key, ["optimizer.safetensors"], "the run completed")
    train.drop_resident_policy()
    real_save = train.save_checkpoint

    def noisy_save(state, out):  # the last bit of the AdamW moments differs, as GPU kernels do
        real_save(state, out)
        path = Path(out) / "optimizer.safetensors"
        data = bytearray(path.read_bytes())
        data[-1] ^= 1
        path.write_bytes(bytes(data))

    monkeypatch.setattr(train, "save_checkpoint", noisy_save)
    steps = [{"step": s, "manifests": {"train": m.key}} for s, m in enumerate(chain)]
    record = RunRecord.model_validate({"run_id": "b", "steps": steps})
    run = SimpleNamespace(
        cfg=SimpleNamespace(train=cfg), store=store, run_id="b", record=record, logger=logging.getLogger("t")
    )
    rebuilt = Chain(run, qbase, None)
    rebuilt.links = [(scored[s], store.get("train", m.key)) for s, m in enumerate(chain)]
    rebuilt._rebuild()
    last = rebuilt.last
    saved = record.to_json()["steps"]
    new = [saved[s]["manifests"]["train"] for s in range(2)]
    assert new[0] != chain[0].key and new[1] != chain[1].key and last.key == new[1] and last.pruned == {}
    assert saved[0]["rekeyed"]["from"] == chain[0].key
    assert "optimizer.safetensors" in saved[0]["rekeyed"]["why"]
    assert "re-keyed checkpoint" in saved[1]["rekeyed"]["why"]
    assert store.get("train", chain[0].key).extra["rekeyed_to"] == new[0]
    step2 = train.run(cfg=cfg, base=qbase, scored=scored[2], prev=last, step=2, store=store)
    assert step2.extra["steps_done"] == 3  # the run goes on from the re-keyed chain
