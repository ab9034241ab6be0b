"""Scale-up warm start, the gateway's half: a replica whose readiness probe answers 503
`kv-warming` is asked, once, to pull its ready peers' hottest prefixes
(`POST /internal/kv/warm`), so the first requests it gets after a scale-up are cache hits.

The sources are the pool's other ready replicas, least busy first (each export takes a
slot of the source's engine thread between steps), at most `MAX_SOURCES`; a pool with no
ready replica sends an empty list, which makes the engine ready at once (the first replica
of a pool never waits for peers that do not exist). The call runs beside the probe loop and
its answer is only logged: the engine's `/ready` says when it is done, and an engine that
is never asked is ready after its own bound (`--kv-warm-start-seconds`). How much it pulls
and for how long is the deployment's `spec.kvWarmStart`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

import httpx

from servefleet.api.gateway_stats import ReplicaHealth
from servefleet.api.kv_transfer import MAX_SOURCES
from servefleet.api.kv_warm import WARM_PATH, WARMING_DETAIL
from servefleet.gateway.pool import DeploymentPool
from servefleet.gateway.routing import Replica, ReplicaSet

log = logging.getLogger("servefleet.gateway.kv_warm")


def is_warming(resp: httpx.Response) -> bool:
    """A readiness answer that says the engine waits to be warmed."""
    if resp.status_code != 503:
        return False
    try:
        body = resp.json()
    except ValueError:
        return False
    return isinstance(body, dict) and body.get("detail") == WARMING_DETAIL


def warm_sources(replicas: ReplicaSet, warming: Replica) -> list[str]:
    """The ready replicas other than `warming`, least busy first, at most MAX_SOURCES."""
    ready = [
        r for r in replicas.replicas.values() if r is not warming and r.state is ReplicaHealth.READY
    ]
    ready.sort(key=lambda r: (r.outstanding / max(1, r.cap), -r.served))
    return [r.endpoint for r in ready[:MAX_SOURCES]]


class WarmAsker:
    """Asks each warming replica (this object of it: a restart is a new one) once."""

    def __init__(self) -> None:
        self._asked: dict[str, Replica] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def ask(self, client: httpx.AsyncClient, pool: DeploymentPool, replica: Replica) -> bool:
        """Start a warm call to `replica` unless it was asked already; whether one started."""
        if self._asked.get(replica.endpoint) is replica:
            return False
        self._asked[replica.endpoint] = replica
        sources = warm_sources(pool.replicas, replica)
        task = asyncio.create_task(_post_warm(client, pool, replica, sources))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    def forget_gone(self, current: Iterable[Replica]) -> None:
        """Drop what it remembers of replicas no pool has any more."""
        alive = {id(r) for r in current}
        for endpoint, replica in list(self._asked.items()):
            if id(replica) not in alive:
                del self._asked[endpoint]

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def _post_warm(
    client: httpx.AsyncClient, pool: DeploymentPool, replica: Replica, sources: list[str]
) -> None:
    key = pool.config.engine_api_key
    headers = {"authorization": f"Bearer {key.read()}"} if key is not None else {}
    sizes = pool.config.kv_warm  # spec.kvWarmStart
    body = {
        "sources": sources,
        "max_blocks": sizes.max_blocks,
        "deadline_s": sizes.deadline_seconds,
    }
    try:
        resp = await client.post(
            replica.endpoint + WARM_PATH,
            json=body,
            headers=headers,
            timeout=sizes.deadline_seconds + 5.0,
        )
        log.info(
            "kv_warm replica=%s sources=%d status=%d answer=%s",
            replica.endpoint, len(sources), resp.status_code, resp.text[:200],
        )  # fmt: skip
    except httpx.HTTPError as exc:
        log.info("kv_warm replica=%s failed: %r", replica.endpoint, exc)
