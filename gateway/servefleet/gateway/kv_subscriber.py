"""Follow each ready replica's KV cache event stream into its pool's `KVIndex`.

One task per pool (a `PoolTasks` task, so a pool replaced or removed stops being fed), which
keeps one stream per replica that is ready (or ejected: its cache still exists) and drops the
entries of replicas that left. A stream that breaks after it was open is resumed with its
`Last-Event-ID` (the engine answers the missed batches, or a snapshot); a replica that cannot
be reached is dropped from the index until its stream is back, so the index never names a
dead holder for long.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import httpx
from pydantic import ValidationError

from servefleet.api.gateway_stats import ReplicaHealth
from servefleet.api.kv_events import (
    BATCH_EVENT,
    EVENTS_PATH,
    HELLO_EVENT,
    KEEPALIVE_S,
    MAX_EVENT_BYTES,
    SNAPSHOT_EVENT,
    KVEventBatch,
    KVHello,
    KVSnapshot,
)
from servefleet.gateway.kv_index import KVIndex

if TYPE_CHECKING:
    from servefleet.gateway.pool import DeploymentPool

log = logging.getLogger("servefleet.gateway.kv_events")
SYNC_INTERVAL_S = 1.0
MAX_BACKOFF_S = 5.0
FOLLOWED_STATES = (ReplicaHealth.READY, ReplicaHealth.EJECTED)


class StreamBroken(Exception):
    pass


async def read_sse(resp: httpx.Response) -> AsyncIterator[tuple[str, str | None, str]]:
    """(event, id, data) of each Server-Sent Event; an event over MAX_EVENT_BYTES breaks it."""
    event, ident, size = "", None, 0
    data: list[str] = []
    async for line in resp.aiter_lines():
        if not line:
            if data:
                yield event, ident, "\n".join(data)
            event, ident, data, size = "", None, [], 0
        elif line.startswith("data:"):
            size += len(line)
            if size > MAX_EVENT_BYTES:
                raise StreamBroken("event too large")
            data.append(line[5:].lstrip())
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("id:"):
            ident = line[3:].strip()


def apply_event(index: KVIndex, endpoint: str, event: str, data: str) -> None:
    raw = json.loads(data)
    if event == HELLO_EVENT:
        index.hello(endpoint, KVHello.model_validate(raw))
    elif event == SNAPSHOT_EVENT:
        index.snapshot(endpoint, KVSnapshot.model_validate(raw))
    elif event == BATCH_EVENT:
        index.batch(endpoint, KVEventBatch.model_validate(raw))


async def follow(
    client: httpx.AsyncClient, endpoint: str, index: KVIndex, headers: dict[str, str]
) -> None:
    """One replica's stream, until cancelled; returns when the replica has no event stream
    (404: an engine that publishes none), and is then not asked again while it stays."""
    last_id: str | None = None
    failures = 0
    while True:
        opened = False
        try:
            sent = {**headers, **({"last-event-id": last_id} if last_id else {})}
            async with client.stream("GET", endpoint + EVENTS_PATH, headers=sent) as resp:
                if resp.status_code == 404:
                    index.drop(endpoint)
                    return
                if resp.status_code != 200:
                    raise StreamBroken(f"status {resp.status_code}")
                opened, failures = True, 0
                async for event, ident, data in read_sse(resp):
                    apply_event(index, endpoint, event, data)
                    last_id = ident or last_id
        except (httpx.HTTPError, StreamBroken, ValidationError, ValueError) as exc:
            log.debug("kv events of %s: %s", endpoint, exc)
        if not opened:  # unreachable or refusing: what we knew may be gone
            index.drop(endpoint)
            last_id = None
        failures += 1
        await asyncio.sleep(min(MAX_BACKOFF_S, 0.25 * 2 ** min(failures, 5)))


class KVSubscriber:
    """Keeps one `follow` task per followed replica of `pool`."""

    def __init__(self, pool: DeploymentPool) -> None:
        self.pool = pool
        self.tasks: dict[str, asyncio.Task[None]] = {}

    def _headers(self) -> dict[str, str]:
        key = self.pool.config.engine_api_key
        return {"authorization": f"Bearer {key.read()}"} if key is not None else {}

    def sync(self, client: httpx.AsyncClient) -> None:
        replicas = self.pool.replicas.replicas
        wanted = {e for e, r in replicas.items() if r.state in FOLLOWED_STATES}
        for endpoint in [e for e in self.tasks if e not in wanted]:
            self.tasks.pop(endpoint).cancel()
            self.pool.kv_index.drop(endpoint)
        for endpoint in wanted:
            task = self.tasks.get(endpoint)
            if task is None or (task.done() and (task.cancelled() or task.exception())):
                follower = follow(client, endpoint, self.pool.kv_index, self._headers())
                self.tasks[endpoint] = asyncio.create_task(follower, name=f"kv-{endpoint}")
        self.pool.kv_index.keep_only(wanted)

    async def run(self, interval_s: float = SYNC_INTERVAL_S) -> None:
        timeout = httpx.Timeout(5.0, read=3 * KEEPALIVE_S)
        async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:
            try:
                while True:
                    try:
                        self.sync(client)
                    except Exception:  # an unreadable engine key file: try again next round
                        log.exception("following KV events of %s failed", self.pool.name)
                    await asyncio.sleep(interval_s)
            finally:
                tasks = list(self.tasks.values())
                self.tasks.clear()
                for task in tasks:
                    task.cancel()
                for task in tasks:
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await task
