"""Nightly runs: a new run per night, warm start from the champion, the data cursor, promotion on a win.

Three "nights" are driven in one process through ``qerl.flows.run_here(..., night=...)`` (what the
deployment does with Prefect's scheduled date), on the transformers engine and a tiny model.
"""

from __future__ import annotations

import datetime as dt
import json
from collections import Counter
from pathlib import Path
from urllib.parse import urlparse

import pyarrow.parquet as pq
import pytest
from qerl.pipeline.planning.errors import RunPlanError
from qerl.pipeline.planning.prompt_stream import (
    DataCursor,
    data_slice,
    parse_night,
    slots_per_epoch,
    step_prompts,
)
from qerl.pipeline.planning.warm_start import warm_start_adapter
from qerl.pipeline.store.layout import WARM_START_STAGE
from qerl.pipeline.store.manifest import Manifest

N_PROBLEMS = 80
LONG_ID = f"math500-{N_PROBLEMS}"


def _dataset(path: Path) -> Path:
    """80 level-1 arithmetic problems in MATH-500's schema (what the learner model was warmed up on),
    then one too long for the context (``LONG_ID``)."""
    from qerl.pipeline.data.arithmetic import arithmetic_problems

    rows = [
        {"problem": p["question"], "answer": p["answer"]}
        for p in arithmetic_problems(N_PROBLEMS, seed=3, split="train", levels=[1])
    ]
    rows.append({"problem": " ".join(["a very long question"] * 60) + " 1 + 1 =", "answer": "2"})
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def _night_config(model_dir: Path, data: Path) -> dict:
    from learning import learning_run_config

    cfg = learning_run_config(model_dir)
    cfg["data"] = {"dataset": str(data), "template": "terse"}
    cfg["loop"].update(name="nightly", steps=3, prompts_per_step=6)
    cfg["train"]["total_steps"] = None  # derived from the steps
    cfg["eval"]["validation"] = {"size": 24}  # about 20 problems held out (a seeded hash of their ids)
    cfg["eval"]["k"] = 4
    cfg["eval"]["temperature"] = 0.6
    return cfg


def _rollout_ids(work: Path, record: dict) -> list[str]:
    ids = []
    for step in record["steps"]:
        table = pq.read_table(
            work / "store" / "objects" / "rollout" / step["manifests"]["rollout"] / "rollouts.parquet"
        )
        ids += sorted(set(table.column("prompt_id").to_pylist()))
    return ids


def _manifest(work: Path, stage: str, key: str) -> dict:
    return json.loads((work / "store" / "objects" / stage / key / "manifest.json").read_text())


def _night(base: dict, lr: float, warm_start: str = "champion", **store: object) -> dict:
    """One night's config: the base config with its learning rate, warm start and store settings."""
    cfg = json.loads(json.dumps(base))
    cfg["train"]["lr"] = lr
    cfg["loop"]["warm_start"] = warm_start
    cfg["store"].update(store)
    return cfg


@pytest.mark.slow
def test_nights_advance_data_warm_start_and_promote_on_merit_only(learner_model_dir, tmp_path):
    """Four nights on a model that learns: night 1 trains at a learning rate that ruins the policy and
    is not promoted (it does not beat the base model; it sets the registered model's policy); an
    operator makes it champion by hand; night 2, a fresh LoRA at a sane rate, beats that champion on
    the validation items by the rule; night 3 warm-starts from night 2's champion at a ruinous rate
    and loses; night 4 keeps one version."""
    from learning import assert_trained
    from mlflow.tracking import MlflowClient
    from prefect_home import resume_here, run_here
    from qerl.pipeline.planning.run_config import RunConfig
    from qerl.pipeline.registry import promotion
    from qerl.pipeline.registry.policy import read_policy
    from qerl.pipeline.registry.protocol import PROTOCOL_FILE, SECTIONS, read_protocol

    base = _night_config(learner_model_dir, _dataset(tmp_path / "data.jsonl"))
    work = tmp_path / "work"
    nights = [(4e-2, "champion"), (1e-3, "base"), (3e-1, "champion")]
    configs = [RunConfig.model_validate(_night(base, lr, warm)) for lr, warm in nights]
    records = [run_here(configs[0], work, dt.date(2026, 1, 1))]
    ruined = records[0]["registration"]
    assert not ruined["promoted"] and ruined["promotion"].startswith("does not beat the base model"), ruined
    assert (
        "vs the base model (no adapter)" in ruined["promotion"] and "margin max(2.0 se" in ruined["promotion"]
    )
    rule = read_policy("qerl-adapter")
    assert rule.margin_se == 2.0 and rule.benchmark == ruined["decided_on"] and "run nightly" in rule.set_by
    promotion.promote(configs[0].registry, "qerl-adapter", "1")  # an operator's hand
    records += [run_here(cfg, work, dt.date(2026, 1, 2 + i)) for i, cfg in enumerate(configs[1:])]

    # each night is its own run, id carrying the date, and each trained on mixed rewards
    assert [r["run_id"].rsplit("-", 1)[1] for r in records] == ["20260101", "20260102", "20260103"]
    assert len({r["run_id"] for r in records}) == 3 and all(r["status"] == "completed" for r in records)
    for record, (lr, _) in zip(records, nights, strict=True):
        assert_trained(work, record, signal_steps=1 if lr > 1e-2 else None)  # a ruinous rate: once, then none
    # three versions; the champion moves by hand to v1 and on night 2, which beats it on the validation
    # items (the champion re-evaluated beside it under the same protocol), not on night 3
    assert [str(r["registration"]["version"]) for r in records] == ["1", "2", "3"]
    assert [bool(r["registration"]["promoted"]) for r in records] == [False, True, False]
    assert read_policy("qerl-adapter") == rule  # the nights' own configs changed nothing of it
    won, lost = records[1]["registration"]["promotion"], records[2]["registration"]["promotion"]
    assert won.startswith("beats the champion") and "vs champion v1" in won, won
    assert lost.startswith("does not beat the champion") and "vs champion v2" in lost, lost
    assert all(r["registration"]["decided_on"].startswith("data/validation@") for r in records)
    assert str(MlflowClient().get_model_version_by_alias("qerl-adapter", "champion").version) == "2"
    # each version carries its run's protocol, for `qerl eval` where the run's record is not
    logged = read_protocol(MlflowClient().get_model_version("qerl-adapter", "3"))
    assert logged == {"run_id": records[2]["run_id"], **{k: records[2]["config"][k] for k in SECTIONS}}

    # the data advances: disjoint slices, the cursor after the last night, the long prompt dropped
    assert [r["plan"]["start_slot"] for r in records] == [0, 3, 6]
    used = [_rollout_ids(work, r) for r in records]
    assert all(len(u) == 18 for u in used)
    assert max(Counter(i for u in used for i in u).values()) == 1, used
    assert LONG_ID not in {i for u in used for i in u}
    held = {r["data"]["validation"]["n_items"] for r in records}
    assert (
        len(held) == 1 and held.pop() > 10 and len({r["data"]["validation"]["digest"] for r in records}) == 1
    )
    assert all(r["data"]["dropped_too_long"] == 1 and r["data"]["kept"] == N_PROBLEMS for r in records)
    cursor = json.loads((work / "cursors" / "nightly.json").read_text())
    assert [s["next_slot"] for s in cursor["streams"].values()] == [9]

    # warm start: none on night 1, none on night 2 (loop.warm_start: base), night 3 from champion v2
    assert [r["plan"]["warm_start"] for r in records[:2]] == [{"from": "base", "version": None}] * 2
    warm = records[2]["plan"]["warm_start"]
    assert warm["from"] == "champion" and warm["version"] == "2"
    first = records[2]["steps"][0]["manifests"]
    assert _manifest(work, "rollout", first["rollout"])["inputs"]["adapter"] == warm["digest"]
    assert _manifest(work, "train", first["train"])["inputs"]["init_adapter"] == warm["digest"]
    # the champion's weights really are the next night's starting point
    warm_dirs = {
        Manifest.load(d).digest: d for d in (work / "store" / "objects" / WARM_START_STAGE).glob("*")
    }
    fetched = warm_dirs[warm["digest"]] / "adapter" / "adapter_model.safetensors"
    champion_adapter = Path(records[1]["final_adapter"]) / "adapter_model.safetensors"
    assert fetched.read_bytes() == champion_adapter.read_bytes()

    # resuming night 3 is night 3: same slice, same warm start (v2, though v3 is champion now), nothing rebuilt
    promotion.promote(configs[2].registry, "qerl-adapter", "3")
    builds = (work / "store" / "builds.jsonl").read_text().count("\n")
    v3 = MlflowClient().get_model_version("qerl-adapter", "3")
    (Path(urlparse(MlflowClient().get_run(v3.run_id).info.artifact_uri).path) / PROTOCOL_FILE).unlink()
    assert read_protocol(v3) is None  # as for a version registered before protocol.json existed
    again = resume_here(records[2]["run_id"], work)
    assert read_protocol(v3)["run_id"] == records[2]["run_id"]  # the re-run logged it again
    assert again["plan"]["start_slot"] == 6 and again["plan"]["warm_start"]["version"] == "2"
    assert again["final_adapter"] == records[2]["final_adapter"]
    assert (work / "store" / "builds.jsonl").read_text().count("\n") == builds
    assert json.loads((work / "cursors" / "nightly.json").read_text()) == cursor

    # a fourth night, from champion v2 again (an operator's promotion), under store.keep_versions 1
    # releases v1 and v3 (v2 is champion, v4 the newest and challenger): their MLflow copies and their
    # nights' adapters go; v2's warm-start copy stays, as night 3 (released, but its record kept)
    # and night 4 started from it
    promotion.promote(configs[2].registry, "qerl-adapter", "2")
    records.append(
        run_here(RunConfig.model_validate(_night(base, 1e-3, keep_versions=1)), work, dt.date(2026, 1, 4))
    )
    assert records[3]["plan"]["warm_start"]["version"] == "2" and not records[3]["registration"]["promoted"]
    client = MlflowClient()
    released = {v: "released" in client.get_model_version("qerl-adapter", v).tags for v in "1234"}
    assert released == {"1": True, "2": False, "3": True, "4": False}
    for record, gone in zip(records, [True, False, True, False], strict=True):
        pruned = Manifest.load(Path(record["final_adapter"]).parent).pruned
        assert ("adapter/adapter_model.safetensors" in pruned) == gone, record["run_id"]
        version = client.get_model_version("qerl-adapter", str(record["registration"]["version"]))
        assert Path(urlparse(version.source).path).exists() != gone
    assert Manifest.load(warm_dirs[warm["digest"]]).pruned == {}
    # manifests stay: re-running released night 1, and night 2, is all cache hits
    builds = (work / "store" / "builds.jsonl").read_text().count("\n")
    for record in records[:2]:
        assert resume_here(record["run_id"], work)["status"] == "completed"
    assert (work / "store" / "builds.jsonl").read_text().count("\n") == builds


def test_data_slices_wrap_into_a_new_shuffled_epoch():
    problems = [{"id": str(i)} for i in range(7)]
    per_epoch = slots_per_epoch(len(problems), 2)  # 3 whole slots, one problem sits out
    assert per_epoch == 3
    epoch0 = [p["id"] for s in range(3) for p in step_prompts(problems, s, 2, seed=0)]
    epoch1 = [p["id"] for s in range(3, 6) for p in step_prompts(problems, s, 2, seed=0)]
    assert (
        len(set(epoch0)) == 6 and len(set(epoch1)) == 6 and epoch0 != epoch1
    )  # reshuffled, no repeats within
    assert data_slice(2, 3, len(problems), 2)["epochs"] == [0, 1]
    assert data_slice(0, 3, len(problems), 2)["epochs"] == [0]


def test_cursor_advances_only_forward_and_atomically(tmp_path):
    cursor = DataCursor(tmp_path, "nightly")
    assert cursor.position("s") == 0
    assert cursor.advance("s", 4, "night-1") == 4
    assert cursor.advance("s", 2, "night-0-resumed") == 4  # re-completing an older night never rewinds
    assert cursor.position("s") == 4 and cursor.position("other-stream") == 0
    assert not list((tmp_path / "cursors").glob("*.tmp"))
    cursor.path.write_text("{")  # damaged outside qerl: the error names the file, which is kept
    with pytest.raises(ValueError, match=f"{cursor.path} cannot be read as JSON"):
        cursor.position("s")
    assert cursor.path.read_text() == "{"


def test_night_parsing_and_the_scheduled_date(monkeypatch):
    import qerl.flows.run as rl

    assert parse_night("2026-03-04") == dt.date(2026, 3, 4)
    assert parse_night(
        dt.datetime(2026, 3, 4, 23, 30, tzinfo=dt.timezone(dt.timedelta(hours=-5)))
    ) == dt.date(2026, 3, 5)
    with pytest.raises(RunPlanError, match="not a date"):
        parse_night("tomorrow-ish")

    class FakeFlowRun:
        scheduled_start_time = dt.datetime(2026, 5, 6, 2, 0, tzinfo=dt.UTC)

    monkeypatch.setattr(rl, "flow_run", FakeFlowRun)
    assert rl._night(True, None) == dt.date(2026, 5, 6)  # the deployment's scheduled date
    assert rl._night(True, "2026-01-01") == dt.date(2026, 1, 1)
    assert rl._night(False, None) is None  # a plain run


def test_warm_start_refuses_a_champion_of_another_base_or_lora_shape(tmp_path):
    from qerl.pipeline.planning.run_config import RunConfig
    from qerl.pipeline.registry import promotion
    from qerl.pipeline.registry import tracking as registry
    from qerl.pipeline.store.artifact_store import ArtifactStore

    cfg = RunConfig.model_validate(
        {"registry": {"model_name": "warm-probe"}, "train": {"lora_r": 16, "lora_alpha": 32}}
    )
    work = tmp_path / "work"
    store = ArtifactStore(work / "store")
    reg = registry.connect(cfg.registry, work)
    assert warm_start_adapter(cfg, work, store, "base-A") is None  # no champion yet: the base

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    shape = {"r": 8, "lora_alpha": 16, "target_modules": list(cfg.train.target_modules)}
    (adapter / "adapter_config.json").write_text(json.dumps(shape))
    (adapter / "adapter_model.safetensors").write_bytes(b"weights")
    lineage = {"base_digest": "base-A", "quant_recipe": "q", "dataset_digest": "d", "code_version": "c",
               "flow_run_id": "f", "adapter_digest": "adapter-1"}  # fmt: skip
    run_id = registry.start_run(reg, run_name="probe")
    version, _ = promotion.register_adapter(
        reg, run_id, adapter, None, {"benchmark": "b", "accuracy": 0.5}, lineage
    )
    assert promotion.maybe_promote(reg, version, "b", 0.5, complete=True)

    with pytest.raises(RunPlanError, match="trained on base base-A, this run's base is base-B"):
        warm_start_adapter(cfg, work, store, "base-B")
    with pytest.raises(RunPlanError, match=r"cannot warm-start this run .*'r': 8"):
        warm_start_adapter(cfg, work, store, "base-A")  # r=8 adapter, r=16 run
    ok = cfg.model_copy(update={"train": cfg.train.model_copy(update={"lora_r": 8, "lora_alpha": 16})})
    warm = warm_start_adapter(ok, work, store, "base-A")
    assert (
        warm is not None and (warm.dir / "adapter" / "adapter_model.safetensors").read_bytes() == b"weights"
    )
    assert warm.extra["version"] == version


def test_init_state_from_an_adapter_takes_its_weights_and_a_fresh_optimizer(tiny_model_dir, tmp_path):
    import torch
    from qerl.pipeline.rl.checkpoint import save_checkpoint
    from qerl.pipeline.rl.policy import init_state
    from qerl.pipeline.rl.train_config import TrainConfig

    cfg = TrainConfig(lora_r=8, lora_alpha=16, dtype="float32")
    donor = init_state(tiny_model_dir, cfg)
    with torch.no_grad():
        trainable = [p for p in donor.model.parameters() if p.requires_grad]
        for i, p in enumerate(trainable):
            p.add_(0.01 * (1 + i % 7))  # lora_B is zero at init: make every weight nonzero and distinct
    save_checkpoint(donor, tmp_path / "ckpt")
    want = {n: p.detach().clone() for n, p in donor.model.named_parameters() if p.requires_grad}

    warm = init_state(
        tiny_model_dir, cfg.model_copy(update={"seed": 1}), init_adapter=tmp_path / "ckpt" / "adapter"
    )
    got = {n: p.detach() for n, p in warm.model.named_parameters() if p.requires_grad}
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
    assert warm.step == 0 and warm.updates == 0 and not warm.optimizer.state_dict()["state"]
    with pytest.raises(ValueError, match="was trained with"):
        init_state(
            tiny_model_dir, cfg.model_copy(update={"lora_r": 16}), init_adapter=tmp_path / "ckpt" / "adapter"
        )
