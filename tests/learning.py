"""What the end-to-end tests assert before they assert "identical": that training happened.

An adapter that never moves is identical after any crash, so a claim of identity proves something
only once the run is shown to have learned from mixed rewards (``assert_trained``): most steps had a
group whose rewards differ (a non-zero GRPO advantage), every such step moved the adapter, tokens
were trained at every step, and the final adapter is far from its initialisation (whose LoRA B
matrices are zero). Which step has signal is left to the sampler: the learner model is built on the
machine that runs the tests, and another CPU's kernels round its warm-up differently, so one given
step's two groups may both be uniform there (about one step in twenty on a model in the band).

``learning_band`` is the learner fixture's own check: sampled at the rollout temperature, at least
half of its groups on training prompts have mixed rewards, on this CPU, or the fixture fails
naming the numbers (a model outside the band would make every end-to-end test vacuous or flaky).
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
    from tests.flows.test_flow import tiny_run_config

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


# how far the final adapter must be from its initialisation: a tenth of one AdamW step at lr 1e-3, the
# learning rate of every end-to-end config (the step moves each weight it has a gradient for by ~lr)
FAR_FROM_INIT = 1e-4


def _mixed_groups(work: Path, step: dict) -> int:
    table = pq.read_table(_object(work, "score", step["manifests"]["score"]) / "scored.parquet")
    return len({g for g, s in zip(table.column("group_id").to_pylist(), table.column("group_reward_std").to_pylist(),
                                  strict=True) if s > 0})  # fmt: skip


def assert_trained(work: Path, record: dict, signal_steps: int | None = None) -> None:
    """The run ``record`` (a run.json) under ``work`` learned from mixed rewards (module docstring).
    ``signal_steps``: how many steps must have had a mixed group (default: most); a run at a learning
    rate that ruins its policy has signal until it is ruined, then none."""
    steps = record["steps"]
    assert steps, record.get("error")
    signal, seen = [], []
    for step in steps:
        assert step["train_tokens_trained"] > 0 and step["train_updates"] > 0, step
        mixed = _mixed_groups(work, step)
        seen.append((mixed, step["train_adv_abs_mean"]))
        signal.append(mixed > 0 and step["train_adv_abs_mean"] > 0)
    need = len(steps) // 2 + 1 if signal_steps is None else signal_steps
    assert sum(signal) >= need, (
        f"{sum(signal)} of {len(steps)} steps had signal (mixed groups, mean |A|): {seen}"
    )
    adapters = step_adapters(work, record)
    zero = {k: torch.zeros_like(v) if "lora_B" in k else v for k, v in adapters[0].items()}
    for i, (has_signal, before, after) in enumerate(zip(signal, [None, *adapters], adapters, strict=False)):
        if not has_signal:
            continue
        if before is None:  # step 0: from the initialisation, whose LoRA B is zero
            assert any(not torch.equal(zero[k], after[k]) for k in after if "lora_B" in k), (
                "step 0 left LoRA B at zero"
            )
        else:
            assert before.keys() == after.keys()
            assert any(not torch.equal(before[k], after[k]) for k in before), (
                f"step {i} had signal and moved no weight"
            )
    moved = max(float(v.abs().max()) for k, v in adapters[-1].items() if "lora_B" in k)
    assert moved > FAR_FROM_INIT, f"the final adapter's LoRA B is at most {moved:.2e} from its initialisation"


def learning_band(model_dir: Path, prompts: int = 32, samples: int = 4) -> tuple[int, float]:
    """(groups with mixed rewards of ``prompts``, accuracy) of ``model_dir`` sampled as the
    end-to-end tests' rollouts sample it: ``samples`` completions at temperature 1 of training
    prompts, 12 new tokens, the terse template, in float32 (transformers' generate, seeded)."""
    from qerl.pipeline.data.answers import extract_with_format
    from qerl.pipeline.data.arithmetic import arithmetic_problems
    from qerl.pipeline.data.prompts import render_prompt
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    problems = arithmetic_problems(prompts, seed=0, split="train", levels=[1])
    texts = [render_prompt(tokenizer, p["question"], "terse") for p in problems]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(**batch, do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=12,
                             num_return_sequences=samples, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    completions = tokenizer.batch_decode(out[:, batch.input_ids.shape[1] :], skip_special_tokens=True)
    golds = [p["answer"] for p in problems for _ in range(samples)]  # integers: compared as text
    correct = [extract_with_format(c, "answer_tags")[0] == g for c, g in zip(completions, golds, strict=True)]
    per_prompt = [sum(correct[i * samples : (i + 1) * samples]) for i in range(prompts)]
    return sum(1 for c in per_prompt if 0 < c < samples), sum(correct) / len(correct)


def run_record(work: Path, run_id: str | None = None) -> dict:
    """The run record under ``work`` (the only one, or ``run_id``'s)."""
    if run_id is None:
        (path,) = (work / "runs").glob("*/run.json")
    else:
        path = work / "runs" / run_id / "run.json"
    return json.loads(path.read_text())
