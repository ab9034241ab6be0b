"""Which replica's prefix cache holds which KV blocks, as their event streams say.

One `KVIndex` per deployment pool: hash → holders and replica → hashes, fed by
`kv_subscriber` (one engine event stream per replica). Each replica's set is bounded by the
`num_blocks` its hello announced (an engine cannot hold more; a stream that claims more is
cut off at it), so the index costs at most ~100 bytes per (block, replica). A replica that
leaves, or whose stream resets, is dropped and rebuilt from its next snapshot. The index is a
hint for routing: the engine that gets the request hashes and checks its own cache.

Each replica's resident LoRA adapters (name -> identity, from its events) are kept too: an
adapter's chain starts at `root_hash(identity, salt)`, so the gateway can hash an adapter's
prompt only once the replicas that report the name agree on one identity (`adapter_identity`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from servefleet.api.kv_events import KVEventBatch, KVHello, KVSnapshot


@dataclass
class ReplicaCache:
    """One replica's cached blocks and what its engine last said about its speed."""

    hello: KVHello
    hashes: set[int] = field(default_factory=set)
    prompt_tps: float = 0.0
    pull_bps: float = 0.0
    step_s: float = 0.0
    lag_s: float = 0.0  # how late its newest applied batch was (`EVENTS_LAG_METRIC`)
    adapters: dict[str, int] = field(default_factory=dict)  # resident: name -> identity

    def learn_adapters(self, adapters: dict[str, int] | None) -> None:
        """None: the engine did not say (older, or nothing changed): keep what was known."""
        if adapters is not None:
            self.adapters = dict(adapters)


class KVIndex:
    def __init__(self) -> None:
        self.holders: dict[int, set[str]] = {}
        self.per_replica: dict[str, ReplicaCache] = {}

    @property
    def blocks(self) -> int:
        """(block, replica) pairs held: the index's size."""
        return sum(len(r.hashes) for r in self.per_replica.values())

    def replica(self, endpoint: str) -> ReplicaCache | None:
        return self.per_replica.get(endpoint)

    # ---- fed by the event streams --------------------------------------------------------
    def hello(self, endpoint: str, hello: KVHello) -> None:
        """A (re)connected stream: a new epoch means a new cache, so the old entries go."""
        old = self.per_replica.get(endpoint)
        if old is not None and old.hello.epoch != hello.epoch:
            self.drop(endpoint)
            old = None
        if old is None:
            self.per_replica[endpoint] = ReplicaCache(hello)
        else:
            old.hello = hello
        cache = self.per_replica[endpoint]
        cache.prompt_tps = hello.prompt_tokens_per_second or cache.prompt_tps
        cache.pull_bps = hello.pull_bytes_per_second or cache.pull_bps
        cache.step_s = hello.step_seconds or cache.step_s
        cache.learn_adapters(hello.adapters)

    def snapshot(self, endpoint: str, snap: KVSnapshot) -> None:
        cache = self.per_replica.get(endpoint)
        if cache is None:
            return
        self._clear(endpoint, cache)
        self._store(endpoint, cache, (h for h, _ in snap.stored))
        cache.learn_adapters(snap.adapters)

    def batch(self, endpoint: str, batch: KVEventBatch, now: float | None = None) -> None:
        cache = self.per_replica.get(endpoint)
        if cache is None:
            return
        cache.lag_s = max(0.0, (time.time() if now is None else now) - batch.ts)
        if batch.cleared:
            self._clear(endpoint, cache)
        for h in batch.removed:
            self._remove(endpoint, cache, int(h, 16))
        self._store(endpoint, cache, (h for h, _ in batch.stored))
        cache.prompt_tps = batch.prompt_tokens_per_second or cache.prompt_tps
        cache.pull_bps = batch.pull_bytes_per_second or cache.pull_bps
        cache.step_s = batch.step_seconds or cache.step_s
        cache.learn_adapters(batch.adapters)

    def drop(self, endpoint: str) -> None:
        cache = self.per_replica.pop(endpoint, None)
        if cache is not None:
            self._clear(endpoint, cache)

    def keep_only(self, endpoints: set[str]) -> None:
        for endpoint in [e for e in self.per_replica if e not in endpoints]:
            self.drop(endpoint)

    # ---- read by routing -----------------------------------------------------------------
    def adapter_identity(self, name: str) -> int | None:
        """The identity every replica that reports adapter `name` reports; None when none
        does, or when they disagree (different files under one name: no chain is sure)."""
        seen = {c.adapters[name] for c in self.per_replica.values() if name in c.adapters}
        return seen.pop() if len(seen) == 1 else None

    def held_runs(self, hashes: tuple[int, ...]) -> dict[str, int]:
        """Per replica holding the first block: how many of `hashes`, from the first, it
        holds (the longest cached prefix it would hit)."""
        if not hashes:
            return {}
        alive = set(self.holders.get(hashes[0], ()))
        runs: dict[str, int] = {}
        for i, block_hash in enumerate(hashes[1:], start=1):
            if not alive:
                break
            still = alive & self.holders.get(block_hash, set())
            for endpoint in alive - still:
                runs[endpoint] = i
            alive = still
        for endpoint in alive:
            runs[endpoint] = len(hashes)
        return runs

    # ---- inside --------------------------------------------------------------------------
    def _store(self, endpoint: str, cache: ReplicaCache, hexes: Iterable[str]) -> None:
        room = cache.hello.num_blocks
        for text in hexes:
            if len(cache.hashes) >= room:
                return  # more than the cache can hold: the rest is not believed
            block_hash = int(text, 16)
            if block_hash not in cache.hashes:
                cache.hashes.add(block_hash)
                self.holders.setdefault(block_hash, set()).add(endpoint)

    def _remove(self, endpoint: str, cache: ReplicaCache, block_hash: int) -> None:
        if block_hash in cache.hashes:
            cache.hashes.discard(block_hash)
            holders = self.holders.get(block_hash)
            if holders is not None:
                holders.discard(endpoint)
                if not holders:
                    del self.holders[block_hash]

    def _clear(self, endpoint: str, cache: ReplicaCache) -> None:
        for block_hash in list(cache.hashes):
            self._remove(endpoint, cache, block_hash)
