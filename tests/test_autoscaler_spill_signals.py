"""Spill-over as the autoscaler sees it: the gateway counts it, the stats carry it, the policy
weighs it with the deployment's prices."""

from __future__ import annotations

import asyncio

import httpx

from servefleet.api.gateway_config import (
    GatewayDeployment,
    RoutingConfig,
    SecretValueRef,
    TenantAccess,
)
from servefleet.api.gateway_stats import DeploymentStats, parse_deployment_stats
from servefleet.api.llmdeployment import LLMDeploymentSpec, PoolSpec
from servefleet.api.traffic import SpilloverSpec
from servefleet.autoscaler.gateway_fleet import sum_deployment_stats
from servefleet.autoscaler.observe import observe_deployment
from servefleet.autoscaler.policy import Reason, decide
from servefleet.autoscaler.signals import Observation, ReplicaLoad, ReplicaState
from servefleet.autoscaler.spec import targets_from_spec
from servefleet.gateway.pool import DeploymentPool, PoolRequest, Spill
from servefleet.gateway.queueing import TrafficClass


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _spilling_pool(
    clock: Clock, when: dict[str, object] | None = None, cap: int = 16
) -> DeploymentPool:
    """No replica and a long cold start: every interactive request wants to spill."""
    config = GatewayDeployment(
        name="d",
        model="m",
        tenants=[TenantAccess(name="a")],
        cold_start_seconds=600.0,
        pool=PoolSpec(per_replica_concurrency=cap),
        spillover=SpilloverSpec.model_validate(
            {
                "enabled": True,
                "baseURL": "http://hosted.invalid/v1",
                "model": "hosted-m",
                "apiKeySecretRef": {"name": "s", "key": "k"},
                "maxRequestsPerMinute": 100,
            }
            | ({"when": when} if when else {})
        ),
        spillover_api_key=SecretValueRef(env="HOSTED_KEY"),
    )
    return DeploymentPool(config, RoutingConfig(), clock=clock)


def _request(cls: TrafficClass, tokens: int = 300) -> PoolRequest:
    return PoolRequest(tenant="a", traffic_class=cls, weight=1.0, tokens=tokens, affinity_key=None)


async def test_the_pool_reports_its_spill_rate_in_requests_and_tokens() -> None:
    clock = Clock()
    pool = _spilling_pool(clock)
    for _ in range(6):
        placed = await pool.acquire(_request(TrafficClass.INTERACTIVE))
        assert isinstance(placed, Spill)
    stats = pool.stats()
    assert stats.spilled_per_second == 6 / 60  # over the last minute
    assert stats.spilled_tokens_per_second == 6 * 300 / 60
    # On the wire and back (what the autoscaler reads), and summed over two gateways.
    (wire,) = parse_deployment_stats([stats.model_dump(mode="json")]).values()
    both = sum_deployment_stats([{"d": wire}, {"d": wire}])["d"]
    assert (both.spilled_per_second, both.spilled_tokens_per_second) == (0.2, 60.0)
    clock.now += 61
    assert pool.stats().spilled_per_second == 0.0  # a minute later it is history


async def test_batch_class_requests_wait_for_a_busy_pool_instead_of_spilling() -> None:
    clock = Clock()
    pool = _spilling_pool(clock, {"predictedWaitOverSeconds": 0.001}, cap=1)
    pool.set_replicas(["http://r0"], ready=["http://r0"])
    busy = await pool.acquire(_request(TrafficClass.INTERACTIVE))
    assert not isinstance(busy, Spill)  # the one slot
    assert isinstance(await pool.acquire(_request(TrafficClass.INTERACTIVE)), Spill)
    waiting = asyncio.ensure_future(pool.acquire(_request(TrafficClass.BATCH)))
    await asyncio.sleep(0.01)
    assert not waiting.done()  # queued for the busy pool's next free slot, not spilled
    pool.release(busy, ok=True)  # type: ignore[arg-type]
    lease = await waiting
    assert not isinstance(lease, Spill) and lease.replica.endpoint == "http://r0"
    assert pool.stats().spilled_per_second == 1 / 60  # the interactive one only
    # With no replica at all (a hosted-only route) batch requests spill as before.
    assert isinstance(await _spilling_pool(clock).acquire(_request(TrafficClass.BATCH)), Spill)


async def test_batch_queue_waits_are_not_the_latency_the_autoscaler_acts_on() -> None:
    clock = Clock()
    pool = DeploymentPool(
        GatewayDeployment.model_validate(
            {
                "name": "d",
                "model": "m",
                "tenants": [{"name": "a"}],
                "pool": {"perReplicaConcurrency": 1},
            }
        ),
        RoutingConfig(),
        clock=clock,
    )
    pool.set_replicas(["http://r0"], ready=["http://r0"])
    lease = await pool.acquire(_request(TrafficClass.INTERACTIVE))
    waiting = asyncio.ensure_future(pool.acquire(_request(TrafficClass.BATCH)))
    await asyncio.sleep(0)
    clock.now += 30.0  # the batch request waits half a minute for a slot
    pool.release(lease, ok=True)  # type: ignore[arg-type]
    await waiting
    # Interactive requests were served at once; the batch wait is not in the p90.
    assert pool.stats().queue_wait_p90_seconds == 0.0


async def test_observe_carries_the_spill_rate_to_the_policy() -> None:
    stats = DeploymentStats(name="d", spilled_per_second=2.0, spilled_tokens_per_second=900.0)
    async with httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(404))) as c:
        observation = await observe_deployment(client=c, gateway=stats, replicas=[])
    assert (observation.spilled_per_s, observation.spilled_tokens_per_s) == (2.0, 900.0)


def test_the_crd_prices_reach_the_policy_and_decide_rent_or_buy() -> None:
    spec = LLMDeploymentSpec.model_validate(
        {
            "model": {"name": "m", "source": {"builtin": "smollm2-135m-instruct"}},
            "pool": {"minReplicas": 1, "maxReplicas": 8, "scaleDownDelay": 60},
            "autoscaling": {
                "targetPerReplica": 4,
                "prices": {"replicaHour": 2, "spillPerMillionTokens": 1, "spillPatience": 2},
            },
        }
    )
    targets = targets_from_spec(spec, cold_start_s=30)
    assert (targets.replica_cost_per_hour, targets.spill_cost_per_million_tokens) == (2.0, 1.0)
    assert targets.spill_patience == 2.0
    spilling = Observation(
        replicas=(ReplicaLoad(name="r0", state=ReplicaState.READY, running=4),),
        spilled_per_s=2.0,
        spilled_tokens_per_s=1000.0,
        mean_service_s=6.0,
    )
    # 3 replicas for 30 s + 60 s at 2/h = 0.15, twice over (patience 2); 0.01 spent per tick.
    state, reasons = None, []
    for step in range(40):
        d = decide(spilling, targets, now=10.0 * step, state=state)
        state = d.state
        reasons.append(d.reason)
    assert reasons.index(Reason.SPILL_COSTS_MORE) == 30
    unpriced = LLMDeploymentSpec.model_validate(spec.model_dump() | {"autoscaling": {}})
    assert targets_from_spec(unpriced).prices_spill is False
