"""One RL step's scored rollouts as the trainer reads them, and their collation into minibatches.

``load_rollout_batch`` reads ``scored.parquet`` into a ``RolloutBatch`` (Python lists, one entry per
sample), checking that every row has a prompt and one logprob per completion token and that the
rollouts were sampled at the temperature training uses. The step's AQN noise (``sigma`` and
``noise_seed`` columns, the rollout's provenance) comes along as one value per table: a trainer that
applies the same noise (``grpo.aqn_objective``) needs exactly the draw the sampler used, so rows that
disagree are an error; a table without the columns (written by hand, or before the noise seed was
recorded) reads as sigma 0 / seed unknown. ``collate`` pads a minibatch: prompts on the
left, completions on the right, so every completion starts at the same column and the logprob head
reads one contiguous slab.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["RolloutBatch", "collate", "load_rollout_batch"]


@dataclass
class RolloutBatch:
    """The scored rollouts of one RL step, as Python lists (one entry per sample)."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    sampler_logprobs: list[list[float]]
    truncated: list[bool]
    rewards: list[float]
    group_ids: list[Any]
    source: str = "<memory>"
    sigma: float = 0.0  # the rollout's AQN sigma (one per RL step)
    noise_seed: int | None = None  # the seed of its noise draw; None: not recorded

    def __len__(self) -> int:
        return len(self.rewards)


def load_rollout_batch(path: str | Path, temperature: float | None = None) -> RolloutBatch:
    """Read ``scored.parquet``; checks lengths per row and (if given) the sampling temperature."""
    import pyarrow.parquet as pq

    path = Path(path)
    table = pq.read_table(path)
    need = ["group_id", "prompt_ids", "completion_ids", "logprobs", "finish_reason", "reward"]
    missing = [c for c in need if c not in table.column_names]
    if missing:
        raise ValueError(f"{path}: missing columns {missing} (has {table.column_names})")
    cols = {c: table.column(c).to_pylist() for c in need}
    if temperature is not None and "temperature" in table.column_names:
        temps = set(table.column("temperature").to_pylist())
        if any(not math.isclose(t, temperature, rel_tol=1e-6) for t in temps):
            raise ValueError(
                f"{path}: rollouts sampled at temperature {sorted(temps)}, training uses {temperature}"
            )
    for i, (p, c, lp) in enumerate(
        zip(cols["prompt_ids"], cols["completion_ids"], cols["logprobs"], strict=True)
    ):
        if not p:
            raise ValueError(f"{path}: row {i} has an empty prompt")
        if len(lp) != len(c):
            raise ValueError(f"{path}: row {i} has {len(c)} completion ids but {len(lp)} logprobs")
    sigma, noise_seed = _step_noise(table, path)
    return RolloutBatch(
        prompt_ids=cols["prompt_ids"],
        completion_ids=cols["completion_ids"],
        sampler_logprobs=cols["logprobs"],
        truncated=[r == "length" for r in cols["finish_reason"]],
        rewards=[float(r) for r in cols["reward"]],
        group_ids=cols["group_id"],
        source=str(path),
        sigma=sigma,
        noise_seed=noise_seed,
    )


def _step_noise(table: Any, path: Path) -> tuple[float, int | None]:
    """The table's one AQN (sigma, noise seed); (0.0, None) without the columns."""
    found: list[Any] = []
    for name in ("sigma", "noise_seed"):
        values = set(table.column(name).to_pylist()) if name in table.column_names else {None}
        if len(values) > 1:
            raise ValueError(f"{path}: rows of one RL step have different AQN {name}s {sorted(values)}")
        found.append(values.pop() if values else None)
    sigma, seed = found
    if sigma is not None and not (math.isfinite(sigma) and sigma >= 0.0):
        raise ValueError(f"{path}: AQN sigma {sigma} is not a finite value >= 0")
    return float(sigma or 0.0), None if seed is None else int(seed)


def collate(
    batch: RolloutBatch, rows: list[int], row_mask: torch.Tensor, pad_id: int
) -> dict[str, torch.Tensor]:
    """Left-pad prompts and right-pad completions so every completion starts at the same column."""
    P = max(len(batch.prompt_ids[i]) for i in rows)
    C = max(1, max(len(batch.completion_ids[i]) for i in rows))
    n = len(rows)
    input_ids = torch.full((n, P + C), pad_id, dtype=torch.long)
    attention = torch.zeros(n, P + C, dtype=torch.long)
    comp_mask = torch.zeros(n, C)
    sampler = torch.zeros(n, C)
    for b, i in enumerate(rows):
        p, c = batch.prompt_ids[i], batch.completion_ids[i]
        input_ids[b, P - len(p) : P] = torch.tensor(p)
        input_ids[b, P : P + len(c)] = torch.tensor(c, dtype=torch.long)
        attention[b, P - len(p) : P + len(c)] = 1
        comp_mask[b, : len(c)] = row_mask[i]
        sampler[b, : len(c)] = torch.tensor(batch.sampler_logprobs[i], dtype=torch.float32)
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    return {
        "input_ids": input_ids,
        "attention_mask": attention,
        "position_ids": position_ids,
        "completion_ids": input_ids[:, P:],
        "mask": comp_mask,
        "sampler_logp": sampler,
    }
