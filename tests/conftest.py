"""Shared fixtures: tiny models built from configs (nothing is downloaded) and a clean environment."""

from __future__ import annotations

import os

# Before anything imports triton or vllm: kernels run in the interpreter on CPU, vLLM stays small.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
# what qerl.flows.orchestration.prepare_environment sets, here because Prefect reads it once, at import
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

# Seconds each of the slowest files takes on two cores (the per-file sum of a quiet run's test times).
# With `--dist loadfile` a worker takes the next file when it finishes one; handing out the longest
# first keeps one worker from starting a two-minute file while the other runs out of work. The
# Makefile passes --no-loadscope-reorder: pytest-xdist would otherwise hand files out by test count.
SLOW_FILES = {
    "test_flow.py": 160,
    "test_interrupt.py": 104,
    "test_ablation_ray.py": 103,
    "test_contention.py": 97,
    "test_real_model.py": 77,
    "test_ablation.py": 73,
    "test_registry.py": 68,
    "test_nightly.py": 41,
    "test_gc.py": 37,
    "test_base_identity.py": 37,
    "test_deadline.py": 32,
    "test_aqn_objective.py": 29,
    "test_demo.py": 28,
    "test_evaluation.py": 23,
    "test_quantize_quality.py": 23,
    "test_run_start.py": 22,
    "test_aqn_compiled_vllm.py": 21,
    "test_release.py": 18,
    "test_engines.py": 18,
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Longest files first (stable: the order within a file, and among the rest, stays)."""
    items.sort(key=lambda item: -SLOW_FILES.get(item.path.name, 0))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen2-architecture toy model (bf16, 2 layers, hidden 128, head_dim 32)."""
    from qerl.pipeline.demo.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), arch="qwen2", norm_jitter=0.05)


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory):
    """Build more toy models: ``factory(arch="llama", dtype=torch.float32, ...)``."""
    from qerl.pipeline.demo.tiny_model import build_tiny_model

    def factory(arch: str = "qwen2", dtype: torch.dtype = torch.bfloat16, **kwargs) -> Path:
        return build_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch=arch, dtype=dtype, **kwargs)

    return factory


@pytest.fixture(scope="session")
def learner_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 that has learned the answer format and is right about 40% of the time on level-1
    arithmetic (sampled at temperature 1): the embedded demo's warm-up at a smaller size (about 12 s),
    so GRPO groups have mixed rewards and the end-to-end tests train for real (tests/learning.py).
    Its warm-up runs on torch's AVX2 kernels on every CPU (``PORTABLE_ARITHMETIC``), so it is one model
    wherever AVX2 is; it is checked where it is built all the same: at least half of 32 groups of 4
    must be mixed (measured: 26 of 32, accuracy 0.47; 22 to 28 with warm-up seeds 1 to 3)."""
    import shutil

    from filelock import FileLock
    from learning import learning_band
    from qerl.pipeline.demo.base_model import DemoBaseConfig, build_demo_base

    cfg = DemoBaseConfig(
        levels=[1], n_train=400, sft_steps=110, hidden_size=64, intermediate_size=192, num_layers=2
    )
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # built once for the workers: the second finds it (or waits for it)
    out = root / "learner"
    with FileLock(str(root / "learner.lock")):
        if not (root / "learner.built").is_file():  # beside it: the model's folder stays the model's
            shutil.rmtree(out, ignore_errors=True)  # a build that failed half-way is not built into
            build_demo_base(out, cfg)
            mixed, accuracy = learning_band(out)
            assert mixed >= 16, (
                f"the learner model built on this CPU is outside the learning band: {mixed} of 32 groups "
                f"mixed at temperature 1 (accuracy {accuracy:.2f}); the end-to-end tests would not train"
            )
            (root / "learner.built").touch()
    return out


@pytest.fixture(autouse=True)
def _no_handler_on_a_closed_stream():
    """After each test, drop logging handlers left writing to a stream that is closed by now (the
    test's captured stderr, kept by a handler that Prefect or a console session set up during it).
    Logging to one fails, and inside a flow Prefect turns the failure's report (a print) into a log
    record again: a recursion that ends a later test of the same worker."""
    import logging

    yield
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    for logger in loggers:
        for handler in list(getattr(logger, "handlers", ())):
            # a StreamHandler's stream, or the rich console's file of Prefect's console handler
            stream = getattr(getattr(handler, "console", None), "file", None) or getattr(
                handler, "stream", None
            )
            if stream is not None and getattr(stream, "closed", False):
                logger.removeHandler(handler)


@pytest.fixture(scope="session", autouse=True)
def _migrated_prefect_database(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Migrate one Prefect database for the session's CLI runs (tests/prefect_home.py); xdist's
    workers share it, made by whichever gets the lock first."""
    from filelock import FileLock
    from prefect_home import TEMPLATE_ENV, make_template

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # shared by the workers
    with FileLock(str(root / "prefect-template.lock")):
        home = make_template(root / "prefect-template")
    os.environ[TEMPLATE_ENV] = str(home)


@pytest.fixture(scope="session", autouse=True)
def _stop_prefects_temporary_servers():
    """Stop the temporary Prefect servers in-process flows started, while pytest still captures output:
    Prefect's own atexit stop logs to a stream pytest has closed by then (a logging traceback after the
    summary), after the last log batches are sent to them (else "Error logging to API" at exit)."""
    yield
    import sys

    handlers = sys.modules.get("prefect.logging.handlers")
    if handlers is not None:  # send the last log batches while their server still answers
        handlers.APILogWorker.drain_all(timeout=10)
    server = sys.modules.get("prefect.server.api.server")
    if server is not None:
        for instance in list(server.SubprocessASGIServer._instances.values()):
            instance.stop()
