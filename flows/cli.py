"""The ``qerl`` command line: one entry point, a subcommand per user task.

Handlers import their stage lazily so ``qerl --help`` stays fast and a missing optional backend
only fails the command that needs it.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence

COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {}


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--work-dir", default=None, help="work directory (default: $QERL_WORK_DIR or ./qerl-work)"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qerl", description="Quantization-enhanced RL (NVFP4 + LoRA + GRPO + AQN)"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    # --- subcommands (each block adds a parser and registers its handler in COMMANDS) ---
    _ = sub
    _add_score(sub)
    _add_quantize(sub)
    return parser


def _add_quantize(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("quantize", help="quantize a HF model (dir or hub id) to an NVFP4A16 checkpoint")
    p.add_argument("src", metavar="SRC", help="local model directory, or a hub id where the hub is reachable")
    p.add_argument("--out", required=True, metavar="DST", help="directory to write the checkpoint to")
    p.add_argument("--config", default=None, help="YAML file with quantize settings (QuantizeConfig)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a setting")
    _common(p)
    COMMANDS["quantize"] = _cmd_quantize


def _cmd_quantize(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from pipeline.artifacts import ArtifactStore
    from pipeline.config import load_config
    from pipeline.nvfp4 import QuantizeConfig
    from stages.quantize import export, run_with_status

    t0 = time.perf_counter()
    cfg = load_config(QuantizeConfig, args.config, args.set)
    work = Path(args.work_dir or os.environ.get("QERL_WORK_DIR") or "qerl-work")
    manifest, cached = run_with_status(cfg, args.src, ArtifactStore(work / "store"))
    dst = export(manifest, args.out)
    status = "cache hit" if cached else f"quantized ({manifest.mode})"
    print(
        f"{status}: {dst} ({manifest.extra.get('quantized_tensors')} linears) in {time.perf_counter() - t0:.2f}s"
    )
    return 0


def _add_score(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("score", help="score completions against gold answers (JSONL in, JSONL out)")
    p.add_argument("--input", required=True, help="JSONL file; each line has 'completion' and 'answer'")
    p.add_argument(
        "--output", required=True, help="JSONL file to write (input + correct/reward/extracted/status)"
    )
    p.add_argument("--config", default=None, help="YAML file with reward settings (RewardConfig)")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a reward setting"
    )
    _common(p)
    COMMANDS["score"] = _cmd_score


def _cmd_score(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from pipeline.config import load_config
    from pipeline.rewards import RewardConfig
    from stages.score import score_jsonl

    cfg = load_config(RewardConfig, args.config, args.set)
    total = None
    if os.path.isfile(args.input):
        with open(args.input, encoding="utf-8") as fh:
            total = sum(1 for line in fh if line.strip())
    with tqdm(total=total, unit="answer", desc="score") as bar:
        metrics = score_jsonl(args.input, args.output, cfg, progress=bar.update)
    print(
        f"{metrics['n']} answers: accuracy {metrics['accuracy']:.3f}, reward mean {metrics['reward_mean']:.3f}, "
        f"no_answer {metrics['no_answer_count']}, timeout {metrics['timeout_count']}, error {metrics['error_count']}, "
        f"{metrics['answers_per_s'] or 0:.0f} answers/s -> {args.output}"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if getattr(args, "verbose", False) else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return COMMANDS[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
