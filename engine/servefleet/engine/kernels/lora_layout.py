"""What the LoRA kernels read: an adapter's table of addresses, and one step's rows.

A kernel adds the low-rank deltas of every adapter in a step in one call per projection
(Punica's BGMV): each row carries the slot of its adapter in the step (-1: the base model
alone), and the step's table holds, per slot, layer and projection, `FIELDS` int64: where
its A [in, R] lives (the adapted parts' ranks side by side), `in` and R, then per part (at most
`MAX_PARTS`: q/k/v of the fused qkv, gate/up) its rank columns, its output columns and
where its B [r, width] lives (scaling folded in). Addresses rather than copies into
preallocated per-slot buffers: loading an adapter copies nothing, and a step costs one
small stack of its adapters' tables. The adapter object keeps the tensors alive.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

FIELDS = 19  # = SF_LORA_FIELDS in sf_lora.h: a, in, R, parts, 3 × (j0, r, c0, width, b)
MAX_PARTS = 3
# The weight dtypes the C kernel reads (its wdtype codes); Triton reads any float dtype.
C_WEIGHT_CODES: dict[torch.dtype, int] = {torch.float32: 0, torch.bfloat16: 1}


@dataclass(frozen=True)
class PartEntry:
    """One adapted part of a fused projection: its ranks [rank0, rank0 + rank) of A's
    columns, the output columns [column, column + width) it writes, and its B [rank, width]."""

    rank0: int
    rank: int
    column: int
    width: int
    b: torch.Tensor


def projection_entry(a: torch.Tensor | None, parts: Sequence[PartEntry]) -> list[int]:
    """The FIELDS ints of one (layer, projection): zeros where the adapter leaves it alone."""
    if a is None or not parts:
        return [0] * FIELDS
    if len(parts) > MAX_PARTS:
        raise ValueError(f"a fused projection has at most {MAX_PARTS} parts")
    _check_weight(a, (a.shape[0], sum(p.rank for p in parts)), "A")
    fields = [a.data_ptr(), a.shape[0], a.shape[1], len(parts)]
    for part in parts:
        _check_weight(part.b, (part.rank, part.width), "B")
        if part.b.dtype != a.dtype or part.b.device != a.device:
            raise ValueError("an adapter's A and B must share one dtype and device")
        fields += [part.rank0, part.rank, part.column, part.width, part.b.data_ptr()]
    return fields + [0] * (FIELDS - len(fields))


def _check_weight(t: torch.Tensor, shape: tuple[int, int], what: str) -> None:
    if t.dim() != 2 or tuple(t.shape) != shape or not t.is_contiguous():
        raise ValueError(f"LoRA {what} must be contiguous {list(shape)}, got {list(t.shape)}")


@dataclass(frozen=True)
class LoraStep:
    """One step's rows for the kernels: `row_slots` int32 [rows] (-1: no adapter) and
    `table` int64 [slots, layers, projections, FIELDS] on the step's device; `max_rank`
    is the largest part rank of any slot (host-side, so no kernel launch waits on it)."""

    row_slots: torch.Tensor
    table: torch.Tensor
    weight_dtype: torch.dtype
    max_rank: int


class LoraKernel(Protocol):
    """`add` adds the step's deltas to `out` (the base matmul's result) in place and returns
    True, or returns False without touching anything when it cannot take these tensors
    (the caller then runs the PyTorch path)."""

    @property
    def name(self) -> str: ...

    def add(
        self, x: torch.Tensor, out: torch.Tensor, step: LoraStep, layer: int, projection: int
    ) -> bool: ...
