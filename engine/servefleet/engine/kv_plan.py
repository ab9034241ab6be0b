"""How big the KV cache is and in which dtype: what every rank of a replica computes alike.

From the settings and the loaded model (its shard, under tensor parallelism): the cache's
dtype, the served context length, the memory budget and the blocks it holds.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from servefleet.api.quantity import parse_memory_size
from servefleet.engine.config import EngineConfig, EngineSettingsError
from servefleet.engine.invariance import apply_batch_invariance, resolve_batch_invariant
from servefleet.engine.kernels.triton_paged_decode import triton_paged_decode
from servefleet.engine.kv_budget import MIN_BLOCKS, kv_cache_blocks
from servefleet.engine.model.config import ModelConfig
from servefleet.engine.model.kv_layout import kv_bytes_per_block
from servefleet.engine.model.loader import LoadedModel

log = logging.getLogger("servefleet.engine")


KV_CACHE_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
}


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """`auto`: the model's dtype (as vLLM does).

    float16 under a float32 model halves what decode attention reads and doubles the
    tokens a budget holds, but it is opt-in: rounding keys and values to 11 bits turns
    the last-bit differences between the decode kernels and MKL's prefill into visible
    ones, so greedy outputs would no longer be the same alone and in a batch.
    """
    return model_dtype if name == "auto" else KV_CACHE_DTYPES[name]


def check_kv_cache_dtype(dtype: torch.dtype, loaded: LoadedModel) -> None:
    """int8 rows carry their scale inline (kv_quant); the Triton kernel does not read them."""
    if dtype == torch.int8 and loaded.model.attn_impl.decode_kernel is triton_paged_decode:
        raise EngineSettingsError(
            "--kv-cache-dtype int8 is not supported by the triton decode kernel; "
            "use --decode-kernel torch (or cpu-c on CPU)"
        )


def kv_cache_bytes(setting: str, device: torch.device) -> int:
    size = parse_memory_size(setting)
    if size.bytes is not None:
        return size.bytes
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        free = _mem_available()
    return size.resolve(free)


def _mem_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


def serving_context_length(config: EngineConfig, model: ModelConfig) -> int:
    """--max-model-len capped by the model's positions and its sliding window.

    Attention here always sees the whole context; that is exactly sliding-window
    attention as long as no sequence outgrows the window, so the window caps the length.
    """
    length = min(
        config.max_model_len or model.max_position_embeddings, model.max_position_embeddings
    )
    window = model.sliding_window
    if window is not None and window < length:
        log.warning(
            "max_model_len capped to the model's sliding window: %d -> %d (attention over "
            "longer contexts would differ from the model's windowed attention)",
            length,
            window,
        )
        return window
    return length


def kv_cache_plan(config: EngineConfig, loaded: LoadedModel) -> tuple[int, int, torch.dtype, int]:
    """(blocks, bytes a block, dtype, context length) of the KV cache, and the model's
    kernels set for batch invariance: what every rank of a replica computes alike."""
    device = next(loaded.model.parameters()).device
    dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, next(loaded.model.parameters()).dtype)
    check_kv_cache_dtype(dtype, loaded)
    invariant = resolve_batch_invariant(config.batch_invariant, loaded.model)
    apply_batch_invariance(loaded.model, invariant)
    max_model_len = serving_context_length(config, loaded.config)
    per_block = kv_bytes_per_block(loaded.config, config.block_size, dtype)
    budget = kv_cache_bytes(config.kv_cache_memory, device)
    if budget // per_block < MIN_BLOCKS:
        raise EngineSettingsError(
            f"--kv-cache-memory {config.kv_cache_memory} gives {budget} bytes, less than two "
            f"blocks of {per_block} bytes"
        )
    num_blocks = kv_cache_blocks(
        budget, per_block, config.block_size, config.max_num_seqs, max_model_len
    )
    if num_blocks < budget // per_block:
        log.info(
            "kv_cache_sized: max_num_seqs=%d x max_model_len=%d need %d blocks, under the "
            "--kv-cache-memory budget of %d bytes",
            config.max_num_seqs,
            max_model_len,
            num_blocks,
            budget,
        )
    return num_blocks, per_block, dtype, max_model_len
