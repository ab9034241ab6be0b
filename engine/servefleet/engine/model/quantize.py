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

import numpy as np
import torch

from servefleet.api.load_quantization import LOAD_QUANTIZATIONS
from servefleet.engine.kernels.packed_weights import BLOCK_K, BlockQuantized, PackedFormat, pack
from servefleet.engine.model.config import ModelConfig
from servefleet.engine.model.conversion_cache import Checkpoint
from servefleet.engine.model.weights import LM_HEAD, projection_shapes

logger = logging.getLogger(__name__)

_INT4_LEVELS = 15


def _blocks(weight: torch.Tensor) -> np.ndarray:
    """[out, in] -> float32 [out, in / 32, 32]."""
    rows, cols = weight.shape
    values = weight.detach().to(torch.float32).contiguous().numpy()
    return values.reshape(rows, cols // BLOCK_K, BLOCK_K)


def quantize_int8(weight: torch.Tensor) -> BlockQuantized:
    """[out, in] float -> symmetric int8 with one scale per 32 inputs of a row."""
    blocks = _blocks(weight)
    scale = _exact_product_scale(np.abs(blocks).max(axis=-1) / np.float32(127.0))
    safe = np.where(scale > 0, scale, np.float32(1.0))[..., None]
    q = np.clip(np.rint(blocks / safe), -127, 127).astype(np.int8)
    return BlockQuantized(PackedFormat.Q8, q.reshape(weight.shape), scale.astype(np.float32), None)


def _exact_product_scale(scale: np.ndarray) -> np.ndarray:
    """float32 scales rounded to 16 significant bits, so scale × q (q < 2^8) is exact in
    float32: the packed kernels' fused multiply-add then equals the dequantized weight's
    separate product and sum, bit for bit (as GGUF's float16 scales guarantee)."""
    bits = np.ascontiguousarray(scale, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x80)) & np.uint32(0xFFFFFF00)
    return rounded.view(np.float32)


def quantize_int4(weight: torch.Tensor) -> BlockQuantized:
    """[out, in] float -> 4-bit q with (scale, min) per 32 inputs of a row (min/max grid)."""
    blocks = _blocks(weight)
    low, high = blocks.min(axis=-1), blocks.max(axis=-1)
    scale = _exact_product_scale((high - low) / np.float32(_INT4_LEVELS))
    safe = np.where(scale > 0, scale, np.float32(1.0))[..., None]
    q = np.clip(np.rint((blocks - low[..., None]) / safe), 0, _INT4_LEVELS).astype(np.uint8)
    return BlockQuantized(PackedFormat.Q4, q.reshape(weight.shape), scale, low.astype(np.float32))


_QUANTIZERS = {"int8": quantize_int8, "int4": quantize_int4}
_LM_HEAD_QUANTIZERS = {"int8": quantize_int8, "int4": quantize_int8}


def _float_weight_out_in(
    config: ModelConfig, weights: dict[str, torch.Tensor], name: str
) -> torch.Tensor | None:
    """The [out, in] float weight behind packable `name`, or None when it is not float here."""
    if name == LM_HEAD:
        source = "embed_tokens" if config.tie_word_embeddings else "lm_head"
        return weights.get(source)  # stored [vocab, hidden]: already [out, in]
    weight = weights.get(name)
    return None if weight is None else weight.t()


def quantize_checkpoint(checkpoint: Checkpoint, mode: str) -> int:
    """Quantize the checkpoint's float projections (and lm_head) in place into
    `checkpoint.packed`, dropping their float copies; returns how many were quantized."""
    quantizer = _QUANTIZERS.get(mode)
    if quantizer is None:
        raise ValueError(f"quantization {mode!r} is not one of {', '.join(LOAD_QUANTIZATIONS)}")
    config, weights = checkpoint.config, checkpoint.weights
    done = 0
    for name, (k, _n) in projection_shapes(config).items():
        if name in checkpoint.packed or k % BLOCK_K:
            continue
        weight = _float_weight_out_in(config, weights, name)
        if weight is None or not weight.is_floating_point():
            continue
        quantize = _LM_HEAD_QUANTIZERS[mode] if name == LM_HEAD else quantizer
        checkpoint.packed[name] = pack(quantize(weight))
        if name != LM_HEAD:
            del weights[name]
        elif not config.tie_word_embeddings:
            del weights["lm_head"]  # a tied embedding stays: the lookup reads it
        done += 1
    if done:
        own_copies(weights)
        _return_freed_heap()
    logger.info("quantized %d weights at load to %s", done, mode)
    return done


def own_copies(weights: dict[str, torch.Tensor]) -> None:
    """Copy the weights left in float out of the memory-mapped checkpoint file: quantizing read
    every page of it, and one view left on the file (the embedding) would keep all those
    pages resident; with no view left, the mapping goes and only the copies stay."""
    for name, tensor in weights.items():
        weights[name] = tensor.clone()


def _return_freed_heap() -> None:
    """Quantizing frees ~200 MB of temporaries (SmolLM2-sized) that glibc keeps in its heap
    rather than give back; trim it (a no-op where the C library has no malloc_trim)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
