"""The ``qerl`` command line: one entry point, a subcommand per user task.

This module is the parser and the dispatch: each ``_add_*`` block declares a subcommand's arguments
and names its handler in ``COMMANDS``. The handlers live beside it: ``commands`` (the commands that
run a flow: run, resume, schedule, ablate; and ``qerl runs``), ``tool_commands`` (the one-shot
commands), ``registry_commands`` and ``store_commands``. A handler's module is imported when its
command runs, so ``qerl --help`` stays fast, a missing optional backend only fails the command that
needs it, and a command that runs a flow has Prefect's environment set before Prefect is imported
(``_prefect_environment``, the one place it is set). An expected failure (a ValueError,
FileNotFoundError or RuntimeError: bad config, missing artifact, engine error) prints one line and
exits 2.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Callable, Sequence

from qerl.pipeline.runtime.determinism import prepare_process

# command -> "module:function" of qerl.flows, imported when the command runs (after Prefect's environment)
COMMANDS: dict[str, str] = {}
PRESET_HELP = "YAML file or preset name (see pipeline/planning/presets)"
SET_HELP = "override a setting"


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--work-dir", default=None, help="work directory (default: $QERL_WORK_DIR or ./qerl-work)"
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="debug logging; run/resume: libraries' output on the terminal too (else only in run.log)",
    )


def _store_uri(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--store-uri",
        default=None,
        metavar="URI",
        help="a fleet's shared store: its run records too (default: $QERL_STORE_URI)",
    )


def _config_options(parser: argparse.ArgumentParser, config_help: str, set_help: str) -> None:
    """``--config FILE`` and the repeatable ``--set KEY=VALUE`` of a command with a config."""
    parser.add_argument("--config", default=None, help=config_help)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help=set_help)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qerl", description="Quantization-enhanced RL (NVFP4 + LoRA + GRPO + AQN)"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    # --- subcommands (each block adds a parser and registers its handler in COMMANDS) ---
    _add_score(sub)
    _add_quantize(sub)
    _add_promote(sub)
    _add_policy(sub)
    _add_heldout(sub)
    _add_versions(sub)
    _add_eval(sub)
    _add_run(sub)
    _add_bench(sub)
    _add_gc(sub)
    _add_plan(sub)
    _add_ablate(sub)
    from qerl.flows.fleet_commands import add_parsers  # argparse only: --help stays fast

    add_parsers(sub, COMMANDS, _common, lambda p, c, s: _config_options(p, c, s))
    return parser


def _add_ablate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "ablate", help="compare arms (bf16-lora, nvfp4-lora, nvfp4-aqn) over seeds: a run each, then a report"
    )
    _config_options(p, PRESET_HELP, SET_HELP)
    p.add_argument(
        "--arms",
        required=True,
        help="comma-separated arms, e.g. bf16-lora,nvfp4-lora,nvfp4-aqn; an NVFP4 arm may add its quantizer "
        "and an AQN arm its objective: nvfp4-lora-gptq, nvfp4-aqn-gptq-on_policy",
    )
    p.add_argument("--seeds", type=int, default=3, help="replicates per arm (default 3)")
    p.add_argument("--bootstrap", type=int, default=10_000, help="bootstrap resamples over items")
    p.add_argument(
        "--ray",
        default=None,
        metavar="ADDRESS",
        help="run the runs concurrently on this Ray cluster (host:port, ray://host:10001, auto, local; "
        "default: $QERL_RAY_ADDRESS, else one after the other here); see flows/ray/",
    )
    p.add_argument(
        "--pool",
        default=None,
        help="submit the runs to this work pool of a fleet (PREFECT_API_URL: its server; needs store.uri)",
    )
    p.add_argument("--cpus-per-run", type=float, default=1.0, help="with --ray: CPUs each run asks for")
    p.add_argument(
        "--gpus-per-run",
        type=float,
        default=None,
        help="with --ray: GPUs each run asks for (default: rollout.tensor_parallel_size if the cluster has GPUs, else 0)",
    )
    _common(p)
    COMMANDS["ablate"] = "commands:cmd_ablate"


def _add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan", help="GPU memory budget of a colocated run (vLLM + trainer on one GPU): does it fit?"
    )
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="config.json, model dir, hub id or known shape (qwen2.5-7b ...); default: model.source",
    )
    p.add_argument(
        "--gpu-mem",
        default=None,
        help="one GPU's memory: 80 (GiB), 80GiB, 80GB or 81559MiB (default: this machine's first GPU)",
    )
    _config_options(p, PRESET_HELP, SET_HELP)
    p.add_argument("--prompt-tokens", type=int, default=None, help="longest prompt (default: the worst case)")
    p.add_argument(
        "--base",
        choices=["nvfp4", "nf4", "bf16"],
        default="nvfp4",
        help="the base both sides hold (nf4: QLoRA's; bf16: the 16-bit comparison)",
    )
    COMMANDS["plan"] = "tool_commands:cmd_plan"


def _add_run(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="run the RL flow (no --config: the embedded demo)")
    _config_options(p, PRESET_HELP, SET_HELP)
    p.add_argument(
        "--night",
        default=None,
        metavar="YYYY-MM-DD|today",
        help="run that night's nightly run by hand (warm start, next data slice), as the schedule would",
    )
    _common(p)
    COMMANDS["run"] = "commands:cmd_run"
    p = sub.add_parser("resume", help="continue a recorded run: completed stages are reused")
    p.add_argument("run_id", metavar="RUN", help="run id (see <work>/runs)")
    _store_uri(p)
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="change a resource setting (memory, batching, workers, timeouts: 'in keys: no' in the "
        "configuration reference); finished steps are still reused",
    )
    _common(p)
    COMMANDS["resume"] = "commands:cmd_resume"
    p = sub.add_parser(
        "runs", help="list the work dir's runs, newest first: completed, failed, running or interrupted"
    )
    p.add_argument("--limit", type=int, default=20, metavar="N", help="show the newest N (default 20)")
    p.add_argument("--all", action="store_true", help="show every run")
    _store_uri(p)
    _common(p)
    COMMANDS["runs"] = "commands:cmd_runs"
    p = sub.add_parser("schedule", help="serve the nightly deployment, or deploy it to a fleet's work pool")
    p.add_argument("--cron", required=True, help="cron expression, e.g. '0 2 * * *'")
    p.add_argument(
        "--pool",
        default=None,
        help="deploy to this Prefect work pool and return (a fleet: `qerl worker` runs the nights)",
    )
    p.add_argument(
        "--api-url",
        default=None,
        metavar="URL",
        help="the Prefect server's API (default: $PREFECT_API_URL, else http://127.0.0.1:4200/api)",
    )
    _config_options(p, "YAML file or preset name", SET_HELP)
    _common(p)
    COMMANDS["schedule"] = "commands:cmd_schedule"


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run benchmarks (all, or one by name) and rewrite BENCHMARKS.md")
    p.add_argument("name", nargs="?", default=None, help="quantize, score, rollout, train or contention")
    _common(p)
    COMMANDS["bench"] = "tool_commands:cmd_bench"


def _add_quantize(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("quantize", help="quantize a HF model (dir or hub id) to an NVFP4A16 checkpoint")
    p.add_argument(
        "src",
        metavar="SRC",
        help="local model directory, a catalogue model (smollm2-135m-instruct), or a hub id where the hub is reachable",
    )
    p.add_argument("--out", required=True, metavar="DST", help="directory to write the checkpoint to")
    p.add_argument(
        "--report",
        action="store_true",
        help="also print the per-linear relative weight errors of the quality section, worst first",
    )
    _config_options(p, "YAML file with quantize settings (QuantizeConfig)", SET_HELP)
    _common(p)
    COMMANDS["quantize"] = "tool_commands:cmd_quantize"


def _add_score(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("score", help="score completions against gold answers (JSONL in, JSONL out)")
    p.add_argument("--input", required=True, help="JSONL file; each line has 'completion' and 'answer'")
    p.add_argument(
        "--output", required=True, help="JSONL file to write (input + correct/reward/extracted/status)"
    )
    _config_options(p, "YAML file with reward settings (RewardConfig)", "override a reward setting")
    _common(p)
    COMMANDS["score"] = "tool_commands:cmd_score"


def _add_promote(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("promote", help="make a registered adapter version the champion (manual promotion)")
    p.add_argument("name", metavar="NAME", help="registered model name (e.g. qerl-adapter)")
    p.add_argument("version", metavar="VERSION", help="model version number")
    _config_options(p, "YAML file with registry settings (RegistryConfig)", "override a registry setting")
    _common(p)
    COMMANDS["promote"] = "registry_commands:cmd_promote"


def _add_policy(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("policy", help="show a registered model's promotion policy, or change it (recorded)")
    p.add_argument(
        "name",
        nargs="?",
        default=None,
        metavar="NAME",
        help="registered model name (default: registry.model_name)",
    )
    p.add_argument(
        "--change",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="change a field (margin_se, margin, benchmark, base_digest, quant_recipe); repeatable",
    )
    _config_options(p, "YAML file with registry settings (RegistryConfig)", "override a registry setting")
    _common(p)
    COMMANDS["policy"] = "registry_commands:cmd_policy"


def _add_heldout(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "heldout", help="attest that a version's lineage never trained on its validation items (recorded)"
    )
    p.add_argument("name", metavar="NAME", help="registered model name (e.g. qerl-adapter)")
    p.add_argument("version", metavar="VERSION", help="model version number")
    p.add_argument(
        "--reason", required=True, help="why the lineage held them out (kept with the attestation)"
    )
    p.add_argument(
        "--items",
        default=None,
        metavar="DIGEST",
        help="the validation items' digest (default: the version's validation_digest tag)",
    )
    _config_options(p, "YAML file with registry settings (RegistryConfig)", "override a registry setting")
    _common(p)
    COMMANDS["heldout"] = "registry_commands:cmd_heldout"


def _add_versions(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "versions", help="list a registered model's versions: aliases, run, accuracies, released or kept"
    )
    p.add_argument(
        "name",
        nargs="?",
        default=None,
        metavar="NAME",
        help="registered model name (default: registry.model_name)",
    )
    _config_options(p, "YAML file with registry settings (RegistryConfig)", "override a registry setting")
    _common(p)
    COMMANDS["versions"] = "registry_commands:cmd_versions"


def _add_eval(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="evaluate an adapter (or none) on a benchmark: pass@1 averaged over k")
    p.add_argument(
        "--adapter",
        required=True,
        metavar="DIR|none|models:/NAME@ALIAS",
        help="peft adapter folder, 'none', or a registered version: models:/NAME/VERSION or "
        "models:/NAME@ALIAS (e.g. models:/qerl-adapter@champion), evaluated under the eval, reward and "
        "quantize sections of the run that registered it when its record is in the work dir",
    )
    p.add_argument(
        "--benchmark", default=None, metavar="NAME", help="arithmetic|gsm8k|math500|aime24|amc23|FILE"
    )
    p.add_argument(
        "--base",
        required=True,
        metavar="DIR",
        help="checkpoint from 'qerl quantize' (or a HF model dir or catalogue model to quantize)",
    )
    p.add_argument("--engine", choices=["vllm", "hf"], default="vllm", help="rollout engine (default vllm)")
    _config_options(
        p,
        "YAML file with evaluation settings (EvalConfig; for a registered adapter, instead of its run's)",
        (
            "override an eval setting, the engine's with rollout.KEY (e.g. rollout.max_model_len=4096; "
            "by default the context is capped by the model and the LoRA rank read from the adapter), or the "
            "recipe that quantizes a plain --base with quantize.KEY (e.g. quantize.method=gptq), or the "
            "registry a models:/ adapter is read from with registry.KEY (default: the work dir's), or "
            "the scorer with reward.KEY (e.g. reward.answer_format=answer_tags)"
        ),
    )
    _common(p)
    COMMANDS["eval"] = "tool_commands:cmd_eval"


def _add_gc(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "gc",
        help="free store space: old optimizer states, thinned adapters, released versions, trash, base copies an upgrade superseded (live runs are never touched)",
    )
    p.add_argument(
        "--dry-run", action="store_true", help="list what would be deleted and the bytes; delete nothing"
    )
    p.add_argument(
        "--keep-optimizer-last",
        type=int,
        default=None,
        metavar="K",
        help="override every run's store.keep_optimizer_last",
    )
    p.add_argument(
        "--keep-adapters-every",
        type=int,
        default=None,
        metavar="E",
        help="override every run's store.keep_adapters_every (0: keep all adapters)",
    )
    p.add_argument(
        "--live-window-h",
        type=float,
        default=None,
        metavar="H",
        help="override store.live_window_h: a running run updated within H hours is live",
    )
    p.add_argument(
        "--keep-versions",
        type=int,
        default=None,
        metavar="N",
        help="override store.keep_versions: release registered versions older than the newest N "
        "(an alias-holding version always stays)",
    )
    _common(p)
    COMMANDS["gc"] = "store_commands:cmd_gc"


# runs (their console session moves logging to run.log) and the nightly server: INFO is their record
RUN_COMMANDS = ("run", "resume", "ablate", "schedule", "worker")
# other commands that work for minutes: qerl's own INFO lines are their progress
PROGRESS_COMMANDS = ("quantize", "eval", "bench")


def _terminal_logging(command: str, verbose: bool) -> None:
    """Runs keep INFO for run.log (their console session moves it there). Every other command prints
    its result itself, so its terminal shows warnings and errors, plus qerl's progress lines for the
    long ones, not the INFO lines beside the result; ``-v`` shows everything."""
    qerl_level = logging.NOTSET  # inherit: a run's qerl INFO lines reach run.log
    if verbose or command in RUN_COMMANDS:
        logging.basicConfig(
            level=logging.DEBUG if verbose else logging.INFO,
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
    else:
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
        qerl_level = logging.INFO if command in PROGRESS_COMMANDS else logging.WARNING
    logging.getLogger("qerl").setLevel(qerl_level)


def _prefect_environment(args: argparse.Namespace) -> None:
    """Prefect's settings for a command that runs a flow, set once, before Prefect is imported (it
    reads them at import): its state in the work directory, and for ``qerl schedule`` the server's API."""
    from qerl.flows import orchestration
    from qerl.pipeline.store.layout import default_work_dir, recorded_run

    work = default_work_dir(args.work_dir)
    if args.command == "resume":
        from qerl.flows.fleet import pull_records

        pull_records(work, args.store_uri)  # a run another machine of a fleet left
        recorded_run(work, args.run_id)  # a mistyped id or --work-dir: an error, and nothing made there
    if args.command == "schedule":
        url = args.api_url or os.environ.get("PREFECT_API_URL") or orchestration.LOOPBACK_API_URL
        os.environ["PREFECT_API_URL"] = url
    work.mkdir(parents=True, exist_ok=True)
    orchestration.prepare_environment(work)


def _handler(command: str) -> Callable[[argparse.Namespace], int]:
    module, function = COMMANDS[command].split(":")
    return getattr(importlib.import_module(f"qerl.flows.{module}"), function)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _terminal_logging(args.command, getattr(args, "verbose", False))
    prepare_process()  # before any CUDA matmul: train.deterministic needs cuBLAS's workspace config
    try:
        from qerl.pipeline.fleet.settings import load_credentials_file

        load_credentials_file()  # QERL_CREDENTIALS_FILE: the fleet's passwords, never in a config
        if args.command in RUN_COMMANDS:
            _prefect_environment(args)
        return _handler(args.command)(args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, OSError, RuntimeError) as err:
        # ConfigError, ArtifactError, EngineError, a path that is missing, a directory or not
        # writable: a clear message naming it, not a traceback (-v shows the traceback).
        if getattr(args, "verbose", False):
            raise
        print(f"qerl {args.command}: error: {err}", file=sys.stderr)
        return 2


def entry() -> None:
    """The ``qerl`` command: ``main``, then exit with its status. After a run that lost its Prefect
    server, exit without Prefect's exit handlers, which would retry every queued event and log line
    against the lost server for minutes (``qerl.flows.orchestration``); qerl's own files are flushed
    and closed by then."""
    code = main()
    from qerl.flows import orchestration

    if orchestration.lost():
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
