"""Physical KV blocks: reference counts, the prefix-cache index and LRU eviction.

Modelled on vLLM v1's block pool. A block whose reference count drops to zero
goes to the tail of the free queue but keeps its hash, so a later request can
still hit it; it is evicted (its hash forgotten) only when the pool hands it
out again, least recently freed first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from servefleet.engine.kv_events import KVEventSink


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    # What a cached block's hash was chained from: KV transfer sends both with its bytes.
    parent_hash: int | None = None
    token_ids: tuple[int, ...] = ()
    # The first block of a base-model chain, whatever its cache salt: where a walk from a
    # leaf to the chain's start stops (`kv_warm.hot_chains`).
    first: bool = False


class NoFreeBlocksError(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Insertion order is eviction order: the front is evicted first.
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[int, KVBlock] = {}
        self.num_evictions = 0
        # Set by the engine: what was published and evicted, for KV cache event subscribers.
        self.events: KVEventSink | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def lookup(self, block_hash: int) -> KVBlock | None:
        return self._cached.get(block_hash) if self.enable_caching else None

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cached blocks a new sequence reuses."""
        for block in blocks:
            if block.ref_count == 0:
                del self._free[block.block_id]
            block.ref_count += 1

    def allocate(self, count: int) -> list[KVBlock]:
        if count > len(self._free):
            raise NoFreeBlocksError(f"need {count} blocks, {len(self._free)} free")
        out = []
        for _ in range(count):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                if self._cached.get(block.block_hash) is block:
                    del self._cached[block.block_hash]
                    if self.events is not None:
                        self.events.on_removed(block.block_hash)
                block.block_hash = None
                block.parent_hash, block.token_ids = None, ()
                self.num_evictions += 1
            block.ref_count = 1
            out.append(block)
        return out

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop references; callers pass tail blocks first so they are evicted first."""
        for block in blocks:
            block.ref_count -= 1
            if block.ref_count < 0:
                raise AssertionError(f"block {block.block_id} freed twice")
            if block.ref_count == 0:
                if block.block_hash is None:
                    # Nothing worth keeping: hand it out before any cached block.
                    self._free[block.block_id] = block
                    self._free.move_to_end(block.block_id, last=False)
                else:
                    self._free[block.block_id] = block

    def cache_block(
        self,
        block: KVBlock,
        block_hash: int,
        parent_hash: int | None = None,
        token_ids: tuple[int, ...] = (),
        first: bool = False,
    ) -> bool:
        """Publish a full block under its hash; False if it stays private (caching off, or
        an identical block is already indexed)."""
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash in self._cached:
            return False
        block.block_hash = block_hash
        block.parent_hash, block.token_ids, block.first = parent_hash, token_ids, first
        self._cached[block_hash] = block
        if self.events is not None:
            self.events.on_stored(block_hash, parent_hash or 0)
        return True

    def reset_prefix_cache(self) -> None:
        for block in list(self._cached.values()):
            block.block_hash = None
        self._cached.clear()
        if self.events is not None:
            self.events.on_cleared()

    def cached_hashes(self) -> list[tuple[int, int]]:
        """(hash, parent) of every published block: a KV event snapshot."""
        return [(h, b.parent_hash or 0) for h, b in self._cached.items()]

    def check_all_free(self) -> None:
        """Raise unless every block is back in the pool (used by tests and on shutdown)."""
        held = [b.block_id for b in self.blocks if b.ref_count != 0]
        if held or len(self._free) != self.num_blocks:
            raise AssertionError(f"blocks still referenced: {held[:20]} ({len(held)} in all)")
