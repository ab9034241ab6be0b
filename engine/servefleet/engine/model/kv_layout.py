"""The paged KV cache's memory: one allocation for every layer, sized per block.

Kept apart from the model: the engine sizes and allocates the cache from the config alone
(before any step), and the model only reads the per-layer views it is handed.
"""

from __future__ import annotations

import torch

from servefleet.engine.kv_quant import row_width
from servefleet.engine.memory import empty_on_huge_pages
from servefleet.engine.model.config import ModelConfig

KVCache = tuple[torch.Tensor, torch.Tensor]


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one KV block takes across all layers (keys and values, int8's scales too)."""
    element = torch.empty(0, dtype=dtype).element_size()
    row = row_width(config.head_dim, dtype) * element
    return 2 * config.num_layers * block_size * config.num_kv_heads * row


def allocate_kv_storage(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:
    """The whole cache as one tensor `[layers, 2, num_blocks, block_size, kv_heads, row]`.

    KV transfer copies blocks out of and into it (`index_select` / `index_copy_` on dim 2);
    an int8 cache's rows are head_dim + 4 wide: each carries its float32 scale (kv_quant).
    """
    row = row_width(config.head_dim, dtype)
    shape = (config.num_layers, 2, num_blocks, block_size, config.num_kv_heads, row)
    if torch.device(device).type == "cpu":  # attention reads scattered blocks: fewer TLB misses
        return empty_on_huge_pages(shape, dtype).zero_()
    return torch.zeros(shape, dtype=dtype, device=device)


def layer_views(storage: torch.Tensor) -> list[KVCache]:
    """Per-layer (k, v) views of the storage, each contiguous: what the model reads."""
    return [(storage[i, 0], storage[i, 1]) for i in range(storage.shape[0])]


def allocate_kv_cache(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[KVCache]:
    """One allocation for the whole cache; per-layer (k, v) views of it."""
    return layer_views(allocate_kv_storage(config, num_blocks, block_size, dtype, device))
