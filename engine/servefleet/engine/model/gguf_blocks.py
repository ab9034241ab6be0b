"""GGUF quantized blocks -> `BlockQuantized` (integers and exact float32 scales).

Each parser reads a tensor's raw blocks the way `gguf.quants` dequantizes them, but stops
before multiplying: q stays an integer and the scales are the reference's own float32
products (d × sub-block scale, dmin × sub-block min), so the packed kernels reproduce the
reference bit for bit. K-quants' 256-weight super-blocks become 32-weight blocks (16 for
Q6_K) with their own scales; the super-block's shared d is already folded in.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import Q4_K

from servefleet.engine.kernels.packed_weights import BlockQuantized, PackedFormat, PackingError

# (format, q [n, block], scale [n, block / span], minimum [n, block / 32] or None)
_Parsed = tuple[PackedFormat, np.ndarray, np.ndarray, np.ndarray | None]


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte `start` of every block, as float32 [n, 1]."""
    return np.ascontiguousarray(blocks[:, start : start + 2]).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Bytes [n, 16·c] -> [n, 32·c]: each 16 bytes give 16 low nibbles, then 16 high ones."""
    n = qs.shape[0]
    split = qs.reshape(n, -1, 1, 16) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (split & 15).reshape(n, -1)


def _q8_0(b: np.ndarray) -> _Parsed:
    return PackedFormat.Q8, b[:, 2:].copy().view(np.int8), _f16(b, 0), None


def _q4_0(b: np.ndarray) -> _Parsed:
    d = _f16(b, 0)  # q - 8 with scale d: min = -8d (exact)
    return PackedFormat.Q4, _nibbles(b[:, 2:]), d, d * np.float32(-8.0)


def _q4_1(b: np.ndarray) -> _Parsed:
    return PackedFormat.Q4, _nibbles(b[:, 4:]), _f16(b, 0), _f16(b, 2)


def _high_bits_32(qh: np.ndarray) -> np.ndarray:
    """uint32 [n, 1] -> bit j of each as bit 4 of element j [n, 32]."""
    bits = (qh >> np.arange(32, dtype=np.uint32)) & 1
    return (bits << 4).astype(np.uint8)


def _q5_0(b: np.ndarray) -> _Parsed:
    d = _f16(b, 0)
    q = _nibbles(b[:, 6:]) | _high_bits_32(b[:, 2:6].copy().view(np.uint32))
    return PackedFormat.Q5, q, d, d * np.float32(-16.0)


def _q5_1(b: np.ndarray) -> _Parsed:
    q = _nibbles(b[:, 8:]) | _high_bits_32(b[:, 4:8].copy().view(np.uint32))
    return PackedFormat.Q5, q, _f16(b, 0), _f16(b, 2)


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: (d × sc, -(dmin × m)) per 32-weight sub-block, [n, 8] float32."""
    sc, m = Q4_K.get_scale_min(b[:, 4 : 4 + Q4_K.K_SCALE_SIZE])
    return _f16(b, 0) * sc.astype(np.float32), -(_f16(b, 2) * m.astype(np.float32))


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """K-quants' 4-bit planes: each 32 bytes give 32 low nibbles, then 32 high ones."""
    n = qs.shape[0]
    split = qs.reshape(n, -1, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (split & 15).reshape(n, -1)


def _q4_k(b: np.ndarray) -> _Parsed:
    scale, minimum = _k_scales(b)
    return PackedFormat.Q4, _k_low_nibbles(b[:, 16:]), scale, minimum


def _q5_k(b: np.ndarray) -> _Parsed:
    scale, minimum = _k_scales(b)
    n = b.shape[0]
    qh = b[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    q = _k_low_nibbles(b[:, 48:]) | ((qh & 1) << 4).reshape(n, -1)
    return PackedFormat.Q5, q, scale, minimum


def _q6_k(b: np.ndarray) -> _Parsed:
    n = b.shape[0]
    ql = b[:, :128].reshape(n, -1, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    qh = b[:, 128:192].reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(
        1, 1, 4, 1
    )
    q = (ql & 15).reshape(n, -1) | ((qh & 3) << 4).reshape(n, -1)  # stored q + 32: 0..63
    scales = b[:, 192:208].copy().view(np.int8).astype(np.float32)
    return PackedFormat.Q6, q, _f16(b, 208) * scales, None


_PARSERS: dict[str, Callable[[np.ndarray], _Parsed]] = {
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q8_0": _q8_0,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
}
GGUF_PACKED_TYPES = frozenset(_PARSERS)


def from_gguf_blocks(type_name: str, raw: np.ndarray, rows: int, cols: int) -> BlockQuantized:
    """A GGUF tensor's raw blocks ([out, in] in the file's row order) as BlockQuantized."""
    parser = _PARSERS.get(type_name)
    if parser is None:
        raise PackingError(f"GGUF type {type_name} has no packed form")
    block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    if cols % block_size:
        raise PackingError(f"input size {cols} is not a multiple of {block_size}")
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, type_size)
    fmt, q, scale, minimum = parser(blocks)
    return BlockQuantized(
        fmt,
        q.reshape(rows, cols),
        np.ascontiguousarray(scale, dtype=np.float32).reshape(rows, -1),
        None if minimum is None else np.ascontiguousarray(minimum, np.float32).reshape(rows, -1),
    )
