"""The ``qerl`` command line: one entry point, a subcommand per user task.

Handlers import their stage lazily so ``qerl --help`` stays fast and a missing optional backend
only fails the command that needs it.
"""

from __future__ import annotations

import argparse
import logging
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
    return parser


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
