"""What the end-to-end tests assert before they assert "identical": that training happened.

An adapter that never moves is identical after any crash, so a claim of identity proves something
only once the run is shown to have learned from mixed rewards: rewards differ within some group (a
non-zero GRPO advantage), tokens were trained, and every step's adapter differs from the step
before it (and the first from its initialisation, whose LoRA B matrices are zero).
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import torch
from safetensors.torch import load_file


def learning_run_config(model_dir: Path, engine: str = "hf") -> dict:
    """``test_flow.tiny_run_config`` on the learner model (its answers need up to 12 new tokens),
    keeping every step's adapter so that ``assert_trained`` can compare them."""
    from test_flow import tiny_run_config

    cfg = tiny_run_config(model_dir, engine=engine)
    cfg["store"] = {"keep_adapters_every": 0}
    cfg["rollout"]["max_new_tokens"] = 12
    cfg["eval"]["max_new_tokens"] = 12
    return cfg


def _object(work: Path, stage: str, key: str) -> Path:
    return work / "store" / "objects" / stage / key


def step_adapters(work: Path, record: dict) -> list[dict[str, torch.Tensor]]:
    """The LoRA tensors each step of ``record`` saved, in step order."""
    return [
        load_file(_object(work, "train", s["manifests"]["train"]) / "adapter" / "adapter_model.safetensors")
        for s in record["steps"]
    ]


def assert_trained(work: Path, record: dict) -> None:
    """Every step of the run ``record`` (a run.json) under ``work`` learned something (module doc)."""
    assert record["steps"], record.get("error")
    mixed_groups = 0
    for step in record["steps"]:
        table = pq.read_table(_object(work, "score", step["manifests"]["score"]) / "scored.parquet")
        stds = table.column("group_reward_std").to_pylist()
        mixed_groups += sum(1 for s in stds if s > 0)
        assert step["train_tokens_trained"] > 0, step
        assert step["train_updates"] > 0, step
    assert any(s["reward_std"] > 0 for s in record["steps"]), "every reward was the same"
    assert mixed_groups > 0 and any(s["train_adv_abs_mean"] > 0 for s in record["steps"]), (
        "no group had a non-zero advantage: nothing to learn from"
    )
    adapters = step_adapters(work, record)
    first = adapters[0]
    assert any(v.abs().max() > 0 for k, v in first.items() if "lora_B" in k), "step 1 left LoRA B at zero"
    for step, (before, after) in enumerate(zip(adapters, adapters[1:], strict=False), start=2):
        assert before.keys() == after.keys()
        assert any(not torch.equal(before[k], after[k]) for k in before), f"step {step} moved no weight"


def run_record(work: Path, run_id: str | None = None) -> dict:
    """The run record under ``work`` (the only one, or ``run_id``'s)."""
    if run_id is None:
        (path,) = (work / "runs").glob("*/run.json")
    else:
        path = work / "runs" / run_id / "run.json"
    return json.loads(path.read_text())
