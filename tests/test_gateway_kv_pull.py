"""Cross-replica prefix reuse, the gateway's half: a long prompt routed away from the replica
its prefix is affine to names that replica, so the engine pulls the prefix's KV from it."""

from __future__ import annotations

from servefleet.api.gateway_config import GatewayDeployment, RoutingConfig
from servefleet.api.gateway_render import ResolvedSecretKeys, render_gateway_config
from servefleet.api.stream_resume import KV_TRANSFER_PARAMS
from servefleet.gateway.kv_pull import kv_pull_params
from servefleet.gateway.pool import DeploymentPool, Lease, PoolRequest
from servefleet.gateway.queueing import TrafficClass
from tests.test_gateway_render import deployment, resolve

ENDPOINTS = [f"http://10.0.0.{i}:8000" for i in range(3)]


def _pool(slack: int = 0) -> DeploymentPool:
    config = GatewayDeployment.model_validate(
        {
            "name": "d",
            "model": "m",
            "tenants": [{"name": "a"}],
            "pool": {"perReplicaConcurrency": 4},
        }
    )
    pool = DeploymentPool(config, RoutingConfig(affinity_slack=slack))
    pool.set_replicas(ENDPOINTS, ready=ENDPOINTS)
    return pool


async def _lease(pool: DeploymentPool, key: int | None) -> Lease:
    lease = await pool.acquire(PoolRequest("a", TrafficClass.INTERACTIVE, 1.0, 10, key))
    assert isinstance(lease, Lease)
    return lease


async def test_a_request_on_its_affine_replica_names_no_source() -> None:
    pool = _pool()
    first = await _lease(pool, 7)
    assert first.kv_source is None  # it went where its prefix lives
    assert (await _lease(pool, None)).kv_source is None  # no prefix known: no guess


async def test_a_request_sent_away_from_a_busy_affine_replica_names_it() -> None:
    pool = _pool(slack=0)
    first = await _lease(pool, 7)
    second = await _lease(pool, 7)  # the affine replica is one busier than the others now
    assert second.replica is not first.replica
    assert second.kv_source == first.replica.endpoint
    pool.eject(first.replica)  # a replica that is not ready is never named
    third = await _lease(pool, 7)
    assert third.kv_source in (None, second.replica.endpoint)
    assert third.kv_source != first.replica.endpoint


def test_only_long_prompts_carry_the_source_and_never_to_vllm() -> None:
    config = GatewayDeployment.model_validate({"name": "d", "model": "m"})
    lease = Lease.__new__(Lease)
    lease.kv_source, lease.kv_deadline_s = ENDPOINTS[1], None
    assert kv_pull_params(config, lease, 255) == {}
    assert kv_pull_params(config, lease, 256) == {
        KV_TRANSFER_PARAMS: {"kv_sources": [ENDPOINTS[1]], "deadline_s": 2.0}
    }
    lease.kv_source = None
    assert kv_pull_params(config, lease, 4096) == {}
    lease.kv_source, lease.kv_deadline_s = ENDPOINTS[1], None
    off = config.model_copy(update={"kv_pull_min_tokens": None})
    assert kv_pull_params(off, lease, 4096) == {}


def test_rendered_for_servefleet_engines_only() -> None:
    ours, theirs = deployment("ours", "m1"), deployment("theirs", "m2")
    theirs.spec.engine.kind = "vllm"  # only the kind matters here
    rendered = render_gateway_config([ours, theirs], {}, ResolvedSecretKeys(resolve))
    assert [d.kv_pull_min_tokens for d in rendered.deployments] == [256, None]
