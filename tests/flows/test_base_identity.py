"""A registered version names the base it trained on by what the quantize stage computed, and is
compared and evaluated on that base only: an RTN champion is never evaluated on a GPTQ candidate's
checkpoint, and ``qerl eval`` of a version serves the exact checkpoint (found, or rebuilt from its
run's recorded recipe, data, template and validation split, and refused when the rebuild differs).
NF4 versions evaluate too (their shapes read from the quantization state)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def _config(model_dir: Path, **quantize: object) -> dict:
    from learning import learning_run_config

    cfg = learning_run_config(model_dir)
    cfg["data"]["arithmetic_size"] = 80
    cfg["eval"]["validation"] = {"size": 20}  # whole groups of numbers: about 20 held out
    cfg["loop"].update(steps=2, prompts_per_step=3)
    cfg["train"]["total_steps"] = None
    cfg["quantize"] = {"twin_dtype": None, **quantize}
    return cfg


def _eval(argv: list[str], capfd: pytest.CaptureFixture) -> tuple[int, str, str]:
    from qerl.flows.cli import main

    capfd.readouterr()
    code = main(["eval", *argv])
    out, err = capfd.readouterr()
    return code, out, err


@pytest.mark.slow
def test_a_champion_is_never_evaluated_on_another_recipes_base(learner_model_dir, tmp_path, capfd):
    """Run A quantizes by RTN and is made champion; run B quantizes the same model by GPTQ: its
    lineage names another recipe, the champion is not evaluated on B's checkpoint, and B is not
    compared. ``qerl eval`` of B from another work directory rebuilds B's GPTQ base from the run's
    recorded sections, byte for byte, and refuses a recipe that makes another checkpoint."""
    from learning import assert_trained
    from prefect_home import run_here
    from qerl.pipeline.planning.run_config import RunConfig
    from qerl.pipeline.registry import promotion
    from qerl.pipeline.store.manifest import Manifest

    work = tmp_path / "work"
    rtn = run_here(RunConfig.model_validate(_config(learner_model_dir)), work)
    assert rtn["status"] == "completed", rtn.get("error")
    promotion.promote(RunConfig().registry, "qerl-adapter", str(rtn["registration"]["version"]))
    gptq_cfg = _config(learner_model_dir, method="gptq", calibration={"source": "train", "count": 16})
    gptq = run_here(RunConfig.model_validate(gptq_cfg), work)
    assert gptq["status"] == "completed", gptq.get("error")
    for record in (rtn, gptq):
        assert_trained(work, record)

    tags = [
        promotion.version_info(RunConfig().registry, str(r["registration"]["version"]))["tags"]
        for r in (rtn, gptq)
    ]
    assert tags[0]["quant_recipe"].startswith("nvfp4-rtn-") and tags[1]["quant_recipe"].startswith(
        "nvfp4-gptq-"
    )
    bases = [Manifest.load(Path(r["quantize"]["manifest"])) for r in (rtn, gptq)]
    assert [t["base_checkpoint"] for t in tags] == [b.digest for b in bases] and bases[0].digest != bases[
        1
    ].digest
    why = gptq["registration"]["promotion"]
    assert (
        not gptq["registration"]["promoted"] and f"trained on base recipe {tags[0]['quant_recipe']}" in why
    ), why
    evaluated = [Manifest.load(d).inputs for d in (work / "store" / "objects" / "evaluate").iterdir()]
    assert not [
        e for e in evaluated if e["base"] == bases[1].digest and e["adapter"] == tags[0]["adapter_digest"]
    ]
    assert [
        e for e in evaluated if e["base"] == bases[0].digest and e["adapter"] == tags[0]["adapter_digest"]
    ]

    # a run that holds out no validation split evaluates no champion: its result could decide nothing
    def champion_evaluations() -> int:
        inputs = [Manifest.load(d).inputs for d in (work / "store" / "objects" / "evaluate").iterdir()]
        return sum(1 for e in inputs if e["adapter"] == tags[0]["adapter_digest"])

    before = champion_evaluations()
    plain = _config(learner_model_dir)
    plain["eval"]["validation"] = {"size": 0}
    plain["loop"]["steps"] = 1
    unvalidated = run_here(RunConfig.model_validate(plain), work)
    assert "held out no validation split" in unvalidated["registration"]["promotion"]
    assert champion_evaluations() == before

    # qerl eval of B where its run and checkpoint are not: rebuilt from protocol.json, the same bytes
    elsewhere = tmp_path / "elsewhere"
    common = ["--adapter", f"models:/qerl-adapter/{gptq['registration']['version']}", "--base",
              str(learner_model_dir), "--engine", "hf", "--work-dir", str(elsewhere),
              "--set", f"registry.tracking_uri=sqlite:///{work / 'mlflow.db'}", "--set", "benchmark.limit=2"]  # fmt: skip
    code, out, err = _eval(common, capfd)
    assert code == 0, err[-2000:]
    assert "rebuilt from its run's recipe, data and validation split" in err, err
    (rebuilt,) = (elsewhere / "store" / "objects" / "quantize").iterdir()
    assert Manifest.load(rebuilt).digest == bases[1].digest
    code, _, err = _eval([*common, "--set", "quantize.calibration.count=8"], capfd)
    assert code != 0 and f"is not the one the version was trained on ({bases[1].digest[:16]})" in err, err


@pytest.mark.slow
def test_an_nf4_version_evaluates_on_its_own_base(learner_model_dir, tmp_path, capfd):
    """``qerl eval`` of a version trained on an NF4 base: the adapter fits (the shapes come from the
    quantization state, not the packed codes), the base is the run's checkpoint, no quality report."""
    from prefect_home import run_here
    from qerl.pipeline.planning.run_config import RunConfig
    from qerl.pipeline.rollout.adapter_fit import adapter_mismatches

    cfg = _config(learner_model_dir, scheme="nf4")
    cfg["aqn"] = {"enabled": False}
    cfg["loop"]["steps"] = 1
    work = tmp_path / "work"
    record = run_here(RunConfig.model_validate(cfg), work)
    assert record["status"] == "completed", record.get("error")
    base = Path(record["quantize"]["manifest"])
    assert adapter_mismatches(record["final_adapter"], base) == []
    quality_runs = len(list((work / "store" / "objects" / "quality").iterdir()))
    version = record["registration"]["version"]
    code, out, err = _eval(["--adapter", f"models:/qerl-adapter/{version}", "--base", str(learner_model_dir),
                            "--engine", "hf", "--work-dir", str(work), "--set", "benchmark.limit=2"], capfd)  # fmt: skip
    assert code == 0, err[-2000:]
    assert "NF4 checkpoint" in err and "the checkpoint it trained on, from the store" in err, err
    assert json.loads(out.splitlines()[-1])["n_items"] == 2
    assert len(list((work / "store" / "objects" / "quality").iterdir())) == quality_runs  # no report run
