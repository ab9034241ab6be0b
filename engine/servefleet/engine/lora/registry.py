"""The adapters an engine holds: loaded by name, used by requests, evicted least recently used.

At most `max_loras` adapters are resident, taking at most `max_bytes` together; loading one
more evicts least recently used adapters that no sequence in the engine runs under
(`in_use`, from the engine) until it fits, and an adapter larger than the whole budget is
refused. When every
resident adapter is busy a load is refused (503, retry later) rather than failing requests
mid-generation. A request holds the adapter object it resolved at admission, so one that is
evicted or unloaded while the request is still being prepared finishes under it all the
same. Loading reads files and lays tensors out: the server runs it off the event loop, and
a lock keeps two loads from racing. `on_change` hears of every change of what is resident
(a load, an eviction, an unload): the KV event stream publishes the resident adapters'
identities from it, so the gateway can hash adapter prompts as the engine does.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path

from servefleet.api.lora import LoraConfigError
from servefleet.engine.lora.adapter import LoraAdapter
from servefleet.engine.lora.metrics import LoraMetrics


class AdapterNotFound(KeyError):
    """No adapter of that name is loaded."""


class AdapterSlotsBusy(RuntimeError):
    """Every resident adapter is in use; a new one cannot be loaded now."""


@dataclass
class RegistryStats:
    loads: int = 0
    evictions: int = 0
    load_seconds: float = 0.0
    requests: dict[str, int] = field(default_factory=dict)


Loader = Callable[[str, Path], LoraAdapter]


class LoraRegistry:
    def __init__(
        self,
        max_loras: int,
        loader: Loader,
        in_use: Callable[[], Collection[str]],
        metrics: LoraMetrics | None = None,
        max_bytes: int | None = None,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self.max_loras = max_loras
        self.max_bytes = max_bytes
        self.metrics = metrics
        self._loader = loader
        self._in_use = in_use
        self._on_change = on_change
        self._resident: OrderedDict[str, LoraAdapter] = OrderedDict()  # LRU first
        self._lock = threading.Lock()
        self._load_lock = threading.Lock()
        self.stats = RegistryStats()
        if metrics is not None:
            metrics.track_loaded(lambda: len(self._resident))

    def names(self) -> list[str]:
        with self._lock:
            return list(self._resident)

    def identities(self) -> dict[str, int]:
        """Resident adapter name -> `LoraAdapter.identity` (its KV chain's root)."""
        with self._lock:
            return {name: adapter.identity for name, adapter in self._resident.items()}

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change()

    def get(self, name: str) -> LoraAdapter | None:
        with self._lock:
            return self._resident.get(name)

    def load(self, name: str, directory: Path, replace: bool = False) -> tuple[LoraAdapter, bool]:
        """Load (or find) adapter `name`; returns it and whether this call loaded it.

        An adapter already loaded under the name is kept unless `replace` (vLLM's
        `load_inplace`); the files are read outside the registry lock.
        """
        with self._load_lock:
            current = self.get(name)
            if current is not None and not replace:
                return current, False
            with self._lock:
                self._evictable(exclude=name, incoming=0)  # fail before reading when all busy
            started = time.monotonic()
            adapter = self._loader(name, directory)  # a failed load evicts nothing
            if self.max_bytes is not None and adapter.nbytes > self.max_bytes:
                raise LoraConfigError(
                    f"the adapter takes {adapter.nbytes} bytes, more than --max-lora-memory "
                    f"({self.max_bytes} bytes)"
                )
            with self._lock:
                evicted = self._evictable(exclude=name, incoming=adapter.nbytes)
                for idle in evicted:
                    del self._resident[idle]
                self._resident[name] = adapter
                self._resident.move_to_end(name)
            seconds = time.monotonic() - started
            self._count_load(seconds, len(evicted))
            self._changed()
            return adapter, True

    def _count_load(self, seconds: float, evictions: int) -> None:
        self.stats.loads += 1
        self.stats.load_seconds += seconds
        self.stats.evictions += evictions
        if self.metrics is not None:
            self.metrics.loads.inc()
            self.metrics.load_seconds.observe(seconds)
            self.metrics.evictions.inc(evictions)

    def unload(self, name: str) -> None:
        """Forget an adapter; requests already using it finish with it."""
        with self._lock:
            if self._resident.pop(name, None) is None:
                raise AdapterNotFound(name)
        self._changed()

    def resolve(self, name: str) -> LoraAdapter | None:
        """The adapter a request asked for (None: not loaded), marked recently used."""
        with self._lock:
            adapter = self._resident.get(name)
            if adapter is not None:
                self._resident.move_to_end(name)
                self.stats.requests[name] = self.stats.requests.get(name, 0) + 1
            return adapter

    def _evictable(self, exclude: str, incoming: int) -> list[str]:
        """The least recently used idle adapters to evict so one more (of `incoming` bytes)
        fits under both budgets (lock held)."""
        others = [n for n in self._resident if n != exclude]
        busy = set(self._in_use())
        evicted: list[str] = []
        idle = iter(n for n in others if n not in busy)
        while self._over(others, evicted, incoming):
            victim = next(idle, None)
            if victim is None:
                raise AdapterSlotsBusy(
                    f"every resident adapter is in use: no room under --max-loras "
                    f"{self.max_loras} and --max-lora-memory {self.max_bytes} bytes"
                )
            evicted.append(victim)
        return evicted

    def _over(self, others: list[str], evicted: list[str], incoming: int) -> bool:
        kept = [n for n in others if n not in evicted]
        if len(kept) + 1 > self.max_loras:
            return True
        if self.max_bytes is None:
            return False
        return sum(self._resident[n].nbytes for n in kept) + incoming > self.max_bytes
