"""Quantized checkpoint weights in the layout `sf_packed_mm` reads (see sf_packed_mm.h).

A GGUF file stores a model's projections as 4-6 bits a weight (Q4_K_M: Q4_K with some
Q6_K; SmolLM2: Q4_1) instead of float32's 32. Decode steps stream every weight once, so
keeping that form (and dequantizing a few KiB at a time in registers) cuts what a step
reads from memory 3.5-5×, and a model holds its packed bytes instead of float32 ones.
Dequantizing is exact (scale × q is exact in float32 for every format here), so the
packed matmul returns bitwise what the float32 matmul returns on the dequantized
weights: packing is a memory and speed choice that never changes a token.

`BlockQuantized` is an [out, in] weight as integers and per-block scales (what the GGUF
parsers in `model/gguf_blocks.py` produce); `pack` lays parts of it out for the kernel
as W [in, out] column groups, each group in its own format; `unpack` is the exact
float32 weight again, computed with numpy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import torch

BLOCK_K = 32  # weights per packed block along the input dimension
GROUP_COLUMNS = 16  # output columns per packed group
Q6_OFFSET = 32  # Q6 stores q + 32 (0..63); w = scale × (stored - 32)


class PackedFormat(IntEnum):
    """A packed block's format; the values are `sf_packed_mm.h`'s SF_FMT_* codes."""

    Q4 = 0  # w = scale × q + min, q 0..15, scale/min per 32 k (Q4_0, Q4_1, Q4_K)
    Q8 = 1  # w = scale × q, q int8, scale per 32 k (Q8_0)
    Q5 = 2  # w = scale × q + min, q 0..31, scale/min per 32 k (Q5_0, Q5_1, Q5_K)
    Q6 = 3  # w = scale × (q - 32), q 0..63, scale per 16 k (Q6_K)


_SCALES = GROUP_COLUMNS * 4  # bytes of one float32 per column
_NIBBLES = BLOCK_K // 2 * GROUP_COLUMNS
# Bytes of one packed block (32 k × 16 columns), by format (checked against the C code).
PACKED_BLOCK_BYTES = {
    PackedFormat.Q4: 2 * _SCALES + _NIBBLES,
    PackedFormat.Q8: _SCALES + BLOCK_K * GROUP_COLUMNS,
    PackedFormat.Q5: 3 * _SCALES + _NIBBLES,
    PackedFormat.Q6: 4 * _SCALES + _NIBBLES,
}
# Weights along the input that share one scale.
SCALE_SPAN = {PackedFormat.Q4: 32, PackedFormat.Q8: 32, PackedFormat.Q5: 32, PackedFormat.Q6: 16}
_WITH_MINIMUM = frozenset({PackedFormat.Q4, PackedFormat.Q5})


class PackingError(ValueError):
    """Weights that the packed layout cannot hold."""


@dataclass(frozen=True)
class BlockQuantized:
    """An [out, in] weight as integers with per-block scales (see `PackedFormat`).

    q: int8 [out, in] for Q8, uint8 otherwise; scale: float32 [out, in / SCALE_SPAN];
    minimum: float32 [out, in / 32] for Q4 and Q5, else None.
    """

    format: PackedFormat
    q: np.ndarray
    scale: np.ndarray
    minimum: np.ndarray | None

    @property
    def shape(self) -> tuple[int, int]:
        rows, cols = self.q.shape
        return int(rows), int(cols)

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in], computed as the GGUF reference does (exact products)."""
        q = self.q.astype(np.float32)
        if self.format == PackedFormat.Q6:
            q = q - np.float32(Q6_OFFSET)  # small integers: exact
        values = q * np.repeat(self.scale, SCALE_SPAN[self.format], axis=1)
        if self.minimum is not None:
            values = values + np.repeat(self.minimum, BLOCK_K, axis=1)
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))

    def permute_rows(self, order: np.ndarray) -> BlockQuantized:
        """The same weight with its output rows reordered (blocks run along the input)."""
        minimum = None if self.minimum is None else self.minimum[order]
        return BlockQuantized(self.format, self.q[order], self.scale[order], minimum)


def concat_rows(parts: Sequence[BlockQuantized]) -> BlockQuantized | None:
    """Parts of one format stacked as one weight; None when formats or input sizes differ."""
    first = parts[0]
    if any(p.format != first.format or p.shape[1] != first.shape[1] for p in parts):
        return None
    minimums = [p.minimum for p in parts if p.minimum is not None]
    return BlockQuantized(
        first.format,
        np.concatenate([p.q for p in parts]),
        np.concatenate([p.scale for p in parts]),
        np.concatenate(minimums) if minimums else None,
    )


@dataclass(frozen=True)
class PackedWeight:
    """W [k, n] (the transpose of an [out=n, in=k] weight) in `sf_packed_mm`'s layout:
    group g (16 columns) is `formats[g]` blocks [k/32][block bytes] at `offsets[g]`."""

    k: int
    n: int
    data: torch.Tensor  # uint8, flat
    formats: torch.Tensor  # uint8 [ceil(n / 16)]
    offsets: torch.Tensor  # int64 [ceil(n / 16)]

    @property
    def nbytes(self) -> int:
        return self.data.numel() + self.formats.numel() + 8 * self.offsets.numel()

    @property
    def format_names(self) -> frozenset[str]:
        return frozenset(PackedFormat(int(f)).name for f in self.formats.unique().tolist())


def packed_from_tensors(k: int, n: int, data: torch.Tensor, formats: torch.Tensor) -> PackedWeight:
    """A PackedWeight from its stored bytes and group formats, checking they fit the shape."""
    groups = -(-n // GROUP_COLUMNS)
    valid = {int(f) for f in PackedFormat}
    if (
        data.dtype != torch.uint8
        or data.dim() != 1
        or formats.dtype != torch.uint8
        or tuple(formats.shape) != (groups,)
        or k % BLOCK_K
        or not set(formats.tolist()) <= valid
    ):
        raise PackingError(
            f"packed weight [{k}, {n}] needs uint8 data and {groups} known group formats, "
            f"got {data.dtype} {tuple(data.shape)} and {formats.dtype} {tuple(formats.shape)}"
        )
    sizes = torch.tensor([PACKED_BLOCK_BYTES[PackedFormat(int(f))] for f in formats.tolist()])
    group_bytes = sizes.to(torch.int64) * (k // BLOCK_K)
    offsets = torch.cumsum(group_bytes, 0) - group_bytes
    if int(group_bytes.sum()) != data.numel():
        raise PackingError(
            f"packed weight [{k}, {n}] needs {int(group_bytes.sum())} bytes, got {data.numel()}"
        )
    return PackedWeight(k, n, data, formats.contiguous(), offsets.contiguous())


def pack(parts: BlockQuantized | Sequence[BlockQuantized]) -> PackedWeight:
    """Lay an [out, in] weight (or row-stacked parts of one) out as W [in, out] groups.

    Consecutive parts of one format share groups; a part followed by another format must
    end on a group boundary (16 rows), since one group has one format.
    """
    parts = [parts] if isinstance(parts, BlockQuantized) else list(parts)
    runs: list[BlockQuantized] = []
    for part in parts:
        merged = concat_rows([runs[-1], part]) if runs else None
        if merged is not None:
            runs[-1] = merged
        else:
            runs.append(part)
    if any(p.shape[1] != runs[0].shape[1] for p in runs):
        raise PackingError("fused parts disagree on the input size")
    if any(run.shape[0] % GROUP_COLUMNS for run in runs[:-1]):
        raise PackingError(f"formats change inside a group of {GROUP_COLUMNS} output rows")
    k = runs[0].shape[1]
    if k % BLOCK_K:
        raise PackingError(f"input size {k} is not a multiple of {BLOCK_K}")
    blocks = [_pack_groups(run) for run in runs]
    formats = np.concatenate(
        [
            np.full(b.shape[0], run.format, dtype=np.uint8)
            for b, run in zip(blocks, runs, strict=True)
        ]
    )
    data = np.concatenate([b.reshape(-1) for b in blocks])
    n = sum(run.shape[0] for run in runs)
    return packed_from_tensors(k, n, torch.from_numpy(data), torch.from_numpy(formats))


def _pack_groups(weight: BlockQuantized) -> np.ndarray:
    """uint8 [groups, k/32, block bytes] for one weight of one format."""
    n, k = weight.shape
    groups = -(-n // GROUP_COLUMNS)
    padded = groups * GROUP_COLUMNS
    blocks_k = k // BLOCK_K

    def padded_rows(a: np.ndarray) -> np.ndarray:
        out = np.zeros((padded, *a.shape[1:]), dtype=a.dtype)
        out[:n] = a
        return out

    def per_group(a: np.ndarray) -> np.ndarray:  # [padded, k/32] -> [G, k/32, 16] bytes
        grouped = padded_rows(a).T.reshape(blocks_k, groups, GROUP_COLUMNS).transpose(1, 0, 2)
        return np.ascontiguousarray(grouped).view(np.uint8)

    def by_k(a: np.ndarray, *inner: int) -> np.ndarray:  # [k, padded] -> [k/32, *inner, G, 16]
        return a.reshape(blocks_k, *inner, groups, GROUP_COLUMNS)

    fmt = weight.format
    q = padded_rows(weight.q).T  # [k, padded]
    if fmt == PackedFormat.Q8:
        values = by_k(q.astype(np.int8), BLOCK_K).transpose(2, 0, 1, 3)
        parts = [per_group(weight.scale), np.ascontiguousarray(values).view(np.uint8)]
    else:
        if (weight.minimum is None) == (fmt in _WITH_MINIMUM):
            raise PackingError(
                f"{fmt.name} weights {'need' if fmt in _WITH_MINIMUM else 'take no'} minimum"
            )
        q = q.astype(np.uint32)
        if fmt == PackedFormat.Q6:
            parts = [per_group(weight.scale[:, 0::2]), per_group(weight.scale[:, 1::2])]
        else:
            assert weight.minimum is not None
            parts = [per_group(weight.scale), per_group(weight.minimum)]
        pairs = by_k(q & 15, BLOCK_K // 2, 2)
        nibbles = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).astype(np.uint8)  # [k/32, 16, G, 16]
        parts.append(np.ascontiguousarray(nibbles.transpose(2, 0, 1, 3)))
        if fmt == PackedFormat.Q5:  # bit k of a column's word: bit 4 of its q at k
            bits = by_k(q >> 4, BLOCK_K) << np.arange(BLOCK_K, dtype=np.uint32)[:, None, None]
            parts.append(_words(bits.sum(axis=1, dtype=np.uint32)[:, None]))
        elif fmt == PackedFormat.Q6:  # word h: bits 2(k - 16h).. = bits 4-5 of q at k
            shifts = 2 * np.arange(BLOCK_K // 2, dtype=np.uint32)[:, None, None]
            bits = by_k(q >> 4, 2, BLOCK_K // 2) << shifts
            parts.append(_words(bits.sum(axis=2, dtype=np.uint32)))
    data = np.concatenate([p.reshape(groups, blocks_k, -1) for p in parts], axis=-1)
    if data.shape[-1] != PACKED_BLOCK_BYTES[fmt]:
        raise AssertionError(f"packed {fmt.name} block of {data.shape[-1]} bytes")
    return data


def _words(words: np.ndarray) -> np.ndarray:
    """uint32 [k/32, W, G, 16] -> bytes [G, k/32, W * 64]."""
    return np.ascontiguousarray(words.astype(np.uint32).transpose(2, 0, 1, 3)).view(np.uint8)


def unpack(weight: PackedWeight) -> torch.Tensor:
    """The float32 W [k, n] a packed weight holds (bitwise what the checkpoint's
    dequantization gives, and what the C `sf_packed_unpack` computes)."""
    blocks_k = weight.k // BLOCK_K
    out = np.empty((weight.k, weight.formats.numel() * GROUP_COLUMNS), dtype=np.float32)
    data, formats = weight.data.numpy(), weight.formats.numpy()
    start = 0
    while start < formats.size:  # runs of groups in one format decode together
        end = start + 1
        while end < formats.size and formats[end] == formats[start]:
            end += 1
        fmt = PackedFormat(int(formats[start]))
        size = (end - start) * blocks_k * PACKED_BLOCK_BYTES[fmt]
        offset = int(weight.offsets[start])
        raw = data[offset : offset + size].reshape(end - start, blocks_k, -1)
        values = _decode_blocks(fmt, raw)  # [groups, k/32, 32, 16]
        cols = slice(start * GROUP_COLUMNS, end * GROUP_COLUMNS)
        out[:, cols] = values.transpose(1, 2, 0, 3).reshape(weight.k, -1)
        start = end
    return torch.from_numpy(np.ascontiguousarray(out[:, : weight.n]))


def _decode_blocks(fmt: PackedFormat, raw: np.ndarray) -> np.ndarray:
    """uint8 [..., block bytes] -> float32 [..., 32, 16], as sf_dequant_block computes it."""

    def floats(lo: int, hi: int) -> np.ndarray:
        return np.ascontiguousarray(raw[..., lo:hi]).view(np.float32)[..., None, :]

    scale = floats(0, _SCALES)
    if fmt == PackedFormat.Q8:
        q8 = np.ascontiguousarray(raw[..., _SCALES:]).view(np.int8)
        return scale * q8.reshape(*raw.shape[:-1], BLOCK_K, GROUP_COLUMNS).astype(np.float32)
    second = floats(_SCALES, 2 * _SCALES)
    nib = raw[..., 2 * _SCALES : 2 * _SCALES + _NIBBLES].reshape(*raw.shape[:-1], 16, 1, 16)
    q = np.concatenate([nib & 15, nib >> 4], axis=-2).reshape(*raw.shape[:-1], BLOCK_K, 16)
    q = q.astype(np.uint32)
    high = np.ascontiguousarray(raw[..., 2 * _SCALES + _NIBBLES :]).view(np.uint32)
    if fmt == PackedFormat.Q5:
        q |= ((high[..., None, :] >> np.arange(BLOCK_K, dtype=np.uint32)[:, None]) & 1) << 4
    if fmt == PackedFormat.Q6:
        words = high.reshape(*raw.shape[:-1], 2, 1, 16)
        shifts = 2 * np.arange(BLOCK_K // 2, dtype=np.uint32)[:, None]
        q |= ((words >> shifts) & 3).reshape(*raw.shape[:-1], BLOCK_K, 16) << 4
        halves = np.concatenate([np.repeat(scale, 16, -2), np.repeat(second, 16, -2)], axis=-2)
        return halves * (q.astype(np.float32) - np.float32(Q6_OFFSET))
    return scale * q.astype(np.float32) + second
