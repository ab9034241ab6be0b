"""The vocabulary-parallel embedding lookup (each rank holds a slice of the rows)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def vocab_parallel_embedding(
    ids: torch.Tensor,
    rows: torch.Tensor,
    start: int,
    reduce: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Embeddings of `ids` from this rank's rows [start, start + len(rows)): zeros for ids
    another rank holds, then summed across ranks. Exactly one rank adds a non-zero row
    per token, so the sum is that row bit for bit."""
    local = ids - start
    inside = (local >= 0) & (local < rows.shape[0])
    hidden = F.embedding(local.clamp(0, rows.shape[0] - 1), rows)
    return reduce(hidden.masked_fill(~inside.unsqueeze(1), 0.0))
