"""One step's adapters: which rows of the flat batch run under which adapter.

The base matmul runs once for every row; then the step's low-rank products are added to
theirs. Where the model has a LoRA kernel (C on CPU, Triton on GPU: `kernels.lora_layout`)
that is one call per projection for every row and adapter (Punica's BGMV: each row carries
its adapter's slot); the one-call C decode program runs the same C kernel inside it. The
PyTorch path here is the fallback and the reference: per adapter in the step, its rows are
multiplied by its A and B (the grouped form of Punica's and S-LoRA's segmented gather: a
run of consecutive rows is sliced, which is the common case, since a prompt chunk is one
run and the runner puts each adapter's decode rows side by side; other rows are gathered
and scattered back).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from servefleet.engine.kernels.lora_layout import LoraKernel, LoraStep
from servefleet.engine.lora.adapter import LoraAdapter, LoraProjection
from servefleet.engine.model.weights import PROJECTIONS

PROJECTION_INDEX = {name: index for index, name in enumerate(PROJECTIONS)}


@dataclass(frozen=True)
class LoraGroup:
    """The rows of one adapter: a slice when they are consecutive, else an index tensor."""

    adapter: LoraAdapter
    rows: slice | torch.Tensor


@dataclass(frozen=True, eq=False)
class LoraBatch:
    """`groups[i]` is slot i of the kernels' table; `spans` are (slot, first row, rows).
    `ran` collects which paths added deltas this step (a kernel's name, "program" for the
    one-call decode program, "torch"): tests read it to know what they exercised."""

    groups: tuple[LoraGroup, ...]
    spans: tuple[tuple[int, int, int], ...] = ()
    device: torch.device | str = "cpu"
    ran: set[str] = field(default_factory=set)
    _steps: dict[int, LoraStep | None] = field(default_factory=dict, repr=False)

    @staticmethod
    def for_spans(
        spans: Sequence[tuple[LoraAdapter, int, int]], device: torch.device | str
    ) -> LoraBatch:
        """Group a step's (adapter, first row, rows) spans by adapter; the rows without an
        adapter run on the base model alone."""
        by_adapter: dict[int, tuple[int, LoraAdapter, list[tuple[int, int]]]] = {}
        for adapter, first, rows in spans:
            slot = by_adapter.setdefault(id(adapter), (len(by_adapter), adapter, []))
            runs = slot[2]
            if runs and runs[-1][1] == first:  # adjacent to the previous span: one run
                runs[-1] = (runs[-1][0], first + rows)
            else:
                runs.append((first, first + rows))
        groups = []
        for _, adapter, runs in by_adapter.values():
            if len(runs) == 1:
                groups.append(LoraGroup(adapter, slice(*runs[0])))
            else:
                index = torch.cat([torch.arange(a, b) for a, b in runs]).to(device)
                groups.append(LoraGroup(adapter, index))
        slots = tuple((slot, a, b - a) for slot, _, runs in by_adapter.values() for a, b in runs)
        return LoraBatch(tuple(groups), slots, device)

    @property
    def adapters(self) -> list[LoraAdapter]:
        return [group.adapter for group in self.groups]

    def kernel_step(self, rows: int) -> LoraStep | None:
        """The step as the LoRA kernels read it, for a batch of `rows` rows (built once);
        None when its adapters hold weights of different dtypes or devices."""
        if rows not in self._steps:
            self._steps[rows] = self._build_step(rows)
        return self._steps[rows]

    def _build_step(self, rows: int) -> LoraStep | None:
        adapters = self.adapters
        tables = [adapter.kernel_table for adapter in adapters]
        dtypes = {adapter.weight_dtype for adapter in adapters}
        if len(dtypes) != 1 or len({t.device for t in tables}) != 1:
            return None
        row_slots = [-1] * rows
        for slot, first, count in self.spans:
            row_slots[first : first + count] = [slot] * count
        return LoraStep(
            row_slots=torch.tensor(row_slots, dtype=torch.int32, device=self.device),
            table=torch.stack(tables).contiguous(),
            weight_dtype=dtypes.pop(),
            max_rank=max(adapter.config.r for adapter in adapters),
        )

    def add(
        self,
        layer: int,
        projection: str,
        x: torch.Tensor,
        out: torch.Tensor,
        kernel: LoraKernel | None = None,
    ) -> None:
        """out[rows] += x[rows] @ A @ B for every adapter of the step that adapts this
        projection of this layer (in place: `out` is the base matmul's result): through
        `kernel` when it takes these tensors, else in PyTorch."""
        if kernel is not None:
            step = self.kernel_step(x.shape[0])
            index = PROJECTION_INDEX[projection]
            if step is not None and kernel.add(x, out, step, layer, index):
                self.ran.add(kernel.name)
                return
        self.ran.add("torch")
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
    in place: one small matmul for A, one `addmm_` per part, in out's dtype (weights held
    narrower, e.g. bfloat16 under a float32 model, are widened exactly)."""
    dtype = out.dtype
    low = _as(x, dtype) @ _as(lora.a, dtype)
    if len(lora.parts) == 1 and lora.parts[0].columns == slice(0, out.shape[1]):
        out.addmm_(low, _as(lora.parts[0].b, dtype))
        return
    for part in lora.parts:
        out[:, part.columns].addmm_(low[:, part.ranks], _as(part.b, dtype))


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)
