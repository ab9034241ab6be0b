"""LoRA adapters on a pool's replicas: loading one where a request needs it, once.

Routing already prefers replicas that hold (or are loading) the request's adapter
(`routing.ReplicaSet.pick`); before a request goes to a replica without it, `ensure` loads it
there through the engine's `POST /v1/load_lora_adapter` (vLLM's endpoint and body, so one
control path drives our engine and vLLM). One load of an adapter at a time per deployment:
requests that need it meanwhile wait for that load instead of starting their own, and find it
done when it was for their replica. A load the engine refuses (a rank above its limit, a
folder that is no adapter) fails the request with a 400 naming the adapter and the engine's
reason, and is remembered for `FAILED_TTL_S`: a burst of requests for a broken adapter makes
one load, not a retry storm. A replica that cannot be reached or answers 5xx is a failure of
the replica (the request moves, as for any request). What each replica holds is refreshed
from its `GET /v1/models` by the probes (`refresh`): engines evict least-recently-used
adapters on their own.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from servefleet.api.gateway_config import GatewayAdapter
from servefleet.api.openai_errors import OpenAIError
from servefleet.gateway.routing import Replica

log = logging.getLogger("servefleet.gateway.adapters")

LOAD_PATH = "/v1/load_lora_adapter"
FAILED_TTL_S = 30.0
"""How long a refused load answers every request for that adapter without a new try."""
LOAD_TIMEOUT_S = 120.0
"""A load reads the adapter from disk (or fetches it): slower than a request's first byte."""
SLOTS_BUSY_WAIT_S = 0.5


class AdapterLoadFailed(OpenAIError):
    """The adapter cannot be served now: the request's fault (its model) or every adapter
    slot busy, never the replica's, which stays in rotation."""


class LoadResponse(Protocol):
    status: int

    async def read(self) -> bytes: ...

    def close(self) -> None: ...


Post = Callable[[str, bytes], Any]
"""`post(url, body)`: awaits a `LoadResponse` (the forwarder's upstream client)."""


class AdapterLoads:
    """Per deployment: the single-flight locks and the refusals remembered."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._locks: dict[str, asyncio.Lock] = {}
        self._refused: dict[str, tuple[float, str]] = {}

    def errors(self) -> dict[str, str]:
        """The adapters whose last load was refused (within `FAILED_TTL_S`), and why."""
        now = self._clock()
        return {name: why for name, (until, why) in self._refused.items() if until > now}

    async def ensure(
        self, replica: Replica, adapter: GatewayAdapter, post: Post, *, deadline_s: float
    ) -> OpenAIError | None:
        """Make `replica` hold `adapter`; an OpenAIError when it cannot: `AdapterLoadFailed`
        (the adapter's fault) or a replica failure (502, the request moves elsewhere)."""
        name = adapter.name
        if name in replica.adapters:
            return None
        lock = self._locks.setdefault(name, asyncio.Lock())
        replica.loading.add(name)
        try:
            async with lock:
                refused = self._refusal(name)
                if refused is not None or name in replica.adapters:
                    return refused
                return await self._load(replica, adapter, post, deadline_s)
        finally:
            replica.loading.discard(name)

    def _refusal(self, name: str) -> AdapterLoadFailed | None:
        refused = self._refused.get(name)
        if refused is None or refused[0] <= self._clock():
            self._refused.pop(name, None)
            return None
        return _refused_error(name, refused[1])

    async def _load(
        self, replica: Replica, adapter: GatewayAdapter, post: Post, deadline_s: float
    ) -> OpenAIError | None:
        started = self._clock()
        body = json.dumps({"lora_name": adapter.name, "lora_path": adapter.path}).encode()
        while True:
            try:
                response = await post(replica.endpoint + LOAD_PATH, body)
                raw = await response.read()
                response.close()
            except Exception as exc:  # unreachable, timed out: the replica's failure
                return self._replica_failed(
                    replica, adapter, started, str(exc) or type(exc).__name__
                )
            status, message, code = response.status, *_error_of(raw)
            if status == 200:
                replica.adapters.add(adapter.name)
                log.info(
                    "adapter_loaded adapter=%s replica=%s seconds=%.3f",
                    adapter.name, replica.endpoint, self._since(started),
                )  # fmt: skip
                return None
            if status == 503 and code == "adapter_slots_busy":
                # Every slot holds an adapter that running requests use: wait for one to free.
                if self._since(started) + SLOTS_BUSY_WAIT_S > deadline_s:
                    return _slots_busy(adapter.name)
                await asyncio.sleep(SLOTS_BUSY_WAIT_S)
                continue
            if 400 <= status < 500:
                self._refused[adapter.name] = (self._clock() + FAILED_TTL_S, message)
                log.warning("adapter_refused adapter=%s reason=%s", adapter.name, message)
                return _refused_error(adapter.name, message)
            return self._replica_failed(replica, adapter, started, f"status {status}: {message}")

    def _replica_failed(
        self, replica: Replica, adapter: GatewayAdapter, started: float, why: str
    ) -> OpenAIError:
        log.warning(
            "adapter_load_failed adapter=%s replica=%s reason=%s",
            adapter.name,
            replica.endpoint,
            why,
        )
        return OpenAIError(
            status=502,
            message=f"The model replica could not load adapter {adapter.name} ({why}).",
            type="upstream_error",
            code="upstream_error",
        )

    def _since(self, started: float) -> float:
        return max(0.0, self._clock() - started)

    @staticmethod
    def forget(replica: Replica, adapter: str) -> None:
        """The replica said it does not have the adapter (evicted since it was loaded)."""
        replica.adapters.discard(adapter)


def refresh(replica: Replica, model_cards: Iterable[Mapping[str, Any]], base_model: str) -> None:
    """What `GET /v1/models` of a replica says it holds: the cards whose parent is the base
    model (vLLM's and our engine's shape). Loads under way are left to `ensure`."""
    held = {
        str(card["id"]) for card in model_cards if card.get("parent") == base_model and "id" in card
    }
    replica.adapters = held | (replica.adapters & replica.loading)


def _error_of(raw: bytes) -> tuple[str, str | None]:
    """(message, code) of an engine's error body; the raw text when it is not OpenAI's shape."""
    try:
        error = json.loads(raw).get("error") or {}
        return str(error.get("message") or "")[:500], error.get("code")
    except (ValueError, AttributeError):
        return raw[:500].decode("utf-8", "replace"), None


def _refused_error(name: str, reason: str) -> AdapterLoadFailed:
    return AdapterLoadFailed(
        status=400,
        message=f"The adapter {name} cannot be loaded: {reason}",
        param="model",
        code="adapter_load_failed",
        headers={"x-should-retry": "false"},
    )


def _slots_busy(name: str) -> AdapterLoadFailed:
    return AdapterLoadFailed(
        status=429,
        message=f"Every adapter slot of the replica is in use; adapter {name} waits for one.",
        type="requests",
        code="adapter_slots_busy",
        headers={"retry-after": "1"},
    )
