"""How many sequences in the engine run under each adapter: what the registry must not evict.

Written by the engine thread, read by the registry from the server's threads, hence the lock.
"""

from __future__ import annotations

import threading

from servefleet.engine.lora.adapter import LoraAdapter


class AdapterUsage:
    def __init__(self) -> None:
        self._seqs: dict[str, int] = {}
        self._lock = threading.Lock()

    def add(self, adapter: LoraAdapter | None) -> None:
        if adapter is not None:
            with self._lock:
                self._seqs[adapter.name] = self._seqs.get(adapter.name, 0) + 1

    def remove(self, adapter: LoraAdapter | None) -> None:
        if adapter is None:
            return
        with self._lock:
            left = self._seqs.get(adapter.name, 0) - 1
            if left > 0:
                self._seqs[adapter.name] = left
            else:
                self._seqs.pop(adapter.name, None)

    def clear(self) -> None:
        with self._lock:
            self._seqs.clear()

    def names(self) -> set[str]:
        """Adapters some sequence runs under now."""
        with self._lock:
            return set(self._seqs)
