"""What a run will write to its work dir, estimated before it starts, and the check against free space.

The estimate (``estimate_run``) is an upper bound by part, from the run config and the model's
shape (``qerl.pipeline.planning.model_shape``; LoRA sizes as ``qerl.pipeline.planning.memory``
counts them), with the run's own retention applied as the flow applies it after every step
(``qerl.pipeline.store.retention``):

- ``adapters``: fp32 LoRA, 4 bytes a parameter, for every step at the adapter interval
  (``store.keep_adapters_every``, by default ``loop.eval_every``), the last
  ``keep_optimizer_last`` steps and the final one;
- ``optimizer states``: two fp32 AdamW moments (8 bytes a parameter) for the last
  ``keep_optimizer_last`` steps and the one being written;
- ``rollouts``: the rollout and scored tables of every step (two tables, each row at most
  ``max_model_len`` tokens: 4 bytes of id and about 4 of text a token, plus a 4-byte logprob per
  completion token);
- ``quantized checkpoint`` and ``twin`` (the dequantized bf16 copy, where the engine serves one):
  only while the store holds no quantized checkpoint (a later run on the same base finds it);
- ``registry copies``: the registered adapter, which MLflow copies into its local artifact folder;
- ``base model``: the demo's base (fp32), which the store builds, until it holds one;
- ``databases``: Prefect's database and ``mlflow.db``, an allowance for a work dir that has none yet.

Evaluation tables (text only, a few MB) and the base model's own download (the Hugging Face cache)
are not counted. ``check_disk`` compares the total with the free space of the work dir's file
system and raises ``DiskSpaceError`` with the numbers; ``store.check_disk: false`` skips it. A model
whose shape is not known offline (a hub id outside the known shapes, a catalogue entry) counts the
tables only, and says so. ``store_after_nights`` is the same arithmetic for the steady state of
nightly runs: what stays of each completed night (its adapters at the interval and its final one,
and its registry copy, for the newest ``keep_versions`` nights only when that is set; no optimizer
state; its tables unless ``keep_step_tables`` is false) plus one night in flight.
"""

from __future__ import annotations

from pathlib import Path

from qerl.pipeline.planning.engine_setup import needs_twin
from qerl.pipeline.planning.errors import RunPlanError
from qerl.pipeline.planning.memory import base_bytes, lora_params
from qerl.pipeline.planning.model_shape import KNOWN_SHAPES, ModelShape, _shape_key, resolve_model
from qerl.pipeline.planning.run_config import RunConfig
from qerl.pipeline.store.files import free_bytes, human_bytes
from qerl.pipeline.store.layout import MLFLOW_DB, OBJECTS_DIR, STORE_DIR

ADAPTER_BYTES = 4  # fp32 LoRA weights
MOMENTS_BYTES = 8  # two fp32 AdamW moments
TOKEN_BYTES, LOGPROB_BYTES = 8, 4  # a token's id and text; a completion token's logprob
# Prefect's database and mlflow.db, new: their schemas (about 2 MB and 1.5 MB) and a first run's rows
DATABASES_BYTES = 16 << 20
TABLES_PER_STEP = 2  # rollouts.parquet and scored.parquet (every rollout column again)


class DiskSpaceError(RunPlanError):
    """The run's estimated writes do not fit the work dir's free space."""


def demo_shape(cfg: RunConfig) -> ModelShape:
    """The shape the demo base is built with (``model.demo``; 4 heads over 2 KV heads)."""
    d = cfg.model.demo
    return ModelShape("demo", d.hidden_size, d.num_layers, 4, 2, d.intermediate_size, d.vocab_size)


def model_shape(cfg: RunConfig) -> ModelShape | None:
    """The base model's shape when it is known without the network (demo, local dir, known shape)."""
    source = cfg.model.source
    if source == "demo":
        return demo_shape(cfg)
    if Path(source).expanduser().exists() or _shape_key(source) in KNOWN_SHAPES:
        return resolve_model(source)[0]
    return None


def adapter_bytes(cfg: RunConfig, shape: ModelShape) -> int:
    """One stored adapter: fp32 LoRA on the configured projections (323 MB for 7B at r=32)."""
    return lora_params(shape, cfg.train.lora_r, cfg.train.target_modules) * ADAPTER_BYTES


def adapter_interval(cfg: RunConfig) -> int:
    """The adapter interval of ``RetentionConfig`` (0: every step), resolved as retention does."""
    if cfg.store.keep_adapters_every is not None:
        return cfg.store.keep_adapters_every
    return cfg.loop.eval_every or cfg.loop.steps


def kept_adapters(cfg: RunConfig, finished: bool) -> int:
    """How many of a run's adapters retention keeps: at the interval, the final one and, while the
    run is unfinished, the last ``keep_optimizer_last``."""
    steps, every = cfg.loop.steps, adapter_interval(cfg)
    at_interval = steps if every == 0 else steps // every
    final = 0 if every and steps % every == 0 else 1
    return min(steps, at_interval + final + (0 if finished else cfg.store.keep_optimizer_last))


def table_bytes(cfg: RunConfig) -> int:
    """One step's rollout and scored tables, at most (every row as long as the engine allows)."""
    rows = cfg.loop.prompts_per_step * cfg.rollout.n_samples
    row = cfg.rollout.max_model_len * TOKEN_BYTES + cfg.rollout.max_new_tokens * LOGPROB_BYTES
    return TABLES_PER_STEP * rows * row


def estimate_run(cfg: RunConfig, store_root: Path | None = None) -> tuple[dict[str, int], list[str]]:
    """(bytes by part, notes) a run of ``cfg`` writes (see the module docstring)."""
    notes: list[str] = []
    parts = {"rollouts": cfg.loop.steps * table_bytes(cfg)}
    shape = model_shape(cfg)
    if shape is None:
        notes.append(
            f"model '{cfg.model.source}' has no shape known offline: adapters and checkpoints not counted"
        )
        return parts, notes
    one = adapter_bytes(cfg, shape)
    parts["adapters"] = kept_adapters(cfg, finished=False) * one
    parts["optimizer states"] = (cfg.store.keep_optimizer_last + 1) * one // ADAPTER_BYTES * MOMENTS_BYTES
    if cfg.model.source == "demo" and not (
        store_root and any((store_root / OBJECTS_DIR / "demo-base").glob("*"))
    ):
        parts["base model"] = 2 * sum(base_bytes(shape, "bf16").values())  # the store builds it, in fp32
    have_base = store_root is not None and any((store_root / OBJECTS_DIR / "quantize").glob("*"))
    if not have_base:
        quantized = base_bytes(shape, {"none": "bf16"}.get(cfg.quantize.scheme, cfg.quantize.scheme))
        parts["quantized checkpoint"] = sum(quantized.values())
        if needs_twin(cfg.rollout.engine, cfg.quantize.scheme):
            parts["twin"] = sum(base_bytes(shape, "bf16").values())
    if cfg.registry.tracking_uri is None or not str(cfg.registry.tracking_uri).startswith("http"):
        parts["registry copies"] = one
    if store_root is None or not (store_root.parent / MLFLOW_DB).is_file():
        parts["databases"] = DATABASES_BYTES
    return parts, notes


def store_after_nights(cfg: RunConfig, nights: int) -> int:
    """The store (and local registry) after ``nights`` completed nights of ``cfg`` plus one in flight.

    With ``store.keep_versions`` K only the newest K nights and the champion (at worst an older one)
    keep their adapters and registry copy; every night keeps its tables when ``keep_step_tables``."""
    shape = model_shape(cfg)
    if shape is None:
        raise RunPlanError(f"model '{cfg.model.source}' has no shape known offline")
    one = adapter_bytes(cfg, shape)
    night = kept_adapters(cfg, finished=True) * one + one  # + one: the night's registry copy
    keep = cfg.store.keep_versions
    holding = nights if keep is None else min(nights, keep + 1)  # + 1: an older champion
    tables = cfg.loop.steps * table_bytes(cfg) if cfg.store.keep_step_tables else 0
    in_flight, _ = estimate_run(cfg)  # the first run's writes: the checkpoint and twin included
    return holding * night + nights * tables + sum(in_flight.values())


def check_disk(cfg: RunConfig, work: Path) -> dict[str, int]:
    """Raise ``DiskSpaceError`` (one line: the work dir, the estimate by part, the free space, the
    setting that skips the check) when the run's estimate exceeds the free space; returns the parts."""
    parts, _ = estimate_run(cfg, work / STORE_DIR)
    need, free = sum(parts.values()), free_bytes(work)
    if cfg.store.check_disk and free is not None and need > free:
        by_part = ", ".join(f"{k} {human_bytes(v)}" for k, v in parts.items())
        raise DiskSpaceError(
            f"work dir {work}: this run would write about {human_bytes(need)} ({by_part}) but only "
            f"{human_bytes(free)} is free; free space (qerl gc), tighten the store section, or set "
            "store.check_disk=false to start anyway"
        )
    return parts
