"""One RL step's scored rollouts as the trainer reads them, and their collation into minibatches.

``load_rollout_batch`` reads ``scored.parquet`` into a ``RolloutBatch`` (Python lists, one entry per
sample), checking that every row has a prompt and one logprob per completion token and that the
rollouts were sampled at the temperature training uses. ``collate`` pads a minibatch: prompts on the
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
    return RolloutBatch(
        prompt_ids=cols["prompt_ids"],
        completion_ids=cols["completion_ids"],
        sampler_logprobs=cols["logprobs"],
        truncated=[r == "length" for r in cols["finish_reason"]],
        rewards=[float(r) for r in cols["reward"]],
        group_ids=cols["group_id"],
        source=str(path),
    )


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
