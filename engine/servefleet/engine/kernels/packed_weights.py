"""Quantized checkpoint weights in the layout `sf_packed_mm` reads (see cpu_small_gemm.c).

A GGUF file stores SmolLM2's projections as Q4_1: 5 bits a weight instead of float32's
32. Decode steps stream every weight once, so keeping that form for them (and
dequantizing a few KiB at a time in registers) cuts what a step reads from memory ~6×.
Dequantizing is exact (scale × q needs ≤ 19 significant bits), so the packed matmul
returns bitwise what the float32 matmul returns on the dequantized weights: packing is a
speed choice that never changes a token.

This module knows the GGUF block formats it accepts (Q4_0, Q4_1, Q8_0) and turns
their blocks, per [out, in] tensor, into `BlockQuantized` rows; `pack` lays them out
for the kernel as W [in, out] column groups.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

BLOCK_K = 32  # weights per quantization block along the input dimension
GROUP_COLUMNS = 16  # output columns per packed group
# Bytes of one packed block (32 k × 16 columns), by bits per weight.
PACKED_BLOCK_BYTES = {
    4: 2 * GROUP_COLUMNS * 4 + BLOCK_K // 2 * GROUP_COLUMNS,
    8: GROUP_COLUMNS * 4 + BLOCK_K * GROUP_COLUMNS,
}
# GGUF type name -> (bits, bytes of one 32-weight block in the file).
GGUF_BLOCK_FORMATS = {"Q4_0": (4, 18), "Q4_1": (4, 20), "Q8_0": (8, 34)}


class PackingError(ValueError):
    """Weights that the packed layout cannot hold."""


@dataclass(frozen=True)
class BlockQuantized:
    """An [out, in] weight as integers with per-block scales: w = scale × q (+ minimum).

    q: uint8 (4-bit, 0..15) or int8 (8-bit) [out, in]; scale, minimum: float32
    [out, in / 32]; minimum is None for formats without one.
    """

    bits: int
    q: np.ndarray
    scale: np.ndarray
    minimum: np.ndarray | None

    @property
    def shape(self) -> tuple[int, int]:
        rows, cols = self.q.shape
        return int(rows), int(cols)

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in], computed as the GGUF reference does (exact products)."""
        scale = np.repeat(self.scale, BLOCK_K, axis=1)
        values = self.q.astype(np.float32) * scale
        if self.minimum is not None:
            values = values + np.repeat(self.minimum, BLOCK_K, axis=1)
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))

    def permute_rows(self, order: np.ndarray) -> BlockQuantized:
        """The same weight with its output rows reordered (blocks run along the input)."""
        minimum = None if self.minimum is None else self.minimum[order]
        return BlockQuantized(self.bits, self.q[order], self.scale[order], minimum)


def concat_rows(parts: Sequence[BlockQuantized]) -> BlockQuantized | None:
    """Fused projections (q/k/v, gate/up) as one weight; None when their formats differ."""
    first = parts[0]
    if any(p.bits != first.bits or (p.minimum is None) != (first.minimum is None) for p in parts):
        return None
    if any(p.shape[1] != first.shape[1] for p in parts):
        return None
    minimums = [p.minimum for p in parts if p.minimum is not None]
    minimum = np.concatenate(minimums) if minimums else None
    return BlockQuantized(
        first.bits,
        np.concatenate([p.q for p in parts]),
        np.concatenate([p.scale for p in parts]),
        minimum,
    )


def from_gguf_blocks(type_name: str, raw: np.ndarray, rows: int, cols: int) -> BlockQuantized:
    """A GGUF tensor's raw blocks ([out, in] in the file's row order) as BlockQuantized."""
    if type_name not in GGUF_BLOCK_FORMATS:
        raise PackingError(f"GGUF type {type_name} has no packed form")
    _, block_bytes = GGUF_BLOCK_FORMATS[type_name]
    if cols % BLOCK_K:
        raise PackingError(f"input size {cols} is not a multiple of {BLOCK_K}")
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, cols // BLOCK_K, block_bytes)
    scale = _f16(blocks[..., 0:2])
    if type_name == "Q8_0":
        q = blocks[..., 2:].view(np.int8).reshape(rows, cols)
        return BlockQuantized(8, q, scale, None)
    if type_name == "Q4_1":
        minimum, nibbles = _f16(blocks[..., 2:4]), blocks[..., 4:]
    else:  # Q4_0: q - 8, i.e. min = -8 × scale (exact)
        minimum, nibbles = scale * np.float32(-8.0), blocks[..., 2:]
    # Element j of a block is byte j's low nibble, element j + 16 its high nibble.
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(rows, cols)
    return BlockQuantized(4, q, scale, minimum)


def _f16(pairs: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(pairs).view(np.float16)[..., 0].astype(np.float32)


@dataclass(frozen=True)
class PackedWeight:
    """W [k, n] (the transpose of an [out=n, in=k] weight) in `sf_packed_mm`'s layout:
    uint8 [ceil(n/16), k/32, block bytes]."""

    bits: int
    k: int
    n: int
    data: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def pack(weight: BlockQuantized) -> PackedWeight:
    """Lay an [out, in] weight out as W [in, out] groups of 16 columns (padding with 0)."""
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
        return np.ascontiguousarray(grouped, dtype=np.float32).view(np.uint8)

    q = padded_rows(weight.q).T  # [k, padded]
    parts = [per_group(weight.scale)]
    if weight.bits == 4:
        if weight.minimum is None:
            raise PackingError("4-bit weights need a minimum per block")
        parts.append(per_group(weight.minimum))
        pairs = q.astype(np.uint8).reshape(blocks_k, BLOCK_K // 2, 2, groups, GROUP_COLUMNS)
        nibbles = pairs[:, :, 0] | (pairs[:, :, 1] << 4)  # [k/32, 16, G, 16]
        parts.append(np.ascontiguousarray(nibbles.transpose(2, 0, 1, 3)))
    elif weight.bits == 8:
        values = q.astype(np.int8).reshape(blocks_k, BLOCK_K, groups, GROUP_COLUMNS)
        parts.append(np.ascontiguousarray(values.transpose(2, 0, 1, 3)).view(np.uint8))
    else:
        raise PackingError(f"no packed layout for {weight.bits}-bit weights")
    data = np.concatenate([p.reshape(groups, blocks_k, -1) for p in parts], axis=-1)
    if data.shape[-1] != PACKED_BLOCK_BYTES[weight.bits]:
        raise AssertionError(f"packed block of {data.shape[-1]} bytes")
    return PackedWeight(weight.bits, k, n, torch.from_numpy(np.ascontiguousarray(data)))


def packed_from_tensor(bits: int, k: int, n: int, data: torch.Tensor) -> PackedWeight:
    """Rebuild a PackedWeight from its stored bytes, checking they fit the shape."""
    expected = (-(-n // GROUP_COLUMNS), k // BLOCK_K, PACKED_BLOCK_BYTES.get(bits, -1))
    if data.dtype != torch.uint8 or tuple(data.shape) != expected or k % BLOCK_K:
        raise PackingError(
            f"packed {bits}-bit weight [{k}, {n}] needs uint8 {expected}, "
            f"got {data.dtype} {tuple(data.shape)}"
        )
    return PackedWeight(bits, k, n, data)
