"""The embedded demo's base model: a tiny Qwen2 built here, then warmed up with a short SFT.

QeRL starts from an instruction-tuned model that already solves some problems; RL then raises the
share it solves. Nothing can be downloaded here, so the demo makes its own such model: a byte-level
BPE tokenizer trained on the procedural arithmetic train split, a Qwen2-architecture model of about
a million parameters (head_dim 32, as vLLM's CPU attention needs), and a deliberately *short*
supervised warm-up on ``question -> <answer>N</answer>`` so the model answers in the right format
but is often wrong. That leaves room for GRPO to show a real gain within minutes on two cores. The
warm-up draws from the arithmetic train split, whose numbers no test problem shares, less the groups
a run holds out for validation (``exclude``): the base has seen no problem it is measured on.

The warm-up builds the same weights on every x86-64 CPU with AVX2. Its few hundred steps of Adam
amplify any rounding difference, and CPUs round differently: torch picks AVX-512 or AVX2 kernels by
CPUID, and MKL picks its own code path by CPUID and vendor, so on the machine's own kernels the same
seed gives an AVX-512 machine and an AVX2 one different bases, which RL then lifts differently.
``build_demo_base`` therefore runs the warm-up in a child process whose arithmetic is pinned to one
instruction set (``PORTABLE_ARITHMETIC``: torch's AVX2 kernels, MKL's AVX2 path in its
conditional-numerical-reproducibility mode, oneDNN capped at AVX2) and to ONE intra-op thread, since
float reductions are blocked per thread. The capability the child ran with is recorded
(``sft_cpu_capability``); a CPU without AVX2 builds another base, and says so in the log. The rest
of a run keeps the machine's own, faster kernels: from one base, their rounding moves RL's result
far less than another base does (docs/results/demo.md). ``warm_up`` is the warm-up itself, in the
caller's process and arithmetic.
"""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from pydantic import Field
from qerl.pipeline.config import StrictModel
from qerl.pipeline.data.arithmetic import arithmetic_problems
from qerl.pipeline.data.prompts import render_prompt
from qerl.pipeline.demo.tiny_model import build_tiny_model

log = logging.getLogger("qerl.demo")

SFT_THREADS = 1  # the warm-up's intra-op threads: fixed so the base does not depend on the core count
PORTABLE_ARITHMETIC = {  # the warm-up child's kernels: one instruction set on every x86-64 CPU with AVX2
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "MKL_CBWR": "AVX2,STRICT",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "OMP_NUM_THREADS": str(SFT_THREADS),
    "MKL_NUM_THREADS": str(SFT_THREADS),
}


class DemoBaseConfig(StrictModel):
    """How the embedded demo's base model is built and warmed up."""

    levels: list[int] = Field(default_factory=lambda: [1, 2])
    n_train: int = (
        600  # levels 1 and 2 alike; level 1 has about 350 train problems outside a run's validation pairs
    )
    template: str = "terse"
    vocab_size: int = 384
    hidden_size: int = 128
    num_layers: int = 4
    intermediate_size: int = 384
    sft_steps: int = 300  # the most warm-up steps; with ``sft_target`` it may stop sooner
    sft_batch: int = 32
    sft_lr: float = 3e-3
    sft_weight_decay: float = Field(default=0.0, ge=0.0)
    sft_target: float | None = Field(default=None, gt=0.0, le=1.0)
    sft_probe_every: int = Field(default=25, ge=1)
    sft_probe_groups: int = Field(default=32, ge=1)
    sft_probe_window: int = Field(default=3, ge=1)  # the stop rule averages this many latest probes
    seed: int = 0


def completion_text(answer: str) -> str:
    """What the warm-up teaches the model to write (the reward reads the answer tags)."""
    return f"<answer>{answer}</answer>"


def _encode(tokenizer, prompt: str, completion: str) -> tuple[list[int], list[int]]:  # noqa: ANN001
    prompt_ids = tokenizer(prompt, add_special_tokens=False).input_ids
    target_ids = tokenizer(completion, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    return prompt_ids + target_ids, [-100] * len(prompt_ids) + target_ids


def _hold_out_probe(problems: list, n_groups: int) -> tuple[list, list]:
    """``problems`` split into the warm-up's and a probe of ``n_groups`` whole groups it never sees
    (the last groups in draw order), so the probe measures the rule, not recall."""
    groups = list(dict.fromkeys(p["group"] for p in problems))
    if len(groups) <= n_groups:
        raise ValueError(f"sft_probe_groups {n_groups} leaves no warm-up data: {len(groups)} groups in all")
    held = frozenset(groups[-n_groups:])
    return [p for p in problems if p["group"] not in held], [p for p in problems if p["group"] in held]


@torch.no_grad()
def _probe_accuracy(model, tokenizer, probe: list, template: str) -> float:  # noqa: ANN001
    """Greedy accuracy on ``probe``: the completion must begin with the answer as the warm-up writes it."""
    model.eval()
    prompts = [
        tokenizer(render_prompt(tokenizer, p["question"], template), add_special_tokens=False).input_ids
        for p in probe
    ]
    width = max(len(ids) for ids in prompts)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in prompts])
    attention = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompts])
    out = model.generate(
        input_ids=input_ids, attention_mask=attention, max_new_tokens=12, do_sample=False, pad_token_id=pad
    )
    texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
    model.train()
    return sum(
        t.strip().startswith(completion_text(p["answer"])) for t, p in zip(texts, probe, strict=True)
    ) / len(probe)


def build_demo_base(
    out_dir: str | Path, cfg: DemoBaseConfig, exclude: frozenset[str] = frozenset()
) -> dict[str, Any]:
    """Write the warmed-up demo model to ``out_dir`` (an HF model dir) and return warm-up metrics;
    no warm-up problem is of a group in ``exclude`` (a run's validation split). The warm-up runs in
    a child process under ``PORTABLE_ARITHMETIC``, so the weights do not depend on this CPU."""
    request = json.dumps({"out": str(out_dir), "config": cfg.model_dump(), "exclude": sorted(exclude)})
    child = subprocess.run(
        [sys.executable, "-m", __name__],
        input=request,
        capture_output=True,
        text=True,
        env={**os.environ, **PORTABLE_ARITHMETIC},
        check=False,
    )
    for line in child.stderr.splitlines():
        log.info("warm-up: %s", line)
    if child.returncode != 0:
        lines = child.stderr.strip().splitlines() or ["(no output)"]
        tail = "\n".join(lines[-15:])
        raise RuntimeError(f"the demo warm-up failed (exit {child.returncode}): {lines[-1]}\n{tail}")
    metrics = json.loads(child.stdout.splitlines()[-1])
    if metrics["sft_cpu_capability"] != PORTABLE_ARITHMETIC["ATEN_CPU_CAPABILITY"].upper():
        log.warning(
            "this CPU has no AVX2 (torch ran %s kernels): its demo base differs from other machines'",
            metrics["sft_cpu_capability"],
        )
    return metrics


def warm_up(
    out_dir: str | Path, cfg: DemoBaseConfig, exclude: frozenset[str] = frozenset()
) -> dict[str, Any]:
    """``build_demo_base`` in this process and with its arithmetic, on ``SFT_THREADS`` threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(SFT_THREADS)
    try:
        metrics = _build(Path(out_dir), cfg, exclude)
    finally:
        torch.set_num_threads(threads)
    return metrics


def _build(out: Path, cfg: DemoBaseConfig, exclude: frozenset[str]) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    problems = arithmetic_problems(
        cfg.n_train, seed=cfg.seed, split="train", levels=cfg.levels, exclude=exclude
    )
    probe: list = []
    if cfg.sft_target is not None:
        problems, probe = _hold_out_probe(problems, cfg.sft_probe_groups)
    corpus = [f"{p['question']} {completion_text(p['answer'])}" for p in problems]
    build_tiny_model(
        out,
        arch="qwen2",
        seed=cfg.seed,
        dtype=torch.float32,
        corpus=corpus,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_layers,
        intermediate_size=cfg.intermediate_size,
    )
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    examples = [
        _encode(
            tokenizer, render_prompt(tokenizer, p["question"], cfg.template), completion_text(p["answer"])
        )
        for p in problems
    ]
    torch.manual_seed(cfg.seed)
    order = random.Random(cfg.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.sft_lr, weight_decay=cfg.sft_weight_decay)
    model.train()
    started, losses, probed = time.perf_counter(), [], []
    for step in range(cfg.sft_steps):
        batch = order.sample(examples, min(cfg.sft_batch, len(examples)))
        width = max(len(ids) for ids, _ in batch)
        pad = tokenizer.pad_token_id
        input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in batch])
        labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in batch])
        attention = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in batch])
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(float(loss))
        if step % 20 == 0:
            log.info("demo warm-up step %d/%d loss %.3f", step, cfg.sft_steps, losses[-1])
        if probe and (step + 1) % cfg.sft_probe_every == 0:
            probed.append(_probe_accuracy(model, tokenizer, probe, cfg.template))
            log.info("demo warm-up step %d: %.3f right on unseen pairs", step + 1, probed[-1])
            recent = probed[-cfg.sft_probe_window :]
            if len(recent) == cfg.sft_probe_window and sum(recent) / len(recent) >= cfg.sft_target:
                break
    model.eval()
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    metrics = {
        "sft_final_loss": sum(losses[-10:]) / len(losses[-10:]),
        "sft_seconds": time.perf_counter() - started,
        "n_train": len(problems),
        "sft_threads": torch.get_num_threads(),
        "sft_steps_run": len(losses),
        "sft_cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }
    if probed:
        recent = probed[-cfg.sft_probe_window :]
        metrics |= {"sft_probe_accuracy": sum(recent) / len(recent), "sft_probe_items": len(probe)}
    # no wall time in the model directory: its content digest is every downstream cache key's input
    stable = {k: v for k, v in metrics.items() if k != "sft_seconds"}
    (out / "qerl_demo.json").write_text(json.dumps({"config": cfg.model_dump(), "metrics": stable}, indent=2))
    return metrics


def _main() -> None:
    """The warm-up child: a JSON request on stdin, the metrics as one JSON line on stdout."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    request = json.loads(sys.stdin.read())
    metrics = warm_up(request["out"], DemoBaseConfig(**request["config"]), frozenset(request["exclude"]))
    print(json.dumps(metrics))


if __name__ == "__main__":
    _main()
