"""Per-sequence block allocation on top of the block pool.

A full block is named by a hash chained over its parent's hash and its token
ids (`servefleet.api.kv_blocks`), so equal hashes mean equal prefixes; a new
sequence takes every cached block of its longest cached prefix and only
computes the rest.
"""

from __future__ import annotations

from servefleet.api import kv_blocks
from servefleet.api.kv_blocks import chain_hash
from servefleet.engine.block_pool import BlockPool, KVBlock
from servefleet.engine.sequence import Sequence

ROOT_HASH = kv_blocks.root_hash(None)


def root_hash(seq: Sequence) -> int:
    """The chain's start: an adapter's sequences, and each cache salt's, start their own chain,
    so KV computed under one adapter (or the base model) or salt is never a hit for another."""
    if seq.lora is None and seq.cache_salt is None:
        return ROOT_HASH
    identity = None if seq.lora is None else seq.lora.identity
    return kv_blocks.root_hash(identity, seq.cache_salt)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.enable_caching = enable_caching
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _update_hashes(self, seq: Sequence, upto_tokens: int) -> None:
        """Extend seq.block_hashes over every full block within the first upto_tokens."""
        bs = self.block_size
        while (len(seq.block_hashes) + 1) * bs <= upto_tokens:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if seq.block_hashes else root_hash(seq)
            seq.block_hashes.append(chain_hash(parent, seq.token_ids[i * bs : (i + 1) * bs]))

    def find_cached_prefix(self, seq: Sequence) -> list[KVBlock]:
        """Longest run of cached full blocks; always leaves >= 1 token to compute."""
        if not self.enable_caching or seq.num_computed_tokens:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        self._update_hashes(seq, max_blocks * self.block_size)
        hits: list[KVBlock] = []
        for block_hash in seq.block_hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate(
        self,
        seq: Sequence,
        num_new_tokens: int,
        cached: list[KVBlock],
        num_lookahead_tokens: int = 0,
    ) -> bool:
        """Reserve blocks so the next num_new_tokens can be computed; False if they don't fit.

        `cached` are prefix hits from find_cached_prefix (only on a sequence's first schedule).
        `num_lookahead_tokens` reserve slots past the known tokens (speculative proposals):
        their token ids are not the sequence's yet, so their blocks are never published.
        """
        total = seq.num_computed_tokens + len(cached) * self.block_size + num_new_tokens
        reserved = total + num_lookahead_tokens
        num_new_blocks = self.blocks_needed(reserved) - len(seq.block_table) - len(cached)
        # Cached blocks sitting in the free queue stop being free once we touch them.
        evictable_hits = sum(1 for b in cached if b.ref_count == 0)
        if num_new_blocks > self.pool.num_free_blocks - evictable_hits:
            return False
        if cached:
            self.pool.touch(cached)
            seq.block_table.extend(b.block_id for b in cached)
            seq.num_computed_tokens += len(cached) * self.block_size
            seq.num_cached_tokens = len(cached) * self.block_size
        if num_new_blocks > 0:
            seq.block_table.extend(b.block_id for b in self.pool.allocate(num_new_blocks))
        if self.enable_caching:
            self._cache_full_blocks(seq, total)
        return True

    def record_lookup(self, seq: Sequence, num_hit_tokens: int) -> None:
        self.prefix_queries += seq.num_tokens
        self.prefix_hits += num_hit_tokens

    def _cache_full_blocks(self, seq: Sequence, upto_tokens: int) -> None:
        # Token ids of every position below upto_tokens are known at schedule time, so
        # blocks that this step fills can be published now; attention writes all KV of a
        # step before reading, so a hit within the same step still sees valid data.
        self._update_hashes(seq, upto_tokens)
        full = min(len(seq.block_hashes), len(seq.block_table))
        bs = self.block_size
        for i in range(seq.num_published_blocks, full):
            parent = seq.block_hashes[i - 1] if i else root_hash(seq)
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            block = self.pool.blocks[seq.block_table[i]]
            first = i == 0 and seq.lora is None
            self.pool.cache_block(block, seq.block_hashes[i], parent, tokens, first)
        seq.num_published_blocks = max(seq.num_published_blocks, full)

    def trim(self, seq: Sequence) -> None:
        """Give back blocks past what the sequence's known tokens need: the tail a rejected
        speculative proposal had reserved (its slots hold no valid KV)."""
        keep = self.blocks_needed(seq.num_tokens)
        if len(seq.block_table) <= keep:
            return
        tail = seq.block_table[keep:]
        del seq.block_table[keep:]
        self.pool.free(self.pool.blocks[i] for i in reversed(tail))

    def free(self, seq: Sequence) -> None:
        blocks = [self.pool.blocks[i] for i in reversed(seq.block_table)]
        self.pool.free(blocks)
        seq.block_table = []
        seq.num_published_blocks = 0

    def check_all_free(self) -> None:
        self.pool.check_all_free()
