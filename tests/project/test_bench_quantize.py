"""benchmarks/bench_quantize.py at a tiny shape: the stage it times runs on its random checkpoint
(no tokenizer, so the quality section must be off), in-process and as the 7B memory child."""

from __future__ import annotations

from qerl.pipeline.nvfp4.recipe import QuantizeConfig
from qerl.pipeline.store.artifact_store import ArtifactStore
from qerl.stages.quantize import run

from benchmarks.bench_quantize import _CHILD, ROOT, STAGE, _run_child, write_random_checkpoint

TINY = dict(hidden=64, inter=128, layers=1, heads=4, kv_heads=2, vocab=256, tied=True)


def test_the_benchmarked_stage_runs_on_the_random_checkpoint(tmp_path):
    src = tmp_path / "src"
    write_random_checkpoint(src, TINY)
    manifest = run(QuantizeConfig(**STAGE), src, ArtifactStore(tmp_path / "store"))
    assert manifest.metrics["bytes_out"] > 0 and "quality" not in manifest.extra
    child, _ = _run_child(
        _CHILD.format(stage=STAGE, root=str(ROOT), src=str(src), store=str(tmp_path / "child"))
    )
    assert child["bytes_out"] == manifest.metrics["bytes_out"] and child["vmhwm"] > 0
