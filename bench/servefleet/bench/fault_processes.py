"""Fault scenarios on the server side: a part of the stack dies or drains under load."""

from __future__ import annotations

import asyncio
import signal
import time

from servefleet.bench.fault_common import (
    IN_FLIGHT,
    LIMITS_DEGRADED,
    Scale,
    ScenarioResult,
    charged_tokens,
    no_losses,
    poll,
    settle,
)
from servefleet.bench.fault_load import LoadResult, Outcome, RequestSpec, burst, closed_loop
from servefleet.bench.fault_stack import (
    CAPPED_TENANT,
    TENANTS,
    Part,
    Stack,
    metric_sum,
    scrape,
    wait_for_replicas,
    wait_ready,
)


def redis_outage(stack: Stack, scale: Scale) -> ScenarioResult:
    """Redis dies under load and comes back: limits go per-replica and back, nothing fails,
    and every token is charged once."""
    result = ScenarioResult("redis_outage")
    gateway = stack.gateways[0]
    settle(stack)
    before = charged_tokens(stack)
    degraded_seen: list[float] = []

    async def fault() -> None:
        await asyncio.sleep(scale.seconds / 3)
        assert stack.redis is not None
        stack.redis.stop()
        await asyncio.sleep(scale.seconds / 3)
        degraded_seen.append(metric_sum(scrape(gateway.internal_url), LIMITS_DEGRADED))
        stack.restart_redis()

    async def run() -> list[LoadResult]:
        spec = RequestSpec(max_tokens=8)
        loads = [closed_loop(gateway.url, t, 3, scale.seconds, spec) for t in TENANTS]
        results = await asyncio.gather(*loads, fault())
        return [r for r in results if isinstance(r, LoadResult)]

    loads = asyncio.run(run())
    merged = LoadResult(records=[r for load in loads for r in load.records])
    no_losses(result, merged)
    recovered = poll(
        lambda: metric_sum(scrape(gateway.internal_url), LIMITS_DEGRADED) == 0, timeout_s=30
    )
    charged = charged_tokens(stack) - before
    delivered = merged.tokens_delivered()
    result.figures.update(
        degraded_during_outage=degraded_seen[:1],
        seconds_to_shared_limits=recovered,
        charged=charged,
        delivered=delivered,
    )
    result.require(degraded_seen == [1.0], f"limits_degraded during the outage: {degraded_seen}")
    result.require(recovered is not None, "limits still degraded 30 s after Redis came back")
    result.require(charged == delivered, f"charged {charged:g} tokens, delivered {delivered}")
    return result


def gateway_kill(stack: Stack, scale: Scale) -> ScenarioResult:
    """One of two gateway replicas is SIGKILLed under load: only the streams it held fail, its
    clients move to the other replica, and the tenant's concurrency slots it held come back."""
    result = ScenarioResult("gateway_kill")
    survivor, victim = stack.gateways[0], stack.gateways[1]
    spec = RequestSpec(max_tokens=32)
    clients = stack.shape.max_num_seqs
    held_at_kill: list[float] = []

    async def fault() -> None:
        await asyncio.sleep(scale.seconds / 3)
        held_at_kill.append(metric_sum(scrape(victim.internal_url), IN_FLIGHT))
        victim.signal(signal.SIGKILL)

    async def run() -> list[LoadResult]:
        loads = [
            closed_loop(survivor.url, CAPPED_TENANT, clients, scale.seconds, spec),
            closed_loop(
                victim.url, CAPPED_TENANT, clients, scale.seconds, spec, fallback_url=survivor.url
            ),
        ]
        results = await asyncio.gather(*loads, fault())
        return [r for r in results if isinstance(r, LoadResult)]

    loads = asyncio.run(run())
    merged = LoadResult(records=[r for load in loads for r in load.records])
    counts = merged.counts()
    failed = counts[Outcome.FAILED.value]
    slots_back = poll(
        lambda: _full_concurrency_admitted(stack, survivor), timeout_s=120, interval_s=2
    )
    result.figures.update(
        load=merged.summary(), streams_held_at_kill=held_at_kill, seconds_to_all_slots=slots_back
    )
    # Each of the killed replica's clients may lose the request it had there, once: it then
    # moves to the other replica. The streams the replica held are part of those.
    result.require(failed <= clients, f"{failed} failed; the killed replica had {clients} clients")
    for bad in (Outcome.HUNG, Outcome.REFUSED_BARE, Outcome.ERROR_EVENT):
        result.require(counts[bad.value] == 0, f"{counts[bad.value]} requests {bad.value}")
    result.require(slots_back is not None, "the killed replica's concurrency slots stayed taken")
    restart_gateway(stack, victim)
    return result


def _full_concurrency_admitted(stack: Stack, gateway: Part) -> bool:
    """Whether the tenant's whole `max_concurrent_requests` is admitted at once right now."""
    limit = stack.shape.max_concurrent_requests
    spec = RequestSpec(max_tokens=24)
    load = asyncio.run(burst(gateway.url, CAPPED_TENANT, limit, spec))
    return load.counts()[Outcome.OK.value] == limit


def restart_gateway(stack: Stack, gateway: Part) -> None:
    gateway.stop()
    gateway.start()
    deadline = time.monotonic() + 60
    wait_ready(gateway, deadline)
    wait_for_replicas(gateway, stack.engines, deadline)


def engine_drain(stack: Stack, scale: Scale) -> ScenarioResult:
    """An engine gets SIGTERM under load, as in a scale-down: it finishes what it holds, the
    gateway stops sending it work, and no request fails; it is started again afterwards."""
    result = ScenarioResult("engine_drain")
    gateway, leaving = stack.gateways[0], stack.engines[-1]

    async def fault() -> None:
        await asyncio.sleep(scale.seconds / 3)
        leaving.signal(signal.SIGTERM)

    async def run() -> LoadResult:
        spec = RequestSpec(max_tokens=32)
        clients = len(stack.engines) * stack.shape.max_num_seqs
        load, _ = await asyncio.gather(
            closed_loop(gateway.url, TENANTS[1], clients, scale.seconds, spec), fault()
        )
        return load

    load = asyncio.run(run())
    no_losses(result, load)
    exited = poll(lambda: not leaving.alive(), timeout_s=60)
    result.figures.update(seconds_to_exit_after_load=exited)
    result.require(exited is not None, "the drained engine did not exit")
    leaving.stop()
    leaving.start()
    deadline = time.monotonic() + stack.shape.ready_timeout_s
    wait_ready(leaving, deadline)
    for each in stack.gateways:
        wait_for_replicas(each, stack.engines, deadline)
    return result
