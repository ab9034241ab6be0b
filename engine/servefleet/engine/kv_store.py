"""KV blocks in and out of the cache: pin, read, stage, write, commit, on the right thread.

The block pool is the engine thread's alone, so every pool operation here is a function
handed to `Engine.call` (it runs between two steps, when everything the last schedule
published has been written). The bytes move off the engine thread:
- export: pinned (touched), cached, full blocks are immutable (only `allocate` rewrites a
  block, and it takes unreferenced ones), so they are read while steps go on;
- import: freshly allocated, hashless blocks are private to the import, so they are written
  while steps go on, then published in chain order by `cache_block` only once verified.
  A discarded stage is freed without a hash: it was never visible.
Pins and stages are capped (`POOL_SHARE` of the pool each) so transfers never take the
blocks running sequences need.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import torch

from servefleet.api.ewma import Ewma
from servefleet.api.kv_transfer import POOL_SHARE
from servefleet.engine.block_pool import KVBlock, NoFreeBlocksError
from servefleet.engine.kv_cache import KVCacheManager


@dataclass(frozen=True)
class HeldBlock:
    """A pinned cached block, as export sends it."""

    block_id: int
    block_hash: int
    parent_hash: int
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class VerifiedBlock:
    """A received block whose hash and checksum matched: ready to stage."""

    block_hash: int
    parent_hash: int
    token_ids: tuple[int, ...]
    data: bytes


@dataclass
class KVStore:
    """The cache's storage `[layers, 2, blocks, block_size, kv_heads, row]` and its pool."""

    storage: torch.Tensor
    kv: KVCacheManager
    fingerprint: str
    fields: dict[str, Any]
    pinned: int = 0  # blocks exports hold now (engine thread)
    staged: int = 0  # blocks imports hold now (engine thread)
    prefilling: int = 0  # prefill-and-export streams running now (asyncio side, `kv_prefill`)
    pull_rate: Ewma = field(default_factory=lambda: Ewma(0.0))  # bytes/s of past pulls
    # Pulls under way (asyncio side), by the first block they pull: a request missing the same
    # run waits for that pull instead of moving the same bytes again (`kv_puller`).
    pulling: dict[int, asyncio.Event] = field(default_factory=dict)
    cap: int = field(init=False)

    def __post_init__(self) -> None:
        self.cap = max(1, int(self.kv.num_blocks * POOL_SHARE))

    @property
    def block_shape(self) -> tuple[int, ...]:
        layers, sides, _, *rest = self.storage.shape
        return (layers, sides, *rest)

    @property
    def block_size(self) -> int:
        return int(self.storage.shape[3])

    @property
    def bytes_per_block(self) -> int:
        return self.storage[:, :, 0].numel() * self.storage.element_size()

    # ---- engine thread (via Engine.call) ----------------------------------------------------
    def held_run(self, hashes: list[int]) -> int:
        """How many of `hashes`, from the first, this cache holds."""
        count = 0
        for block_hash in hashes:
            if self.kv.pool.lookup(block_hash) is None:
                break
            count += 1
        return count

    def pin(self, hashes: list[int]) -> tuple[list[HeldBlock], bool]:
        """Take a reference on the held leading run, within the export cap; and whether the
        run ended (a block not held) rather than the cap."""
        room = max(0, self.cap - self.pinned)
        held: list[KVBlock] = []
        ended = False
        for block_hash in hashes:
            block = self.kv.pool.lookup(block_hash)
            if block is None or block.parent_hash is None:
                ended = True
                break
            if len(held) == room:
                break
            held.append(block)
        self.kv.pool.touch(held)
        self.pinned += len(held)
        out = [
            HeldBlock(b.block_id, b.block_hash or 0, b.parent_hash or 0, b.token_ids) for b in held
        ]
        return out, ended

    def unpin(self, blocks: list[HeldBlock]) -> None:
        self.kv.pool.free(self.kv.pool.blocks[b.block_id] for b in reversed(blocks))
        self.pinned -= len(blocks)

    def stage(self, count: int) -> list[int]:
        """Private blocks to write an import into; fewer (maybe none) at the cap or when the
        pool has no free block."""
        count = min(count, self.cap - self.staged, self.kv.pool.num_free_blocks)
        if count <= 0:
            return []
        try:
            blocks = self.kv.pool.allocate(count)
        except NoFreeBlocksError:
            return []
        self.staged += len(blocks)
        return [b.block_id for b in blocks]

    def commit(
        self, block_ids: list[int], blocks: list[VerifiedBlock], first: int | None = None
    ) -> int:
        """Publish the first len(blocks) staged blocks in chain order, free the rest; the
        number published (a hash already cached keeps its block, this one is dropped).

        `first`: the hash of a base-model chain's first block, as the importer knows it (its
        own request's root chained it, or a warm source's hot list names it): that block is
        marked `first` as a computed one is, so this cache's hot list offers the chain on.
        Not when its parent is a block cached here: a chain's first block hangs off a root."""
        pool = self.kv.pool
        published = 0
        for block_id, block in zip(block_ids, blocks, strict=False):
            starts = block.block_hash == first and pool.lookup(block.parent_hash) is None
            ok = pool.cache_block(
                pool.blocks[block_id],
                block.block_hash,
                block.parent_hash,
                block.token_ids,
                starts,
            )
            published += ok
        pool.free(pool.blocks[i] for i in reversed(block_ids))
        self.staged -= len(block_ids)
        return published

    # ---- any thread: bytes of blocks that are pinned or staged ---------------------------
    def read(self, block_ids: list[int]) -> list[bytes]:
        """Each block block-major: for each layer, K [bs, kvh, row] then V."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.storage.device)
        rows = self.storage.index_select(2, index).permute(2, 0, 1, 3, 4, 5).contiguous()
        raw = rows.cpu().view(torch.uint8).reshape(len(block_ids), -1).numpy()
        return [row.tobytes() for row in raw]

    def write(self, block_ids: list[int], data: list[bytes]) -> None:
        shape = self.block_shape
        for block_id, payload in zip(block_ids, data, strict=True):
            src = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            block = src.view(self.storage.dtype).view(shape)
            self.storage[:, :, block_id].copy_(block.to(self.storage.device))
