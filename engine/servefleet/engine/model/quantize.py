"""Quantization at load (`--quantization int8|int4`): float projections -> packed blocks.

A float checkpoint (safetensors, GGUF F32/F16) is quantized once at load into the packed
layout the GGUF formats already use (`kernels/packed_weights.py`), so the same C kernels
run it and the model holds 9 or 6 bits a weight (float32 scales included) instead of 32:

- int8: the packed Q8 format, symmetric, one float32 scale per output row and 32 inputs
  (absmax / 127). Finer than one scale per output channel, and what the layout holds.
- int4: the packed Q4 format, asymmetric, w = scale × q + min with q 0..15, one
  (scale, min) pair per output row and 32 inputs (group size 32; the layout's block).
  The lm_head stays int8, as llama.cpp's 4-bit mixes keep the output at 6-8 bits: on
  SmolLM2 an int4 lm_head alone costs +4.8 % perplexity (`test_quantize_quality`).

Weights a checkpoint already stores quantized stay as they are; a projection whose input
size is not a multiple of 32 stays float32.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
from collections.abc import Iterator, Mapping

import numpy as np
import torch

from servefleet.api.load_quantization import LOAD_QUANTIZATIONS
from servefleet.engine.kernels.packed_weights import (
    BLOCK_K,
    BlockQuantized,
    PackedFormat,
    PackedWeight,
    pack,
)
from servefleet.engine.model.config import ModelConfig
from servefleet.engine.model.conversion_cache import Checkpoint
from servefleet.engine.model.weights import LM_HEAD, projection_shapes

logger = logging.getLogger(__name__)

_INT4_LEVELS = 15


_CHUNK_ROWS = 1024  # rows quantized at once: temporaries stay a few MB, even for lm_head


def _row_chunks(weight: torch.Tensor) -> Iterator[tuple[slice, np.ndarray]]:
    """[out, in] -> (rows, float32 [rows, in / 32, 32]) a chunk at a time: every block's
    result depends on its own row only, so chunking changes no bit, only the peak memory."""
    rows, cols = weight.shape
    for start in range(0, rows, _CHUNK_ROWS):
        chunk = weight[start : start + _CHUNK_ROWS].detach().to(torch.float32).contiguous()
        yield slice(start, start + len(chunk)), chunk.numpy().reshape(-1, cols // BLOCK_K, BLOCK_K)


def quantize_int8(weight: torch.Tensor) -> BlockQuantized:
    """[out, in] float -> symmetric int8 with one scale per 32 inputs of a row."""
    rows, cols = weight.shape
    q = np.empty((rows, cols // BLOCK_K, BLOCK_K), np.int8)
    scale = np.empty((rows, cols // BLOCK_K), np.float32)
    for part, blocks in _row_chunks(weight):
        scale[part] = _exact_product_scale(np.abs(blocks).max(axis=-1) / np.float32(127.0))
        safe = np.where(scale[part] > 0, scale[part], np.float32(1.0))[..., None]
        work = np.divide(blocks, safe)  # never in place: `blocks` may be the weight itself
        q[part] = np.clip(np.rint(work, out=work), -127, 127, out=work)
    return BlockQuantized(PackedFormat.Q8, q.reshape(rows, cols), scale, None)


def _exact_product_scale(scale: np.ndarray) -> np.ndarray:
    """float32 scales rounded to 16 significant bits, so scale × q (q < 2^8) is exact in
    float32: the packed kernels' fused multiply-add then equals the dequantized weight's
    separate product and sum, bit for bit (as GGUF's float16 scales guarantee)."""
    bits = np.ascontiguousarray(scale, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x80)) & np.uint32(0xFFFFFF00)
    return rounded.view(np.float32)


def quantize_int4(weight: torch.Tensor) -> BlockQuantized:
    """[out, in] float -> 4-bit q with (scale, min) per 32 inputs of a row (min/max grid)."""
    rows, cols = weight.shape
    q = np.empty((rows, cols // BLOCK_K, BLOCK_K), np.uint8)
    scale = np.empty((rows, cols // BLOCK_K), np.float32)
    low = np.empty((rows, cols // BLOCK_K), np.float32)
    for part, blocks in _row_chunks(weight):
        low[part], high = blocks.min(axis=-1), blocks.max(axis=-1)
        scale[part] = _exact_product_scale((high - low[part]) / np.float32(_INT4_LEVELS))
        safe = np.where(scale[part] > 0, scale[part], np.float32(1.0))[..., None]
        work = np.subtract(blocks, low[part][..., None])
        np.divide(work, safe, out=work)
        q[part] = np.clip(np.rint(work, out=work), 0, _INT4_LEVELS, out=work)
    return BlockQuantized(PackedFormat.Q4, q.reshape(rows, cols), scale, low)


_QUANTIZERS = {"int8": quantize_int8, "int4": quantize_int4}
_LM_HEAD_QUANTIZERS = {"int8": quantize_int8, "int4": quantize_int8}


def _float_weight_out_in(
    config: ModelConfig, weights: Mapping[str, torch.Tensor], name: str
) -> torch.Tensor | None:
    """The [out, in] float weight behind packable `name`, or None when it is not float here."""
    if name == LM_HEAD:
        source = "embed_tokens" if config.tie_word_embeddings else "lm_head"
        return weights.get(source)  # stored [vocab, hidden]: already [out, in]
    weight = weights.get(name)
    return None if weight is None else weight.t()


def quantize_into(
    config: ModelConfig,
    weights: Mapping[str, torch.Tensor],
    packed: dict[str, PackedWeight],
    mode: str,
) -> set[str]:
    """Quantize the float projections (and lm_head) of the fused state `weights` into
    `packed`, one at a time: `weights` may read each from disk when looked up, so only one
    float copy exists at once. Returns the state-dict names the packed forms replace."""
    quantizer = _QUANTIZERS.get(mode)
    if quantizer is None:
        raise ValueError(f"quantization {mode!r} is not one of {', '.join(LOAD_QUANTIZATIONS)}")
    replaced: set[str] = set()
    for name, (k, _n) in projection_shapes(config).items():
        if name in packed or k % BLOCK_K:
            continue
        weight = _float_weight_out_in(config, weights, name)
        if weight is None or not weight.is_floating_point():
            continue
        quantize = _LM_HEAD_QUANTIZERS[mode] if name == LM_HEAD else quantizer
        packed[name] = pack(quantize(weight))
        del weight  # before the next weight is read
        if name != LM_HEAD or not config.tie_word_embeddings:
            replaced.add(name)  # a tied embedding stays: the lookup reads it
    return replaced


def quantize_checkpoint(checkpoint: Checkpoint, mode: str) -> int:
    """Quantize an in-memory checkpoint's float projections (and lm_head) into
    `checkpoint.packed`, dropping their float copies; returns how many were quantized."""
    before = len(checkpoint.packed)
    replaced = quantize_into(checkpoint.config, checkpoint.weights, checkpoint.packed, mode)
    for name in replaced:
        del checkpoint.weights[name]
    done = len(checkpoint.packed) - before
    if done:  # none left when reading quantized them already
        own_copies(checkpoint.weights)
        return_freed_heap()
        logger.info("quantized %d weights at load to %s", done, mode)
    return done


def read_quantized(
    config: ModelConfig,
    tensors: Mapping[str, torch.Tensor],
    packed: dict[str, PackedWeight],
    mode: str,
) -> dict[str, torch.Tensor]:
    """Stream a fused state dict whose lookups read from disk (`TensorFiles`): the float
    weights kept are read once, each projection is read, quantized into `packed` and
    released before the next. Returns the float weights left (in memory of their own)."""
    shapes, before = projection_shapes(config), len(packed)
    kept = {name: tensors[name] for name in tensors if name not in shapes}
    # The kept embedding serves a tied lm_head: looked up in `kept`, it is not read twice.
    replaced = quantize_into(config, _Layered(kept, tensors), packed, mode)
    kept |= {n: tensors[n] for n in tensors if n in shapes and n not in replaced}
    return_freed_heap()
    logger.info("quantized %d weights at load to %s (streamed)", len(packed) - before, mode)
    return kept


class _Layered(Mapping[str, torch.Tensor]):
    """`first`'s tensors, then `rest`'s (a read-only ChainMap for any Mapping)."""

    def __init__(self, first: Mapping[str, torch.Tensor], rest: Mapping[str, torch.Tensor]):
        self._first, self._rest = first, rest

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._first[name] if name in self._first else self._rest[name]

    def __iter__(self) -> Iterator[str]:
        return iter(set(self._first) | set(self._rest))

    def __len__(self) -> int:
        return len(set(self._first) | set(self._rest))


def own_copies(weights: dict[str, torch.Tensor]) -> None:
    """Copy the weights left in float out of the memory-mapped checkpoint file: quantizing read
    every page of it, and one view left on the file (the embedding) would keep all those
    pages resident; with no view left, the mapping goes and only the copies stay."""
    for name, tensor in weights.items():
        weights[name] = tensor.clone()


def return_freed_heap() -> None:
    """Quantizing frees ~200 MB of temporaries (SmolLM2-sized) that glibc keeps in its heap
    rather than give back; trim it (a no-op where the C library has no malloc_trim)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
