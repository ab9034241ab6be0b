"""Replica readiness: every replica's ready path (its engine adapter's), asked once an interval.

A 200 makes a starting (or draining) replica ready; anything else marks a ready one draining.
An ejected replica is left alone until its back-off ends: the trial request decides then.
A ready replica of a pool with LoRA adapters is also asked which adapters it holds
(`GET /v1/models`), since engines evict them on their own. A starting replica that answers
503 `kv-warming` is asked once to warm its cache from its ready peers (`kv_warm`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

import httpx

from servefleet.gateway.adapter_loads import refresh
from servefleet.gateway.kv_warm import WarmAsker, is_warming
from servefleet.gateway.pool import DeploymentPool
from servefleet.gateway.routing import Replica

log = logging.getLogger("servefleet.gateway.probes")

PROBE_TIMEOUT_S = 2.0
MODELS_PATH = "/v1/models"


class ReplicaProber:
    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._client: httpx.AsyncClient | None = None
        self.warm = WarmAsker()

    def open(self) -> None:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=PROBE_TIMEOUT_S, trust_env=False)

    async def close(self) -> None:
        await self.warm.close()
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def run(self, pools: Callable[[], Iterable[DeploymentPool]], interval_s: float) -> None:
        """Probe the pools current at each round (they change on reconfigure) until cancelled."""
        while True:
            try:
                await self.probe_once(pools())
            except Exception:  # a probe round must never kill the loop
                log.exception("replica probing failed")
            await asyncio.sleep(interval_s)

    async def probe_once(self, pools: Iterable[DeploymentPool]) -> None:
        client = self._client
        if client is None:
            return
        now = self._clock()
        pairs = [(p, r) for p in pools for r in list(p.replicas.replicas.values())]
        jobs = [self._probe(client, p, r) for p, r in pairs if r.ejected_until <= now]
        if jobs:
            await asyncio.gather(*jobs)
        self.warm.forget_gone(r for _, r in pairs)

    async def _probe(
        self, client: httpx.AsyncClient, pool: DeploymentPool, replica: Replica
    ) -> None:
        try:
            resp = await client.get(
                replica.endpoint + pool.config.ready_path, timeout=PROBE_TIMEOUT_S
            )
            ready = resp.status_code == 200
        except httpx.HTTPError:
            resp, ready = None, False
        pool.probe_result(replica, ready)
        if resp is not None and is_warming(resp):
            self.warm.ask(client, pool, replica)
        if ready and pool.config.adapters:
            await _refresh_adapters(client, pool, replica)


async def _refresh_adapters(
    client: httpx.AsyncClient, pool: DeploymentPool, replica: Replica
) -> None:
    """Which adapters the replica holds now (it evicts least-recently-used ones itself)."""
    key = pool.config.engine_api_key
    headers = {"authorization": f"Bearer {key.read()}"} if key is not None else {}
    try:
        resp = await client.get(replica.endpoint + MODELS_PATH, headers=headers)
        cards = resp.json()["data"] if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        cards = None
    if isinstance(cards, list):
        refresh(replica, (c for c in cards if isinstance(c, dict)), pool.model)
