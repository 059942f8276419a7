"""Train-step benchmarks: one GRPO update on an NVFP4 base vs QLoRA's NF4 base vs a bf16 base, and vs TRL's GRPOTrainer.

Model: a random Qwen2-architecture model shaped like Qwen2.5-0.5B (hidden 896, 24 layers, 14 heads,
2 KV heads, intermediate 4864, tied embeddings) with the vocabulary shrunk (default 32768 instead of
151936) so that the lm_head/logits do not dominate a CPU run; the embedding stays bf16 in both arms,
so the real vocabulary would make the NVFP4 memory ratio worse, not better. The NVFP4 base is made by
the real quantize stage from that bf16 model.

Batch: 8 sequences = 2 prompts x 4 samples, 64 prompt + 64 completion tokens, random ids, mixed
rewards per group, sampler logprobs taken from the base model (ratio ~ 1). Settings: LoRA r 16 /
alpha 32 on all seven projections, AdamW, max grad norm 0.2, dapo loss, gradient checkpointing on
(the QeRL recipe), bf16 compute with the fp32 LoRA weights cast to bf16 for their matmuls
(``lora_autocast``; TRL with ``bf16=True``, i.e. accelerate's autocast), one optimizer update per step.

Arms, each in its own subprocess (so peak RSS is per arm: the child's VmHWM):
  nvfp4  qerl.pipeline.rl.step.train_step on the packed NVFP4 base (dequantize in forward and backward)
  nf4    the same code on QLoRA's NF4 base (bitsandbytes Linear4bit under peft's LoRA; bf16 compute)
  bf16   the same code on the bf16 base (plain nn.Linear)
  trl    trl.GRPOTrainer (use_vllm=False) on the bf16 base: the update only, i.e. its compute_loss +
         backward + clip + AdamW step on the same batch, since its generation is not what we compare.
         Gradient checkpointing is switched on as Trainer.train() would (see arm_trl).
Each arm runs one warm-up update and then ``--steps`` timed updates (median reported). "RSS above
baseline" subtracts the process's RSS after imports, before the model is loaded. Every arm runs a
second time, for memory only, with glibc told to return freed blocks (see RETURNING_MALLOC).

Run: ``.venv/bin/python benchmarks/bench_train.py [--layers N --vocab V --steps S]``; writes
benchmarks/results/train.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPE = dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864)
N_PROMPTS, GROUP, PROMPT_LEN, COMP_LEN = 2, 4, 64, 64


def _rss_mb() -> float:
    """This process's peak RSS since exec (VmHWM).

    Not ``getrusage(RUSAGE_SELF).ru_maxrss``: Linux folds the forked parent's RSS into it at exec,
    so a child started by a parent holding a model reported the parent's size, not its own peak.
    """
    with open("/proc/self/status") as fh:
        line = next(row for row in fh if row.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024.0


def _current_rss_mb() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def make_models(work: Path, layers: int, vocab: int) -> tuple[Path, Path, Path]:
    """bf16 random model dir + its NVFP4 and NF4 checkpoints (quantize stage)."""
    import torch
    from qerl.pipeline.demo.tiny_model import tiny_config, train_tokenizer
    from qerl.pipeline.nvfp4.recipe import QuantizeConfig
    from qerl.pipeline.store.artifact_store import ArtifactStore
    from qerl.stages.quantize import run as quantize
    from transformers import AutoModelForCausalLM

    bf16 = work / "bf16"
    shape = {**SHAPE, "num_layers": layers}
    tok = train_tokenizer(vocab_size=512)
    config = tiny_config(
        "qwen2",
        vocab_size=vocab,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
        **shape,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02)
    model.save_pretrained(bf16)
    tok.save_pretrained(bf16)
    del model
    store = ArtifactStore(work / "store")
    nvfp4 = quantize(QuantizeConfig(), str(bf16), store).dir
    nf4 = quantize(QuantizeConfig(scheme="nf4", twin_dtype="bfloat16"), str(bf16), store).dir
    return bf16, nvfp4, nf4


def make_batch(model_dir: Path, vocab: int):  # noqa: ANN201
    """The shared batch; sampler logprobs from the bf16 base so that the ratio starts near 1."""
    import torch
    from qerl.pipeline.rl.batch import RolloutBatch, collate
    from qerl.pipeline.rl.logprobs import completion_logprobs
    from transformers import AutoModelForCausalLM

    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, vocab, (PROMPT_LEN,), generator=gen).tolist() for _ in range(N_PROMPTS)]
    comps = [torch.randint(0, vocab, (COMP_LEN,), generator=gen).tolist() for _ in range(N_PROMPTS * GROUP)]
    batch = RolloutBatch(
        prompt_ids=[prompts[i // GROUP] for i in range(N_PROMPTS * GROUP)],
        completion_ids=comps,
        sampler_logprobs=[[0.0] * COMP_LEN for _ in comps],
        truncated=[False] * len(comps),
        rewards=[float(i % 2) for i in range(len(comps))],
        group_ids=[i // GROUP for i in range(len(comps))],
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    with torch.no_grad():
        lp, _ = completion_logprobs(
            model, collate(batch, list(range(len(comps))), torch.ones(len(comps)), 0), 1.0
        )
    batch.sampler_logprobs = lp.tolist()
    return batch


def _train_config():  # noqa: ANN202
    from qerl.pipeline.rl.train_config import TrainConfig

    return TrainConfig(dtype="bfloat16", minibatch_size=8, gradient_checkpointing=True, lr=1e-5, seed=0)


def arm_ours(base_dir: Path, batch, steps: int) -> dict:  # noqa: ANN001
    from qerl.pipeline.rl.policy import init_state
    from qerl.pipeline.rl.step import train_step

    baseline = _current_rss_mb()
    cfg = _train_config()
    state = init_state(base_dir, cfg)
    loaded = _current_rss_mb()
    train_step(state, batch, cfg)  # warm-up
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        metrics = train_step(state, batch, cfg)
        times.append(time.perf_counter() - t0)
    return {"baseline_mb": baseline, "loaded_mb": loaded, "times": times, "loss": metrics["loss"]}


def arm_trl(base_dir: Path, batch, steps: int, work: Path) -> dict:  # noqa: ANN001
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    baseline = _current_rss_mb()
    cfg = _train_config()
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.bfloat16)
    args = GRPOConfig(
        output_dir=str(work / "trl"),
        per_device_train_batch_size=len(batch),
        num_generations=GROUP,
        max_completion_length=COMP_LEN,
        learning_rate=cfg.lr,
        max_grad_norm=cfg.max_grad_norm,
        loss_type="dapo",
        beta=0.0,
        epsilon=cfg.grpo.eps_low,
        epsilon_high=cfg.grpo.eps_high,
        gradient_checkpointing=True,
        use_vllm=False,
        use_cpu=True,
        bf16=True,  # autocast LoRA in bf16, the precision of our arms' default ``lora_autocast``
        report_to="none",
        logging_steps=1,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["x"] * 8}),
        processing_class=AutoTokenizer.from_pretrained(base_dir),
        peft_config=LoraConfig(
            r=cfg.lora_r, lora_alpha=cfg.lora_alpha, target_modules=list(cfg.target_modules)
        ),
    )
    # transformers.Trainer switches gradient checkpointing on at the start of train(), not in
    # __init__; this arm calls compute_loss directly, so it does the same here (otherwise TRL would
    # skip the recompute our arms pay for and hold every layer's activations)
    trainer.model.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs
    )
    loaded = _current_rss_mb()
    model = trainer.model
    model.train()
    trainer.create_optimizer()
    trainer.current_gradient_accumulation_steps = 1
    n = len(batch)
    prompt_ids = torch.tensor(batch.prompt_ids)
    completion_ids = torch.tensor(batch.completion_ids)
    inputs = {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": completion_ids,
        "completion_mask": torch.ones_like(completion_ids),
        "advantages": torch.tensor([1.0 if i % 2 else -1.0 for i in range(n)]),
        "old_per_token_logps": torch.tensor(batch.sampler_logprobs),
        "num_items_in_batch": torch.tensor(float(completion_ids.numel())),
    }
    params = [p for p in model.parameters() if p.requires_grad]

    def update() -> float:
        with trainer.compute_loss_context_manager():  # Trainer.training_step's autocast
            loss = trainer.compute_loss(model, inputs)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)
        return float(loss)

    update()  # warm-up
    times, loss = [], 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = update()
        times.append(time.perf_counter() - t0)
    return {"baseline_mb": baseline, "loaded_mb": loaded, "times": times, "loss": loss}


def _child(args: argparse.Namespace) -> None:
    # every arm imports the libraries it runs on before its baseline RSS is taken
    import peft  # noqa: F401
    import transformers  # noqa: F401

    if args.child == "trl":
        import trl  # noqa: F401
    if args.child == "nf4":
        import bitsandbytes  # noqa: F401
    if args.child == "nvfp4":  # numba and its cached dequantize kernel are a library import too
        import torch
        from qerl.kernels.nvfp4_dispatch import dequantize
        from qerl.kernels.nvfp4_reference import quantize_nvfp4

        dequantize(*quantize_nvfp4(torch.ones(16, 16)), dtype=torch.bfloat16)

    from qerl.pipeline.rl.batch import RolloutBatch

    batch = RolloutBatch(**json.loads(Path(args.batch).read_text()))
    work = Path(args.work)
    if args.child in ("nvfp4", "nf4", "bf16"):
        out = arm_ours(work / args.child, batch, args.steps)
    else:
        out = arm_trl(work / "bf16", batch, args.steps, work)
    out["peak_rss_mb"] = _rss_mb()
    Path(args.result).write_text(json.dumps(out))


# glibc keeps freed heap memory and grows its mmap threshold up to 32 MB, so with its defaults the
# peak RSS of a CPU update is mostly freed-but-retained memory (measured: ~330 MB of live heap against
# ~2 GB of RSS), the same in every arm. A fixed 128 KiB threshold hands every larger block back on
# free: RSS then follows what the update holds, at about twice the step time (page faults), so the
# memory runs use it and the timed runs do not.
RETURNING_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def _run_arm(arm: str, work: Path, batch_path: Path, steps: int, env: dict[str, str]) -> dict:
    result = work / f"{arm}.json"
    cmd = [sys.executable, __file__, "--child", arm, "--work", str(work), "--batch", str(batch_path)]
    cmd += ["--steps", str(steps), "--result", str(result)]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **env}
    )
    if proc.returncode != 0:
        return {"error": proc.stderr[-2000:]}
    return json.loads(result.read_text())


def _seconds(arm: dict) -> float | None:
    return None if "error" in arm else statistics.median(arm["times"])


def _above(arm: dict) -> float | None:
    return None if "error" in arm else arm["peak_rss_mb"] - arm["baseline_mb"]


def _ratio(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or b is None else f"{a / b:.2f}x"


def _cell(value: float | None, fmt: str) -> str:
    return "error" if value is None else format(value, fmt)


def main(layers: int = 24, vocab: int = 32768, steps: int = 4) -> str:
    import torch

    names = ("nvfp4", "nf4", "bf16", "trl")
    with tempfile.TemporaryDirectory(prefix="qerl-bench-train-") as tmp:
        work = Path(tmp)
        bf16, nvfp4, nf4 = make_models(work, layers, vocab)
        (work / "nvfp4").symlink_to(nvfp4)
        (work / "nf4").symlink_to(nf4)
        batch = make_batch(bf16, vocab)
        batch_path = work / "batch.json"
        batch_path.write_text(json.dumps({k: getattr(batch, k) for k in batch.__dataclass_fields__}))
        timed = {arm: _run_arm(arm, work, batch_path, steps, {}) for arm in names}
        memory = {arm: _run_arm(arm, work, batch_path, 1, RETURNING_MALLOC) for arm in names}
    t = {arm: _seconds(r) for arm, r in timed.items()}
    rss_default = {arm: _above(r) for arm, r in timed.items()}
    rss = {arm: _above(r) for arm, r in memory.items()}
    lines = [
        "## Train step (one GRPO update)",
        "",
        "Command: `qerl bench train`. Goals: the NVFP4 base's peak at most 0.5x the bf16 base's and its time "
        "at most 1.3x; ours at most TRL's time. The NF4 arm (QLoRA's base) has none: it is the comparison.",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"device {'cuda' if torch.cuda.is_available() else 'cpu'}. Model: Qwen2.5-0.5B shape, {layers} layers, "
        f"vocab {vocab} (shrunk from 151936). Batch {N_PROMPTS * GROUP} x ({PROMPT_LEN} prompt + {COMP_LEN} "
        f"completion) tokens, LoRA r16 all 7 projections, gradient checkpointing in every arm, bf16 "
        "compute with fp32 LoRA master weights cast to bf16 for their matmuls (ours: `lora_autocast`, TRL: "
        "`bf16=True` autocast); "
        f"time is the median of {steps} timed updates after one warm-up, each arm in its own process.",
        "",
        "Peak RSS is measured above the process's RSS after its imports, twice: in the timed run (glibc "
        "defaults, where freed memory stays in the heap) and in a separate run with "
        "`MALLOC_MMAP_THRESHOLD_=131072` (freed blocks go back to the OS, so RSS follows what the update "
        "actually holds; this is the memory figure the goal is judged on).",
        "",
        "| arm | s / update | peak RSS above baseline MB | same, glibc defaults MB |",
        "|---|---:|---:|---:|",
    ]
    for arm in names:
        lines.append(
            f"| {arm} | {_cell(t[arm], '.2f')} | {_cell(rss[arm], '.0f')} | {_cell(rss_default[arm], '.0f')} |"
        )
    lines += [
        "",
        f"- NVFP4 vs bf16 base: peak RSS above baseline **{_ratio(rss['nvfp4'], rss['bf16'])}** (goal <= 0.5x; "
        f"{_ratio(rss_default['nvfp4'], rss_default['bf16'])} with glibc defaults), "
        f"time **{_ratio(t['nvfp4'], t['bf16'])}** (goal <= 1.3x).",
        f"- NF4 (QLoRA's base, bitsandbytes `Linear4bit`) vs bf16 base: peak RSS **{_ratio(rss['nf4'], rss['bf16'])}**, "
        f"time **{_ratio(t['nf4'], t['bf16'])}**; NVFP4 vs NF4: peak RSS **{_ratio(rss['nvfp4'], rss['nf4'])}**, "
        f"time **{_ratio(t['nvfp4'], t['nf4'])}** (no goal: the comparison the paper makes).",
        f"- Ours (bf16 base) vs TRL GRPOTrainer on the same bf16 model: time **{_ratio(t['bf16'], t['trl'])}** "
        "(goal <= 1.0x).",
    ]
    for label, runs in (("timed", timed), ("memory", memory)):
        for arm, r in runs.items():
            if "error" in r:
                last = r["error"].strip().splitlines()[-1] if r["error"].strip() else "?"
                lines.append(f"- {arm} ({label} run) failed: `{last}`")
    text = "\n".join(lines) + "\n"
    print(text)
    return text


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--child", choices=["nvfp4", "nf4", "bf16", "trl"])
    parser.add_argument("--work")
    parser.add_argument("--batch")
    parser.add_argument("--result")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "train.md"))
    cli = parser.parse_args()
    if cli.child:
        _child(cli)
    else:
        from benchmarks import write_section

        write_section(cli.out, main(cli.layers, cli.vocab, cli.steps))
