"""What an evaluation measures and how it samples: ``EvalConfig`` (the run config's ``eval`` section)
and the benchmarks it names.

A benchmark is a list of problems (from ``qerl.pipeline.data.datasets``, test split by default);
each item gets k sampled completions (temperature 0.6, top_p 0.95 by default, as in the
QeRL/DeepSeek-R1 evaluation protocol) or one greedy completion, scored by the training scorer
(``qerl.pipeline.data.rewards``). Per-item rates are kept so two adapters can be compared item by
item; the statistics are ``qerl.pipeline.evaluation.statistics``. A benchmark is identified by its
name, split and the digest of its exact items (``benchmark_id``), so two numbers can be compared
knowing what they measured.

Departure from the paper: the paper reports GSM8K/MATH/AIME/AMC accuracy; here the embedded default
benchmark is the procedural arithmetic test split, so the pipeline runs with nothing downloaded. The
paper's benchmarks are the named datasets ``gsm8k``, ``math500``, ``aime24`` and ``amc23`` (local
copies under ``data.root``/``$QERL_DATA_DIR``, else the hub).
"""

from __future__ import annotations

from pydantic import Field, model_validator
from qerl.pipeline.config import StrictModel
from qerl.pipeline.data.datasets import DataConfig, dataset_name


class BenchmarkConfig(DataConfig):
    """A ``DataConfig`` whose defaults suit evaluation (so ``--set benchmark.limit=9`` keeps them)."""

    split: str = "test"
    # level 1 has only ~112 distinct test-split problems, fewer than DataConfig's default size
    arithmetic_size: int = Field(100, ge=1, description="problems generated for the arithmetic split")


class EvalConfig(StrictModel):
    """Which benchmark to evaluate (a ``DataConfig``, test split) and how to sample it."""

    benchmark: BenchmarkConfig = Field(
        default_factory=BenchmarkConfig, description="dataset, split, limit and prompt template"
    )
    also: list[BenchmarkConfig] = Field(
        default_factory=list,
        description="further benchmarks evaluated and reported beside the main one (which alone decides promotion)",
    )
    k: int = Field(4, ge=1, description="samples per item (avg@k)")
    temperature: float = Field(0.6, ge=0.0)
    top_p: float = Field(0.95, gt=0.0, le=1.0)
    greedy: bool = Field(False, description="one greedy completion per item (k=1, temperature 0)")
    max_new_tokens: int = Field(256, ge=1)
    seed: int = 0

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


def benchmark_id(cfg: DataConfig, digest: str) -> str:
    """A benchmark's identity for comparisons: dataset name, split and the digest of its exact items
    (``gsm8k/test@...``; a file ``.../gsm8k/test.jsonl`` is named by its folder, see ``dataset_name``)."""
    name, split = dataset_name(cfg)
    return f"{name}/{split}@{digest[:12]}"
