"""Retry-After values that hold under sustained overload.

A Retry-After equal to the predicted wait sends every client refused in the same second back
in the same second, where they meet each other and the new arrivals: at ten times the pool's
capacity about one retry in ten is admitted, so the header is not a promise at all. Here each
refusal gets its own return time, spaced at the pool's service rate after the ones already
given (a virtual queue of clients away from the gateway), and a request that comes back in its
window — known by its tenant and body, which is what a client's retry (the OpenAI SDKs' own
included) sends again — is admitted past the queue-full check. Fresh requests count the
promises falling due as queued, so the room kept for returning clients is not taken by them.
"""

from __future__ import annotations

import hashlib
import math
from collections import deque
from dataclasses import dataclass, field

# How far off its return time a retry may come and still be the one promised: Retry-After is in
# whole seconds (rounded up), clients add jitter, and a slow client may start late.
EARLY_S = 1.0
LATE_S = 5.0
MAX_PROMISES = 10_000  # bounded memory under any overload; past it, refusals promise nothing


def retry_key(tenant: str, body: bytes) -> bytes:
    """What identifies a retry: the same tenant sending the same request again."""
    return hashlib.blake2b(body, digest_size=16, key=tenant.encode()[:64]).digest()


@dataclass(slots=True, eq=False)
class _Promise:
    due: float
    key: bytes
    kept: bool = False  # the retry came back and was let in


@dataclass
class RetryPromises:
    """Return times handed out with Retry-After, by request key.

    Return times only grow (each is after the last one given), so the promises form a queue
    ordered by time: expiry pops from its head, and counting the ones falling due scans only
    the head, never the whole backlog."""

    max_promises: int = MAX_PROMISES
    _queue: deque[_Promise] = field(default_factory=deque)
    _by_key: dict[bytes, list[_Promise]] = field(default_factory=dict)
    _last_due: float = -math.inf

    def __len__(self) -> int:
        return len(self._queue)

    def promise(self, key: bytes | None, now: float, wait_s: float, rate: float) -> float:
        """Seconds until this refused request should come back: at least `wait_s`, and after
        the returns already promised, one per 1/`rate` seconds."""
        self._expire(now)
        spacing = 1.0 / rate if rate > 0 else 0.0
        due = max(now + wait_s, self._last_due + spacing)
        if key is None or len(self._queue) >= self.max_promises:
            return wait_s
        self._last_due = due
        promise = _Promise(due, key)
        self._queue.append(promise)
        self._by_key.setdefault(key, []).append(promise)
        return due - now

    def redeem(self, key: bytes | None, now: float) -> bool:
        """Whether this request is a promised retry arriving in its window (the promise is used)."""
        self._expire(now)
        promises = self._by_key.get(key) if key is not None else None
        if not promises:
            return False
        for i, promise in enumerate(promises):
            if promise.due - EARLY_S <= now <= promise.due + LATE_S:
                promise.kept = True
                del promises[i]
                if not promises:
                    del self._by_key[promise.key]
                return True
        return False

    def falling_due(self, now: float, within_s: float) -> int:
        """Promises not yet kept whose clients may arrive between now and `within_s` from now."""
        self._expire(now)
        count = 0
        for promise in self._queue:
            if promise.due - EARLY_S > now + within_s:
                break
            count += not promise.kept
        return count

    def _expire(self, now: float) -> None:
        queue = self._queue
        while queue and queue[0].due + LATE_S < now:
            promise = queue.popleft()
            if not promise.kept:
                promises = self._by_key.get(promise.key, [])
                if promise in promises:
                    promises.remove(promise)
                if not promises:
                    self._by_key.pop(promise.key, None)
