"""Fault scenarios on the client side: clients that leave mid-stream, ten times too many
clients, and slow or malicious ones (slowloris heads, a byte-a-second reader)."""

from __future__ import annotations

import asyncio
import json
import time

from servefleet.bench.fault_common import (
    QUEUE_WAIT_BUCKET,
    QUEUE_WAIT_COUNT,
    Scale,
    ScenarioResult,
    charged_tokens,
    engines_idle,
    no_losses,
    poll,
    rss_mb,
    settle,
)
from servefleet.bench.fault_load import LoadResult, Outcome, RequestSpec, closed_loop
from servefleet.bench.fault_stack import TENANTS, Stack, api_key, metric_sum, scrape


def client_disconnect(stack: Stack, scale: Scale) -> ScenarioResult:
    """Clients leave mid-stream: every sequence is aborted and its KV blocks come back, and
    the tenant is charged what it received, not what the engine would have made."""
    result = ScenarioResult("client_disconnect")
    settle(stack)
    before = charged_tokens(stack)
    clients = len(stack.engines) * stack.shape.max_num_seqs
    spec = RequestSpec(
        prompt="Tell a long story about a lighthouse.", max_tokens=400, leave_after_tokens=5
    )
    load = asyncio.run(closed_loop(stack.gateways[0].url, TENANTS[0], clients, scale.seconds, spec))
    idle_after = poll(lambda: engines_idle(stack), timeout_s=30)
    charged = charged_tokens(stack) - before
    delivered = load.tokens_delivered()
    result.figures.update(
        load=load.summary(), seconds_to_idle=idle_after, charged=charged, delivered=delivered
    )
    counts = load.counts()
    result.require(counts[Outcome.LEFT.value] == len(load.records), f"outcomes {counts}")
    result.require(idle_after is not None, "engines still busy or holding KV 30 s after")
    result.require(charged <= delivered, f"charged {charged:g} tokens, delivered {delivered}")
    return result


def overload(stack: Stack, scale: Scale) -> ScenarioResult:
    """Ten times the pool's concurrency: every request is served or refused with a truthful
    Retry-After, admitted requests wait at most maxQueueWait, memory stays bounded."""
    result = ScenarioResult("overload")
    gateway = stack.gateways[0]
    capacity = len(stack.engines) * stack.shape.max_num_seqs
    rss_before = rss_mb(stack.parts())
    waits_before = scrape(gateway.internal_url)
    spec = RequestSpec(max_tokens=8, deadline_s=stack.shape.max_queue_wait_s + 120)
    clients = capacity * scale.overload_factor
    load = asyncio.run(
        closed_loop(
            gateway.url, TENANTS[0], clients, scale.seconds, spec, retry_at_retry_after=True
        )
    )
    no_losses(result, load)
    waits = scrape(gateway.internal_url)
    le = _bucket_at_or_above(waits, stack.shape.max_queue_wait_s)
    within = metric_sum(waits, QUEUE_WAIT_BUCKET, le=le) - metric_sum(
        waits_before, QUEUE_WAIT_BUCKET, le=le
    )
    admitted = metric_sum(waits, QUEUE_WAIT_COUNT) - metric_sum(waits_before, QUEUE_WAIT_COUNT)
    share = (
        load.retries_admitted / load.retries_at_retry_after if load.retries_at_retry_after else 1.0
    )
    result.figures.update(
        clients=clients,
        capacity=capacity,
        admitted=admitted,
        admitted_within_max_queue_wait=within,
        retry_after_admitted_share=round(share, 3),
        rss_mb_before=rss_before,
        rss_mb_after=rss_mb(stack.parts()),
    )
    result.require(within == admitted, f"{admitted - within:g} admitted requests waited longer")
    result.require(share >= 0.9, f"only {share:.0%} of retries at Retry-After were admitted")
    return result


def _bucket_at_or_above(
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], bound: float
) -> str:
    """The `le` label of the smallest queue-wait bucket bound at or above `bound`."""
    bounds = sorted(
        float(dict(labels)["le"])
        for name, labels in samples
        if name == QUEUE_WAIT_BUCKET and float(dict(labels)["le"]) >= bound
    )
    return _prom_float(bounds[0]) if bounds else "+Inf"


def _prom_float(value: float) -> str:
    return "+Inf" if value == float("inf") else repr(float(value))


async def _slowloris(host: str, port: int, seconds: float) -> float | None:
    """Send a request's headers one byte a second; seconds until the server hung up, or None."""
    start = time.monotonic()
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError:
        return 0.0
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 4096
    try:
        for byte in head:
            if time.monotonic() - start > seconds:
                return None
            writer.write(bytes([byte]))
            await writer.drain()
            try:
                if await asyncio.wait_for(reader.read(1024), timeout=1.0) == b"":
                    return round(time.monotonic() - start, 1)
            except TimeoutError:
                continue
        return None
    except (ConnectionError, OSError):
        return round(time.monotonic() - start, 1)
    finally:
        writer.close()


async def _slow_reader(url: str, tenant: str, seconds: float) -> int:
    """A streamed request whose client reads one byte a second; bytes read before the end."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    body = RequestSpec(max_tokens=64).body(0)
    payload = json.dumps(body).encode()
    writer.write(
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
        f"Authorization: Bearer {api_key(tenant)}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    await writer.drain()
    read, stop_at = 0, time.monotonic() + seconds
    while time.monotonic() < stop_at and await reader.read(1):
        read += 1
        await asyncio.sleep(1.0)
    writer.close()
    return read


def slow_clients(stack: Stack, scale: Scale) -> ScenarioResult:
    """Slowloris headers and clients reading a byte a second: each is cut or bounded, memory
    stays flat, and another tenant's requests are served as if they were not there."""
    result = ScenarioResult("slow_clients")
    gateway = stack.gateways[0]
    host, port = gateway.url.removeprefix("http://").split(":")
    # The same normal load alone first: what the gateway holds for it is not the slow clients'.
    asyncio.run(
        closed_loop(gateway.url, TENANTS[1], 3, scale.seconds / 2, RequestSpec(max_tokens=8))
    )
    rss_before = rss_mb([gateway])

    async def run() -> tuple[LoadResult, list[float | None], list[int]]:
        normal = closed_loop(gateway.url, TENANTS[1], 3, scale.seconds, RequestSpec(max_tokens=8))
        loris = asyncio.gather(*(_slowloris(host, int(port), scale.seconds) for _ in range(20)))
        readers = asyncio.gather(
            *(_slow_reader(gateway.url, TENANTS[0], scale.seconds) for _ in range(4))
        )
        load, cut, read = await asyncio.gather(normal, loris, readers)
        return load, list(cut), list(read)

    load, cut_after, read = asyncio.run(run())
    no_losses(result, load)
    growth = rss_mb([gateway]).get(gateway.name, 0.0) - rss_before.get(gateway.name, 0.0)
    result.figures.update(
        slowloris_cut_after_s=cut_after, slow_reader_bytes=read, gateway_rss_growth_mb=growth
    )
    result.require(all(c is not None for c in cut_after), f"slowloris not cut: {cut_after}")
    result.require(growth < 64, f"gateway RSS grew {growth:.0f} MB")
    return result
