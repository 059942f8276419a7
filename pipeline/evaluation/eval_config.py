"""What an evaluation measures and how it samples: ``EvalConfig`` (the run config's ``eval`` section)
and the benchmarks it names.

A benchmark is a list of problems (from ``qerl.pipeline.data.datasets``, test split by default);
each item gets k sampled completions (temperature 0.6, top_p 0.95 by default, as in the
QeRL/DeepSeek-R1 evaluation protocol) or one greedy completion, scored by the training scorer
(``qerl.pipeline.data.rewards``). Per-item rates are kept so two adapters can be compared item by
item; the statistics are ``qerl.pipeline.evaluation.statistics``. A benchmark is identified by its
name, split, the digest of its exact items and the digest of its *protocol* (``benchmark_id``:
``gsm8k/test@<items>~<protocol>``). The protocol (``eval_protocol``) is everything else that moves the
number: prompt template, samples per item, temperature/top_p/greedy, ``max_new_tokens``, the engine
mode and the scorer's config. Two numbers with the same id measured the same thing the same way; a
changed k, template or engine is another benchmark, never a comparison.

Promotion is decided on a *validation* split (``eval.validation``): ``size`` problems held out of the
training data (``validation_split``: chosen by a seeded hash of their ids, so the choice does not
depend on the order of the file, and removed from the training stream before the data cursor sees
it), disjoint from the stream and from the reported test benchmark, which is still evaluated and
reported but never selects.

Departure from the paper: the paper reports GSM8K/MATH/AIME/AMC accuracy; here the embedded default
benchmark is the procedural arithmetic test split, so the pipeline runs with nothing downloaded. The
paper's benchmarks are the named datasets ``gsm8k``, ``math500``, ``aime24`` and ``amc23`` (local
copies under ``data.root``/``$QERL_DATA_DIR``, else the hub).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import Field, model_validator
from qerl.pipeline.config import StrictModel
from qerl.pipeline.data.datasets import DataConfig, dataset_name
from qerl.pipeline.store.files import sha256_json


class BenchmarkConfig(DataConfig):
    """A ``DataConfig`` whose defaults suit evaluation (so ``--set benchmark.limit=9`` keeps them)."""

    split: str = "test"
    # level 1 has only ~112 distinct test-split problems, fewer than DataConfig's default size
    arithmetic_size: int = Field(100, ge=1, description="problems generated for the arithmetic split")


class ValidationConfig(StrictModel):
    """The held-out slice of the training data that promotion is decided on."""

    size: int = Field(
        128,
        ge=0,
        description="training problems held out for the promotion decision (at most a quarter of the "
        "training data; 0: promotion falls back to the main benchmark)",
    )
    seed: int = Field(0, description="which problems are held out (a seeded hash of their ids)")


class EvalConfig(StrictModel):
    """Which benchmark to evaluate (a ``DataConfig``, test split) and how to sample it."""

    benchmark: BenchmarkConfig = Field(
        default_factory=BenchmarkConfig, description="dataset, split, limit and prompt template"
    )
    also: list[BenchmarkConfig] = Field(
        default_factory=list,
        description="further benchmarks evaluated and reported beside the main one (none decides promotion)",
    )
    k: int = Field(4, ge=1, description="samples per item (avg@k)")
    temperature: float = Field(0.6, ge=0.0)
    top_p: float = Field(0.95, gt=0.0, le=1.0)
    greedy: bool = Field(False, description="one greedy completion per item (k=1, temperature 0)")
    max_new_tokens: int = Field(256, ge=1)
    seed: int = 0
    validation: ValidationConfig = Field(
        default_factory=ValidationConfig,
        description="held-out training problems that decide promotion (the benchmark is reported only)",
    )

    @model_validator(mode="after")
    def _check(self) -> EvalConfig:
        if not self.greedy and self.temperature == 0.0 and self.k > 1:
            raise ValueError("temperature 0 with k > 1 gives k identical samples: set greedy=true (k=1)")
        return self

    @property
    def n_samples(self) -> int:
        return 1 if self.greedy else self.k

    @property
    def sampling_temperature(self) -> float:
        return 0.0 if self.greedy else self.temperature

    @property
    def sampling_top_p(self) -> float:
        return 1.0 if self.greedy else self.top_p


def eval_protocol(
    cfg: EvalConfig, template: str, engine_mode: str, scorer: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """What, besides the items, decides an evaluation's number: template, samples per item, sampling,
    ``max_new_tokens``, engine mode and (digested) scorer config. Not the seed: another draw of the
    same protocol is comparable."""
    return {
        "template": template,
        "k": cfg.n_samples,
        "temperature": cfg.sampling_temperature,
        "top_p": cfg.sampling_top_p,
        "greedy": cfg.greedy,
        "max_new_tokens": cfg.max_new_tokens,
        "engine_mode": engine_mode,
        "scorer": sha256_json(dict(scorer))[:12] if scorer is not None else None,
    }


def benchmark_id(cfg: DataConfig, digest: str, protocol: Mapping[str, Any] | None = None) -> str:
    """A benchmark's identity for comparisons: dataset name, split, the digest of its exact items
    and, given the protocol (``eval_protocol``), its digest (``gsm8k/test@<items>~<protocol>``; a file
    ``.../gsm8k/test.jsonl`` is named by its folder, see ``dataset_name``)."""
    name, split = dataset_name(cfg)
    ident = f"{name}/{split}@{digest[:12]}"
    return f"{ident}~{sha256_json(dict(protocol))[:10]}" if protocol is not None else ident


def validation_split(problems: Sequence[Any], cfg: ValidationConfig) -> tuple[list[Any], list[Any]]:
    """(training, validation): ``cfg.size`` problems (at most a quarter of them) held out, chosen by
    a seeded hash of their ids, both lists in their original order. Problems that share a ``group``
    (the arithmetic set's numbers) are held out together, whole groups in hash order as long as they
    fit that size: no validation problem is a training problem phrased otherwise."""
    n = min(cfg.size, len(problems) // 4)
    if n == 0:
        return list(problems), []

    def group(p: Any) -> str:
        return str(p.get("group") or p["id"])

    members: dict[str, int] = {}
    for p in problems:
        members[group(p)] = members.get(group(p), 0) + 1
    ranked = sorted(
        members, key=lambda g: hashlib.sha256(f"qerl-validation-{cfg.seed}-{g}".encode()).hexdigest()
    )
    held_groups, count = set(), 0
    for g in ranked:
        if count + members[g] <= n:  # a group that would pass the size is skipped, never split
            held_groups.add(g)
            count += members[g]
    return [p for p in problems if group(p) not in held_groups], [
        p for p in problems if group(p) in held_groups
    ]
