"""Batch work on spare capacity: batch-class requests never take a replica's last
`admission.interactiveReservedSlots` slots, so an interactive request arriving while a batch
backlog runs is dispatched at once instead of queueing behind it."""

from __future__ import annotations

import asyncio

import pydantic
import pytest

from servefleet.api.gateway_config import GatewayDeployment, RoutingConfig
from servefleet.api.llmdeployment import LLMDeploymentSpec
from servefleet.gateway.pool import DeploymentPool, Lease, PoolRequest
from servefleet.gateway.queueing import TrafficClass

REPLICAS = ["http://r0", "http://r1"]


def pool(cap: int, reserved: int | None = None) -> DeploymentPool:
    admission = {} if reserved is None else {"interactiveReservedSlots": reserved}
    config = GatewayDeployment.model_validate(
        {
            "name": "d",
            "model": "m",
            "tenants": [{"name": "a"}, {"name": "b"}],
            "pool": {"perReplicaConcurrency": cap},
            "admission": {"maxQueueWait": 60, **admission},
        }
    )
    p = DeploymentPool(config, RoutingConfig())
    p.set_replicas(REPLICAS, ready=REPLICAS)
    return p


def request(cls: TrafficClass, tenant: str = "a") -> PoolRequest:
    return PoolRequest(tenant=tenant, traffic_class=cls, weight=1.0, tokens=100, affinity_key=None)


async def fill_with_batch(p: DeploymentPool, n: int) -> tuple[list[Lease], list[asyncio.Task]]:
    """`n` batch requests: the leases granted at once and the tasks still queued."""
    tasks = [asyncio.ensure_future(p.acquire(request(TrafficClass.BATCH))) for _ in range(n)]
    await asyncio.sleep(0.01)
    granted = [t.result() for t in tasks if t.done()]
    assert all(isinstance(g, Lease) for g in granted)
    return granted, [t for t in tasks if not t.done()]  # type: ignore[misc]


async def test_a_batch_backlog_leaves_one_slot_per_replica_to_interactive_requests() -> None:
    p = pool(cap=4)  # the default reserve: one slot per replica
    granted, queued = await fill_with_batch(p, 20)
    assert len(granted) == 2 * 3 and len(queued) == 14  # three of four slots on each replica
    assert {lease.replica.endpoint for lease in granted} == set(REPLICAS)
    assert p.stats().queue_depth_batch == 14
    first = await p.acquire(request(TrafficClass.INTERACTIVE, "b"))
    second = await p.acquire(request(TrafficClass.INTERACTIVE, "b"))
    assert isinstance(first, Lease) and isinstance(second, Lease)
    assert first.queue_wait_s == second.queue_wait_s == 0.0
    assert {first.replica.endpoint, second.replica.endpoint} == set(REPLICAS)
    # The rule is "N slots stay free": while an interactive request holds one of them, a
    # batch slot freed on its replica stays free for the next interactive arrival...
    mine = [lease for lease in granted if lease.replica is first.replica]
    p.release(mine[0], ok=True)
    await asyncio.sleep(0.01)
    assert sum(t.done() for t in queued) == 0
    # ...and once the interactive request ends, the batch backlog takes that slot back.
    p.release(first, ok=True)
    await asyncio.sleep(0.01)
    assert sum(t.done() for t in queued) == 1
    assert first.replica.outstanding == 3
    for task in queued:
        task.cancel()


async def test_a_queued_interactive_request_goes_before_the_batch_backlog() -> None:
    p = pool(cap=2, reserved=1)
    granted, queued = await fill_with_batch(p, 4)
    assert len(granted) == 2 and len(queued) == 2
    taken = [await p.acquire(request(TrafficClass.INTERACTIVE)) for _ in range(2)]
    waiting = asyncio.ensure_future(p.acquire(request(TrafficClass.INTERACTIVE, "b")))
    await asyncio.sleep(0.01)
    assert not waiting.done()  # every slot is held now
    p.release(granted[0], ok=True)  # a batch slot comes free: interactive goes first
    await asyncio.sleep(0.01)
    assert waiting.done() and isinstance(waiting.result(), Lease)
    assert sum(t.done() for t in queued) == 0
    for lease in taken:
        p.release(lease, ok=True)  # type: ignore[arg-type]
    await asyncio.sleep(0.01)
    assert sum(t.done() for t in queued) == 0  # reserved slots again
    for task in queued:
        task.cancel()


async def test_batch_keeps_one_slot_when_the_reserve_is_as_large_as_the_cap() -> None:
    p = pool(cap=2, reserved=5)
    granted, queued = await fill_with_batch(p, 3)
    assert len(granted) == 2 and len(queued) == 1  # one slot per replica: batch still moves
    for task in queued:
        task.cancel()


async def test_with_no_reserve_batch_may_fill_every_slot() -> None:
    p = pool(cap=3, reserved=0)
    granted, queued = await fill_with_batch(p, 6)
    assert len(granted) == 6 and not queued


def test_the_reserve_is_a_validated_spec_field_with_a_default_of_one() -> None:
    model = {"name": "m", "source": {"builtin": "smollm2-135m-instruct"}}
    spec = LLMDeploymentSpec.model_validate({"model": model})
    assert spec.admission.interactive_reserved_slots == 1
    with pytest.raises(pydantic.ValidationError, match="interactiveReservedSlots"):
        LLMDeploymentSpec.model_validate(
            {
                "model": model,
                "admission": {"interactiveReservedSlots": -1},
            }
        )
