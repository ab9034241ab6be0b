"""One step's adapters: which rows of the flat batch run under which adapter.

The base matmul runs once for every row; then, per adapter in the step, its rows' low-rank
product is added to theirs (the grouped form of Punica's and S-LoRA's segmented gather:
rows of one adapter are gathered, multiplied by its A and B, and scattered back). A run of
consecutive rows is sliced rather than gathered, which is the common case: a prompt chunk is
one run, and the runner puts each adapter's decode rows side by side.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from servefleet.engine.lora.adapter import LoraAdapter, LoraProjection


@dataclass(frozen=True)
class LoraGroup:
    """The rows of one adapter: a slice when they are consecutive, else an index tensor."""

    adapter: LoraAdapter
    rows: slice | torch.Tensor


@dataclass(frozen=True)
class LoraBatch:
    groups: tuple[LoraGroup, ...]

    @staticmethod
    def for_spans(
        spans: Sequence[tuple[LoraAdapter, int, int]], device: torch.device | str
    ) -> LoraBatch:
        """Group a step's (adapter, first row, rows) spans by adapter; the rows without an
        adapter run on the base model alone."""
        by_adapter: dict[int, tuple[LoraAdapter, list[tuple[int, int]]]] = {}
        for adapter, first, rows in spans:
            runs = by_adapter.setdefault(id(adapter), (adapter, []))[1]
            if runs and runs[-1][1] == first:  # adjacent to the previous span: one run
                runs[-1] = (runs[-1][0], first + rows)
            else:
                runs.append((first, first + rows))
        groups = []
        for adapter, runs in by_adapter.values():
            if len(runs) == 1:
                groups.append(LoraGroup(adapter, slice(*runs[0])))
            else:
                index = torch.cat([torch.arange(a, b) for a, b in runs]).to(device)
                groups.append(LoraGroup(adapter, index))
        return LoraBatch(tuple(groups))

    @property
    def adapters(self) -> list[LoraAdapter]:
        return [group.adapter for group in self.groups]

    def add(self, layer: int, projection: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """out[rows] += x[rows] @ A @ B for every adapter of the step that adapts this
        projection of this layer (in place: `out` is the base matmul's result)."""
        for group in self.groups:
            lora = group.adapter.layers[layer].get(projection)
            if lora is None:
                continue
            if isinstance(group.rows, slice):
                _add_rows(lora, x[group.rows], out[group.rows])
            else:
                rows = group.rows
                delta = out.new_zeros((rows.shape[0], out.shape[1]))
                _add_rows(lora, x.index_select(0, rows), delta)
                out.index_add_(0, rows, delta)


def _add_rows(lora: LoraProjection, x: torch.Tensor, out: torch.Tensor) -> None:
    """out += x @ A @ B, part by part (each part writes only its own columns), accumulated
    in place: one small matmul for A, one `addmm_` per part."""
    low = x @ lora.a if x.dtype == lora.a.dtype else x.to(lora.a.dtype) @ lora.a
    if len(lora.parts) == 1 and lora.parts[0].columns == slice(0, out.shape[1]):
        out.addmm_(low.to(out.dtype), lora.parts[0].b.to(out.dtype))
        return
    for part in lora.parts:
        out[:, part.columns].addmm_(low[:, part.ranks].to(out.dtype), part.b.to(out.dtype))
