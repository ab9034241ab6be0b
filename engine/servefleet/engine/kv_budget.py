"""How many KV-cache blocks to reserve: what the configured concurrency can use, at most
the memory budget (`--kv-cache-memory`, bytes or a fraction of free memory).

The cache is allocated and zeroed up front, so every reserved block is resident memory
from the start. `max_num_seqs` sequences of `max_model_len` tokens is the most the
scheduler can ever hold at once; blocks beyond that could only keep evicted prefixes, so
an engine configured for little concurrency or short contexts reserves only what it can
use, and the budget is a cap rather than a fixed reservation.
"""

from __future__ import annotations

MIN_BLOCKS = 2  # the fewest the engine runs with (the budget check's floor)


def blocks_for_tokens(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def blocks_needed(max_num_seqs: int, max_model_len: int, block_size: int) -> int:
    """Blocks that `max_num_seqs` sequences of `max_model_len` tokens occupy together."""
    return max_num_seqs * blocks_for_tokens(max_model_len, block_size)


def kv_cache_blocks(
    budget_bytes: int,
    bytes_per_block: int,
    block_size: int,
    max_num_seqs: int,
    max_model_len: int,
) -> int:
    """The smaller of the budget in whole blocks and what the concurrency needs."""
    if bytes_per_block <= 0:
        raise ValueError(f"bytes_per_block must be positive, got {bytes_per_block}")
    needed = max(MIN_BLOCKS, blocks_needed(max_num_seqs, max_model_len, block_size))
    return min(budget_bytes // bytes_per_block, needed)
