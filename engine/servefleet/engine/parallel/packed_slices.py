"""Slices of packed (block-quantized) weights, kept packed where the blocks allow it.

A packed W [k, n] is groups of 16 output columns, each group k/32 blocks along the input
(`kernels.packed_weights`). Output columns (column-parallel q/k/v, gate/up, lm_head)
split at a multiple of 16 and input rows (row-parallel o, down) at a multiple of 32 take
whole groups or whole blocks: the bytes are copied as they are, and the slice multiplies
bitwise as the same columns of the whole weight. A cut inside a group or a block returns
None; the caller then dequantizes that shard to float32 at load (exact: unpacking is).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from servefleet.engine.kernels.packed_weights import (
    BLOCK_K,
    GROUP_COLUMNS,
    PACKED_BLOCK_BYTES,
    PackedFormat,
    PackedWeight,
    packed_from_tensors,
)


def _group_bytes(weight: PackedWeight, group: int) -> int:
    return PACKED_BLOCK_BYTES[PackedFormat(int(weight.formats[group]))] * (weight.k // BLOCK_K)


def packed_columns(weight: PackedWeight, spans: Sequence[tuple[int, int]]) -> PackedWeight | None:
    """The columns [start, end) of each span, side by side; None unless every span starts
    on a group boundary and ends on one (or at n, the last group's padding included)."""
    groups: list[int] = []
    width = 0
    for index, (start, end) in enumerate(spans):
        at_end = index == len(spans) - 1 and end == weight.n  # the padded last group
        if start % GROUP_COLUMNS or (end % GROUP_COLUMNS and not at_end):
            return None
        groups.extend(range(start // GROUP_COLUMNS, -(-end // GROUP_COLUMNS)))
        width += end - start
    data = torch.cat(
        [
            weight.data[int(weight.offsets[g]) : int(weight.offsets[g]) + _group_bytes(weight, g)]
            for g in groups
        ]
    )
    return packed_from_tensors(weight.k, width, data, weight.formats[groups].clone())


def packed_rows(weight: PackedWeight, start: int, end: int) -> PackedWeight | None:
    """Input rows [start, end) of W (a row-parallel shard); None unless both fall on a
    block boundary (32)."""
    if start % BLOCK_K or end % BLOCK_K:
        return None
    first, last = start // BLOCK_K, end // BLOCK_K
    parts = []
    for g in range(weight.formats.numel()):
        block = PACKED_BLOCK_BYTES[PackedFormat(int(weight.formats[g]))]
        offset = int(weight.offsets[g])
        parts.append(weight.data[offset + first * block : offset + last * block])
    return packed_from_tensors(end - start, weight.n, torch.cat(parts), weight.formats.clone())
