"""KV cache events: what the block pool published and evicted, step by step, for subscribers.

The pool records into a `KVEventSink` (engine thread only, as the pool itself). The engine
loop takes the sink's batch only after `runner.execute` (and between steps, where whatever an
`Engine.call` published — an import commit — was written before it was published), and
appends it to the `KVEventLog`: a bounded ring of per-step batches that the SSE route reads
from the asyncio thread. Subscribers never queue anything of their own: each one reads the
ring from its last sequence number, and one that fell behind the ring gets a snapshot.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from servefleet.api.kv_events import MAX_SUBSCRIBERS, RING_STEPS


class KVEventSink:
    """One step's changes, normalised so that applying cleared → removed → stored gives the
    cache's state: a hash stored and evicted within the batch is never announced."""

    def __init__(self) -> None:
        self.stored: dict[int, int] = {}  # hash -> parent, in publish (chain) order
        self.removed: dict[int, None] = {}
        self.cleared = False

    def on_stored(self, block_hash: int, parent: int) -> None:
        self.stored[block_hash] = parent

    def on_removed(self, block_hash: int) -> None:
        if self.stored.pop(block_hash, None) is None:
            self.removed[block_hash] = None

    def on_cleared(self) -> None:
        self.stored.clear()
        self.removed.clear()
        self.cleared = True

    def __bool__(self) -> bool:
        return bool(self.stored or self.removed or self.cleared)

    def take(self) -> PendingBatch | None:
        if not self:
            return None
        batch = PendingBatch(list(self.stored.items()), list(self.removed), self.cleared)
        self.stored, self.removed, self.cleared = {}, {}, False
        return batch


@dataclass(frozen=True, slots=True)
class PendingBatch:
    stored: list[tuple[int, int]]
    removed: list[int]
    cleared: bool


@dataclass(frozen=True, slots=True)
class LoggedBatch:
    seq: int
    ts: float
    stored: list[tuple[int, int]]
    removed: list[int]
    cleared: bool


class TooManySubscribers(Exception):
    pass


@dataclass(eq=False)
class Subscription:
    """One stream's wake-up: set (on its own loop) whenever a batch is logged."""

    loop: asyncio.AbstractEventLoop
    wake: asyncio.Event = field(default_factory=asyncio.Event)


class KVEventLog:
    """The ring of the last `ring_steps` batches; appended by the engine thread, read by the
    SSE streams. `epoch` names this process's sequence, so ids of another run never match."""

    def __init__(self, ring_steps: int = RING_STEPS, max_subscribers: int = MAX_SUBSCRIBERS):
        self.epoch = secrets.token_hex(4)
        self.ring: deque[LoggedBatch] = deque(maxlen=ring_steps)
        self.seq = 0
        self.max_subscribers = max_subscribers
        self._subscribers: set[Subscription] = set()
        self._lock = threading.Lock()

    # ---- engine thread ------------------------------------------------------------------
    def append(self, batch: PendingBatch) -> None:
        with self._lock:
            self.seq += 1
            logged = LoggedBatch(self.seq, time.time(), batch.stored, batch.removed, batch.cleared)
            self.ring.append(logged)
            subscribers = list(self._subscribers)
        for sub in subscribers:
            if not sub.loop.is_closed():
                sub.loop.call_soon_threadsafe(sub.wake.set)

    # ---- any thread ---------------------------------------------------------------------
    def mark(self) -> None:
        """Log an empty batch (any thread): the resident adapters changed, and each stream
        wakes to send their identities with it (`kv_event_routes`)."""
        self.append(PendingBatch([], [], False))

    def since(self, seq: int) -> list[LoggedBatch] | None:
        """Batches after `seq`; None when the ring no longer holds the one right after it."""
        with self._lock:
            if seq > self.seq:
                return None
            if seq == self.seq:
                return []
            if not self.ring or self.ring[0].seq > seq + 1:
                return None
            return [b for b in self.ring if b.seq > seq]

    def subscribe(self) -> Subscription:
        sub = Subscription(asyncio.get_running_loop())
        with self._lock:
            if len(self._subscribers) >= self.max_subscribers:
                raise TooManySubscribers(f"{self.max_subscribers} event streams already open")
            self._subscribers.add(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            self._subscribers.discard(sub)

    @property
    def subscribers(self) -> int:
        return len(self._subscribers)
