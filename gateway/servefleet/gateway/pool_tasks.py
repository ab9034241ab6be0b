"""The background work that feeds a pool: its tokenizer load and its EndpointSlice watch.

Kept per pool, so a pool replaced or removed on reconfigure stops being fed, and a new one
starts, without touching the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from servefleet.gateway.discovery import EndpointSliceWatcher
from servefleet.gateway.kv_subscriber import KVSubscriber
from servefleet.gateway.pool import DeploymentPool
from servefleet.kube import KubeAccess

log = logging.getLogger("servefleet.gateway")


class PoolTasks:
    def __init__(self, kubernetes: KubeAccess | None) -> None:
        self._kubernetes = kubernetes
        self._tasks: dict[str, list[asyncio.Task[None]]] = {}  # by deployment name

    def start(self, pool: DeploymentPool) -> None:
        tasks = self._tasks.setdefault(pool.name, [])
        if pool.config.tokenizer is not None and pool.token_counter is None:
            tasks.append(asyncio.create_task(_load_tokenizer(pool), name=f"tokens-{pool.name}"))
        if pool.config.service is not None:
            tasks.append(asyncio.create_task(self._watch(pool), name=f"watch-{pool.name}"))
        if pool.config.kv_pull_min_tokens is not None:  # our engines publish KV cache events
            follow = KVSubscriber(pool).run()
            tasks.append(asyncio.create_task(follow, name=f"kv-events-{pool.name}"))

    def cancel(self, name: str) -> None:
        for task in self._tasks.pop(name, []):
            task.cancel()

    async def stop(self) -> None:
        tasks = [t for ts in self._tasks.values() for t in ts]
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _watch(self, pool: DeploymentPool) -> None:
        assert pool.config.service is not None
        watcher = EndpointSliceWatcher(self._kubernetes, pool.config.service)
        await watcher.run(lambda endpoints, ready: pool.set_replicas(endpoints, ready))


async def _load_tokenizer(pool: DeploymentPool) -> None:
    """Exact prompt counts once the tokenizer is loaded; the estimate until then."""
    source = pool.config.tokenizer
    assert source is not None
    try:
        from servefleet.gateway.token_counter import load_token_counter

        pool.token_counter = await asyncio.to_thread(load_token_counter, source)
    except Exception as exc:  # not available here: the fast estimate stays
        log.warning(
            "deployment %s: tokenizer %s not loaded (%s); prompt tokens are estimated",
            pool.name,
            source,
            exc,
        )
    else:
        log.info("deployment %s: counting prompt tokens with %s", pool.name, source)
