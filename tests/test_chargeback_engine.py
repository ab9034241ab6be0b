"""Chargeback on a real engine (SmolLM2): three tenants' requests over HTTP, conservation of
busy + idle against the replica's wall time, and which callers may name a tenant."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from servefleet.api import chargeback as cb
from servefleet.bench import processes
from servefleet.engine.process import BuiltEngine
from servefleet.engine.server import build_app
from tests.support.engine_harness import make_engine

MODEL = "smollm2-135m-instruct"
KEY = "engine-key"
TENANTS = {"ns/small": (1, 4), "ns/medium": (2, 12), "ns/large": (3, 24)}  # requests, tokens


@pytest.fixture(scope="module")
def keyed(smollm2) -> Iterator[tuple[BuiltEngine, float]]:  # type: ignore[no-untyped-def]
    before = time.monotonic()
    built = make_engine(smollm2, max_queue_depth=64)
    built.state.api_key = KEY
    try:
        yield built, before
    finally:
        built.engine.stop()


async def _send(url: str, tenant: str | None, max_tokens: int, key: str | None = KEY) -> int:
    headers = {cb.TENANT_HEADER: tenant} if tenant else {}
    if key:
        headers["authorization"] = f"Bearer {key}"
    body = {"model": MODEL, "prompt": "Count: one two three", "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0}  # fmt: skip
    async with httpx.AsyncClient(timeout=120) as client:
        response = await client.post(f"{url}/v1/completions", json=body, headers=headers)
    return response.status_code


def _busy(built: BuiltEngine) -> dict[str, float]:
    out: dict[str, float] = {}
    for (tenant, _), seconds in built.state.engine.metrics.chargeback.busy.items():
        out[tenant] = out.get(tenant, 0.0) + seconds
    return out


def test_three_tenants_busy_plus_idle_is_the_replica_time(
    keyed: tuple[BuiltEngine, float],
) -> None:
    built, before = keyed
    with processes.serve_in_thread(build_app(built.state), lifespan="off") as url:

        async def traffic() -> list[int]:
            calls = [
                _send(url, tenant, tokens)
                for tenant, (count, tokens) in TENANTS.items()
                for _ in range(count)
            ]
            return list(await asyncio.gather(*calls))

        assert set(asyncio.run(traffic())) == {200}
        time.sleep(0.3)  # some idle after the work
        # A caller without the key cannot claim a tenant: the key middleware refuses it.
        assert asyncio.run(_send(url, "ns/small", 4, key=None)) == 401
        metrics = httpx.get(f"{url}/metrics").text
    busy, idle, replica = built.engine.metrics.chargeback.settle()
    after = time.monotonic()
    assert replica <= after - before  # the replica's seconds are its own wall time
    assert busy > 0 and idle > 0
    assert abs(busy + idle - replica) <= 0.01 * replica
    shares = _busy(built)
    assert set(shares) == set(TENANTS)  # every step billed to a stamped tenant
    assert shares["ns/large"] > shares["ns/medium"] > shares["ns/small"] > 0
    exported = {
        s.labels["tenant"]
        for family in text_string_to_metric_families(metrics)
        for s in family.samples
        if s.name == cb.ENGINE_BUSY_SECONDS + "_total"
    }
    assert exported == set(TENANTS)


def test_an_engine_without_a_key_trusts_no_tenant_header(
    keyed: tuple[BuiltEngine, float],
) -> None:
    built, _ = keyed
    built.state.api_key = None
    try:
        with processes.serve_in_thread(build_app(built.state), lifespan="off") as url:
            assert asyncio.run(_send(url, "ns/forged", 3, key=None)) == 200
    finally:
        built.state.api_key = KEY
    shares = _busy(built)
    assert "ns/forged" not in shares and shares[cb.UNATTRIBUTED] > 0
