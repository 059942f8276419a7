"""Registered adapters read back (``qerl.pipeline.registry.adapters``) and ``qerl eval --adapter models:/``."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from qerl.pipeline.registry import adapters, promotion
from qerl.pipeline.registry import tracking as registry
from qerl.pipeline.registry.lock import RegistryError
from qerl.pipeline.store.artifact_store import ArtifactStore


def _register(
    work: Path, adapter: Path, base_digest: str, name: str = "qerl-adapter", run_id: str | None = None
) -> str:
    """``adapter`` registered as a version of ``name`` trained on ``base_digest`` (by run ``run_id``),
    made champion."""
    reg = registry.connect(registry.RegistryConfig(model_name=name), work)
    lineage = {"base_digest": base_digest, "quant_recipe": "q", "dataset_digest": "d", "code_version": "c",
               "flow_run_id": "f", "adapter_digest": f"adapter-{adapter.name}",
               **({"run_id": run_id} if run_id else {})}  # fmt: skip
    run_id = registry.start_run(reg, run_name="probe")
    version, _ = promotion.register_adapter(
        reg, run_id, adapter, None, {"benchmark": "b", "accuracy": 0.5}, lineage
    )
    assert promotion.maybe_promote(reg, version, "b", 0.5, complete=True)
    return version


def test_model_uris_are_parsed_or_refused_naming_the_forms():
    assert adapters.parse_model_uri("models:/qerl-adapter@champion") == ("qerl-adapter", None, "champion")
    assert adapters.parse_model_uri("models:/my.model/12") == ("my.model", "12", None)
    for bad in ("models:/qerl-adapter", "models:/qerl-adapter/Production/1", "runs:/abc/adapter",
                "models:/a@", "models:/a/v1", "qerl-adapter@champion"):  # fmt: skip
        with pytest.raises(ValueError, match="expected models:/NAME/VERSION or models:/NAME@ALIAS"):
            adapters.parse_model_uri(bad)


def test_reading_a_registry_that_does_not_exist_creates_nothing(tmp_path):
    work = tmp_path / "work"
    with pytest.raises(RegistryError, match=r"no registry at sqlite:///.*mlflow\.db"):
        adapters.resolve_model_uri("models:/qerl-adapter@champion", registry.RegistryConfig(), work)
    server = registry.RegistryConfig(tracking_uri="http://127.0.0.1:9")  # nothing listens on discard
    with pytest.raises(RegistryError, match=r"registry at http://127\.0\.0\.1:9 does not answer"):
        adapters.resolve_model_uri("models:/qerl-adapter@champion", server, work)
    assert not work.exists()


def test_a_registered_version_is_fetched_once_by_alias_or_number(tmp_path):
    work, adapter = tmp_path / "work", tmp_path / "a1"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 8}))
    (adapter / "adapter_model.safetensors").write_bytes(b"weights-1")
    version = _register(work, adapter, "base-A")
    cfg, store = registry.RegistryConfig(), ArtifactStore(work / "store")

    by_alias = adapters.resolve_model_uri("models:/qerl-adapter@champion", cfg, work)
    by_number = adapters.resolve_model_uri(f"models:/qerl-adapter/{version}", cfg, work)
    assert str(by_alias.version) == str(by_number.version) == version
    for missing in ("models:/qerl-adapter@nope", "models:/qerl-adapter/99"):
        with pytest.raises(RegistryError, match=f"{missing}: no such registered version in sqlite:///"):
            adapters.resolve_model_uri(missing, cfg, work)
    with pytest.raises(
        RegistryError,
        match=r"models:/other@champion: no registered model 'other' in sqlite:///.*\(registered there: qerl-adapter\)",
    ):
        adapters.resolve_model_uri("models:/other@champion", cfg, work)

    adapters.check_base(by_alias, "base-A", "--base", "hint")
    with pytest.raises(
        RegistryError, match="qerl-adapter v1 was trained on base base-A, --base is base-B: hint"
    ):
        adapters.check_base(by_alias, "base-B", "--base", "hint")

    manifest, cached = adapters.fetch_adapter(by_alias, store)
    assert (
        not cached and (manifest.dir / "adapter" / "adapter_model.safetensors").read_bytes() == b"weights-1"
    )
    again, cached = adapters.fetch_adapter(by_number, store)
    assert cached and again.dir == manifest.dir  # one download per version and work directory


@pytest.mark.slow
def test_cli_eval_reads_the_champion_from_the_registry(tiny_model_dir, tiny_model_factory, tmp_path, capfd):
    """``qerl eval --adapter models:/qerl-adapter@champion`` evaluates the registered adapter: the same
    evaluation (one store artifact) as the folder it was registered from. A version trained on another
    base is refused before any evaluation, naming both digests."""
    from qerl.flows.cli import main
    from qerl.stages.base import base_artifacts

    from tests.pipeline.test_engines import make_adapter

    work, ckpt = tmp_path / "work", tmp_path / "ckpt"
    assert main(["quantize", str(tiny_model_dir), "--out", str(ckpt), "--work-dir", str(work)]) == 0
    quantized, _ = base_artifacts(ckpt, ArtifactStore(work / "store"), need_twin=False)
    adapter = make_adapter(tiny_model_dir, tmp_path / "adapter", rank=8)
    _register(work, adapter, adapters.base_lineage_digest(quantized))
    common = ["--base", str(ckpt), "--benchmark", "arithmetic", "--engine", "hf", "--work-dir", str(work),
              "--set", "greedy=true", "--set", "benchmark.limit=3", "--set", "max_new_tokens=8"]  # fmt: skip
    capfd.readouterr()

    assert main(["eval", "--adapter", "models:/qerl-adapter@champion", *common]) == 0
    out, err = capfd.readouterr()
    assert "adapter     models:/qerl-adapter@champion: qerl-adapter v1" in err
    by_uri = json.loads(out.strip().splitlines()[-1])
    assert main(["eval", "--adapter", str(adapter), *common]) == 0
    by_folder = json.loads(capfd.readouterr().out.strip().splitlines()[-1])
    assert by_uri == by_folder
    assert len(list((work / "store" / "objects" / "evaluate").iterdir())) == 1  # the same adapter bytes

    other = tiny_model_factory(hidden_size=64, num_layers=2, intermediate_size=128)
    _register(work, make_adapter(other, tmp_path / "other", rank=8), "another-base", name="other-model")
    assert main(["eval", "--adapter", "models:/other-model/1", *common]) == 2
    err = capfd.readouterr().err
    assert (
        f"other-model v1 was trained on base another-base, --base is {adapters.base_lineage_digest(quantized)}"
        in err
    )
    assert len(list((work / "store" / "objects" / "evaluate").iterdir())) == 1


def test_cli_eval_of_a_registered_version_uses_its_runs_protocol(tiny_model_dir, tmp_path, capfd):
    """Without ``--config``, ``qerl eval --adapter models:/...`` evaluates under the eval and reward
    sections of the run that registered the version (its record in the work dir) and quantizes a
    plain base by that run's quantize section: the registered figure's protocol, ``--benchmark``
    replacing only the dataset. ``--config`` or a missing record: the defaults, said on the console."""
    from qerl.flows.cli import main
    from qerl.flows.tool_commands import registered_figure
    from qerl.pipeline.config import key_payload
    from qerl.pipeline.data.rewards import RewardConfig
    from qerl.pipeline.evaluation.eval_config import EvalConfig
    from qerl.pipeline.nvfp4.recipe import QuantizeConfig
    from qerl.pipeline.store.files import atomic_write_json
    from qerl.pipeline.store.manifest import Manifest
    from qerl.stages.base import base_artifacts
    from qerl.stages.evaluate import load_summary

    from tests.pipeline.test_engines import make_adapter

    work = tmp_path / "work"
    store = ArtifactStore(work / "store")
    quantized, _ = base_artifacts(tiny_model_dir, store, need_twin=False)
    _register(work, make_adapter(tiny_model_dir, tmp_path / "adapter", rank=8),
              adapters.base_lineage_digest(quantized), run_id="night-1")  # fmt: skip
    eval_section = EvalConfig.model_validate(
        {
            "greedy": True,
            "max_new_tokens": 6,
            "benchmark": {"dataset": "arithmetic", "limit": 3, "template": "terse"},
        }
    )
    config = {"eval": eval_section.model_dump(mode="json"),
              "reward": RewardConfig(answer_format="answer_tags", workers=1).model_dump(mode="json"),
              "quantize": QuantizeConfig(twin_dtype="float32").model_dump(mode="json")}  # fmt: skip
    atomic_write_json(
        work / "runs" / "night-1" / "run.json", {"run_id": "night-1", "steps": [], "config": config}
    )
    common = ["--adapter", "models:/qerl-adapter@champion", "--base", str(tiny_model_dir), "--engine", "hf",
              "--work-dir", str(work)]  # fmt: skip
    capfd.readouterr()

    last_out: list[str] = [""]

    def evaluation(argv: list[str]) -> tuple[Manifest, str]:
        assert main(["eval", *common, *argv]) == 0
        out, err = capfd.readouterr()
        last_out[0] = out
        result = next(line for line in out.splitlines() if " -> " in line)
        return Manifest.load(result.rsplit(" -> ", 1)[1]), err

    ev, err = evaluation([])
    assert "protocol    run night-1's eval, reward and quantize sections (--config for another)" in err
    # the figure the version's run registered, said to be comparable or not (the helper registers "b")
    assert "registered: qerl-adapter v1 at 0.5000 on b (another benchmark or protocol)" in last_out[0]
    same = SimpleNamespace(name="m", version="3", tags={"eval_benchmark": "x@1~2", "eval_accuracy": "0.25"})
    assert registered_figure(same, "x@1~2") == "registered: m v3 at 0.2500 on this benchmark and protocol"
    assert ev.config["eval"] == key_payload(eval_section)  # the run's eval section
    twins = [Manifest.load(d) for d in (work / "store" / "objects" / "dequantize").iterdir()]
    assert [t.config["twin_dtype"] for t in twins] == ["float32"]  # the run's quantize section
    # the same evaluation by hand: the run's sections as a --config and --set reward.* (one store entry)
    own = tmp_path / "eval.yaml"
    own.write_text(yaml.safe_dump(config["eval"]))
    by_hand, err = evaluation(["--config", str(own), "--set", "reward.answer_format=answer_tags",
                               "--set", "quantize.twin_dtype=float32"])  # fmt: skip
    assert "protocol" not in err and by_hand.dir == ev.dir
    default, _ = evaluation(["--config", str(own)])  # the default reward: another protocol
    assert load_summary(default)["benchmark"] != load_summary(ev)["benchmark"]
    mixed, _ = evaluation(
        ["--benchmark", "arithmetic", "--set", "benchmark.limit=2"]
    )  # the run's, then --set
    assert (
        mixed.config["eval"]["benchmark"]["limit"] == 2
        and mixed.config["eval"]["benchmark"]["template"] == "terse"
    )
    record = work / "runs" / "night-1" / "run.json"
    atomic_write_json(record, {"run_id": "night-1", "steps": [], "config": {**config, "eval": {"k": "many"}}})
    assert main(["eval", *common]) == 2  # a record of another qerl's making: named, nothing evaluated
    assert f"run record {record}: no valid eval, reward and quantize sections" in capfd.readouterr().err
    record.unlink()
    _, err = evaluation(["--set", "benchmark.limit=3", "--set", "greedy=true", "--set", "max_new_tokens=6"])
    assert (
        f"protocol    the defaults (run night-1's record is not in {work / 'runs'}, nor a protocol.json "
        "in its MLflow run; --config for another)" in err
    )


def test_cli_eval_follows_the_protocol_logged_with_the_version_where_its_run_record_is_not(
    tiny_model_dir, tmp_path, capfd
):
    """A registry read from another work dir (a shared server, a copied mlflow.db) has no run record:
    the ``protocol.json`` that the registration logs on the version's MLflow run gives the same
    evaluation the record would. One that does not validate is refused, naming that MLflow run."""
    from qerl.flows.cli import main
    from qerl.pipeline.data.rewards import RewardConfig
    from qerl.pipeline.evaluation.eval_config import EvalConfig
    from qerl.pipeline.nvfp4.recipe import QuantizeConfig
    from qerl.pipeline.registry.protocol import log_protocol, protocol_of, read_protocol
    from qerl.pipeline.store.files import atomic_write_json
    from qerl.pipeline.store.manifest import Manifest
    from qerl.stages.base import base_artifacts

    from tests.pipeline.test_engines import make_adapter

    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    quantized, _ = base_artifacts(tiny_model_dir, ArtifactStore(work / "store"), need_twin=False)
    _register(work, make_adapter(tiny_model_dir, tmp_path / "adapter", rank=8),
              adapters.base_lineage_digest(quantized), run_id="night-1")  # fmt: skip
    version = registry.MlflowClient().get_model_version("qerl-adapter", "1")
    assert read_protocol(version) is None  # registered without one (an older qerl's registration)
    config = {"eval": EvalConfig.model_validate({"greedy": True, "max_new_tokens": 6,
                                                 "benchmark": {"dataset": "arithmetic", "limit": 3}}).model_dump(mode="json"),
              "reward": RewardConfig(answer_format="answer_tags", workers=1).model_dump(mode="json"),
              "quantize": QuantizeConfig(twin_dtype="float32").model_dump(mode="json")}  # fmt: skip
    log_protocol(version.run_id, protocol_of(config, "night-1"))
    # the registry, not the work dir: the other work dir points its tracking at this one's database
    uri = f"sqlite:///{work / 'mlflow.db'}"
    common = ["--adapter", "models:/qerl-adapter@champion", "--base", str(tiny_model_dir), "--engine", "hf",
              "--set", f"registry.tracking_uri={uri}"]  # fmt: skip

    def evaluation(where: Path) -> tuple[Manifest, str]:
        assert main(["eval", *common, "--work-dir", str(where)]) == 0
        out, err = capfd.readouterr()
        return Manifest.load(next(x for x in out.splitlines() if " -> " in x).rsplit(" -> ", 1)[1]), err

    capfd.readouterr()
    atomic_write_json(work / "runs" / "night-1" / "run.json", {"run_id": "night-1", "config": config})
    from_record, _ = evaluation(work)
    logged, err = evaluation(elsewhere)
    assert (
        "protocol    run night-1's eval, reward and quantize sections, from its MLflow run's protocol.json"
        in err
    )
    assert logged.config == from_record.config and logged.key == from_record.key  # the same protocol
    assert [
        Manifest.load(d).config["twin_dtype"]
        for d in (elsewhere / "store" / "objects" / "dequantize").iterdir()
    ] == ["float32"]

    log_protocol(version.run_id, protocol_of({**config, "eval": {"k": "many"}}, "night-1"))
    assert main(["eval", *common, "--work-dir", str(elsewhere)]) == 2
    assert f"MLflow run {version.run_id}'s protocol.json: no valid eval, reward and quantize sections" in (
        capfd.readouterr().err
    )
