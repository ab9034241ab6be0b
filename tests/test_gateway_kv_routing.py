"""Routing by the real cache contents: the gateway's KV index, the cost model's decisions, and
the pool sending a request to the replica the model picks (pulling from the holder when that
beats both waiting for the holder and recomputing)."""

from __future__ import annotations

from servefleet.api.gateway_config import GatewayDeployment, RoutingConfig
from servefleet.api.gateway_stats import ReplicaHealth
from servefleet.api.kv_events import KVEventBatch, KVHello, KVSnapshot
from servefleet.api.kv_transfer import hash_hex
from servefleet.api.stream_resume import KV_TRANSFER_PARAMS
from servefleet.gateway.kv_cost import DEFAULT_PROMPT_TPS, ReplicaCost, choose
from servefleet.gateway.kv_index import KVIndex
from servefleet.gateway.kv_pull import kv_pull_params
from servefleet.gateway.kv_route_metrics import KVRouteCollector
from servefleet.gateway.pool import DeploymentPool, Lease, PoolRequest
from servefleet.gateway.queueing import TrafficClass
from servefleet.gateway.routing import Replica, _mix, stable_hash

A, B, C = (f"http://10.0.0.{i}:8000" for i in range(3))
HASHES = tuple(range(1000, 1040))  # a 40-block (640-token) prompt


def hello(blocks: int = 1000, epoch: str = "e1", bpt: int = 46080) -> KVHello:
    return KVHello(epoch=epoch, block_size=16, num_blocks=blocks, bytes_per_token=bpt)


def snap(hashes: tuple[int, ...] | list[int]) -> KVSnapshot:
    return KVSnapshot(seq=1, stored=[(hash_hex(h), hash_hex(0)) for h in hashes])


def test_the_index_finds_each_replicas_longest_cached_prefix() -> None:
    index = KVIndex()
    for endpoint in (A, B, C):
        index.hello(endpoint, hello())
    index.snapshot(A, snap(HASHES[:30]))
    index.snapshot(B, snap(HASHES[:10] + HASHES[11:]))  # a hole at block 10
    index.snapshot(C, snap(HASHES[1:]))  # no first block: no prefix at all
    assert index.held_runs(HASHES) == {A: 30, B: 10}
    assert index.blocks == 30 + 39 + 39
    batch = KVEventBatch(seq=2, ts=0.0, stored=[(hash_hex(HASHES[10]), hash_hex(0))])
    index.batch(B, batch)
    assert index.held_runs(HASHES)[B] == 40
    index.batch(A, KVEventBatch(seq=2, ts=0.0, removed=[hash_hex(HASHES[5])]))
    assert index.held_runs(HASHES)[A] == 5
    index.batch(A, KVEventBatch(seq=3, ts=0.0, cleared=True))
    assert A not in index.held_runs(HASHES)


def test_a_replica_that_leaves_or_restarts_is_dropped() -> None:
    index = KVIndex()
    index.hello(A, hello())
    index.hello(B, hello())
    index.snapshot(A, snap(HASHES))
    index.snapshot(B, snap(HASHES))
    index.keep_only({B})
    assert index.held_runs(HASHES) == {B: 40}
    index.hello(B, hello(epoch="e2"))  # a new process: its old blocks are gone
    assert index.held_runs(HASHES) == {}
    assert index.holders == {}


def test_a_replica_is_believed_only_up_to_its_cache_size() -> None:
    index = KVIndex()
    index.hello(A, hello(blocks=8))
    index.snapshot(A, snap(HASHES))
    assert index.blocks == 8


def _replica(endpoint: str, outstanding_tokens: int = 0) -> Replica:
    replica = Replica(endpoint, cap=4, state=ReplicaHealth.READY)
    replica.outstanding_tokens = outstanding_tokens
    replica.outstanding = 1 if outstanding_tokens else 0
    return replica


def _costs(held: dict[str, int], bpt: int = 46080) -> dict[str, ReplicaCost]:
    return {e: ReplicaCost(held.get(e, 0) * 16, DEFAULT_PROMPT_TPS, bpt, 200e6) for e in (A, B)}


def test_the_cost_model_decision_table() -> None:
    n = len(HASHES) * 16
    idle_holder, idle_other = _replica(A), _replica(B)
    got = choose([idle_holder, idle_other], [idle_holder, idle_other], _costs({A: 40}), n,
                 block_size=16, may_pull=True)  # fmt: skip
    assert got is not None and (got.replica, got.decision) == (idle_holder, "go_to_holder")

    busy_holder = _replica(A, outstanding_tokens=4000)  # ~10 s of prefill queued
    got = choose([busy_holder, idle_other], [busy_holder, idle_other], _costs({A: 40}), n,
                 block_size=16, may_pull=True)  # fmt: skip
    assert got is not None and got.decision == "pull"
    assert (got.replica, got.source) == (idle_other, busy_holder)
    assert got.deadline_s is not None and 0.25 <= got.deadline_s < n / DEFAULT_PROMPT_TPS

    # The same busy holder, but its steps take 2 s: each export window waits for them, so
    # recomputing on the idle replica beats pulling.
    slow = {e: c.__class__(c.held_tokens, c.prompt_tps, c.bytes_per_token, c.pull_bps, 2.0)
            for e, c in _costs({A: 40}).items()}  # fmt: skip
    got = choose([busy_holder, idle_other], [busy_holder, idle_other], slow, n,
                 block_size=16, may_pull=True)  # fmt: skip
    assert got is not None and (got.replica, got.decision) == (idle_other, "recompute")

    got = choose([busy_holder, idle_other], [busy_holder, idle_other], _costs({A: 40}), n,
                 block_size=16, may_pull=False)  # fmt: skip
    assert got is not None and (got.replica, got.decision) == (idle_other, "recompute")

    slightly_busy = _replica(A, outstanding_tokens=40)  # 0.1 s queued: still the holder
    got = choose([slightly_busy, idle_other], [slightly_busy, idle_other], _costs({A: 40}), n,
                 block_size=16, may_pull=True)  # fmt: skip
    assert got is not None and (got.replica, got.decision) == (slightly_busy, "go_to_holder")

    # Three blocks missing are never worth a pull; nothing held at all: no decision.
    got = choose([busy_holder, idle_other], [busy_holder, idle_other],
                 _costs({A: 40, B: 37}), n, block_size=16, may_pull=True)  # fmt: skip
    assert got is not None and got.decision == "recompute" and got.replica is idle_other
    assert choose([idle_holder, idle_other], [idle_holder], _costs({}), n,
                  block_size=16, may_pull=True) is None  # fmt: skip


def _pool() -> DeploymentPool:
    config = GatewayDeployment.model_validate(
        {"name": "d", "model": "m", "tenants": [{"name": "t"}],
         "pool": {"perReplicaConcurrency": 4}}
    )  # fmt: skip
    pool = DeploymentPool(config, RoutingConfig(affinity_slack=8))
    pool.set_replicas([A, B], ready=[A, B])
    for endpoint in (A, B):
        pool.kv_index.hello(endpoint, hello())
    pool.kv_index.snapshot(A, snap(HASHES))
    return pool


async def _lease(pool: DeploymentPool, tokens: int = 700, key: int | None = None) -> Lease:
    request = PoolRequest("t", TrafficClass.INTERACTIVE, 1.0, tokens, key, block_hashes=HASHES)
    lease = await pool.acquire(request)
    assert isinstance(lease, Lease)
    return lease


def _affine_to(endpoint: str, others: list[str]) -> int:
    """A prompt-affinity key whose rendezvous winner is `endpoint`."""
    score = lambda k, e: _mix(k, stable_hash(e))  # noqa: E731
    return next(k for k in range(1000) if all(score(k, endpoint) > score(k, o) for o in others))


async def test_the_pool_routes_by_contents_and_pulls_from_a_busy_holder() -> None:
    pool = _pool()
    # The prompt's characters are affine to B, but A holds its blocks: A gets it.
    first = await _lease(pool, key=_affine_to(B, [A]))
    assert first.replica.endpoint == A and first.kv_source is None
    # A holder with ~10 s of prompt queued: the idle replica pulls the prefix from it,
    # although the affinity rule (slack 8) would have kept it on the holder.
    pool.replicas.replicas[A].outstanding_tokens += 4000
    second = await _lease(pool, key=_affine_to(A, [B]))
    assert second.replica.endpoint == B and second.kv_source == A
    params = kv_pull_params(pool.config, second, len(HASHES) * 16)[KV_TRANSFER_PARAMS]
    assert params["kv_sources"] == [A] and 0 < params["deadline_s"] <= 2.0
    third = await _lease(pool)
    assert third.replica.endpoint in (A, B)
    assert pool.kv_decisions["go_to_holder"] >= 1 and pool.kv_decisions["pull"] >= 1
    collected = {s.labels["decision"]: s.value for m in KVRouteCollector(lambda: [pool]).collect()
                 for s in m.samples if "decision" in s.labels}  # fmt: skip
    assert collected["pull"] >= 1 and collected["local"] == 0


async def test_a_request_without_hashes_keeps_the_affinity_rule() -> None:
    pool = _pool()
    request = PoolRequest("t", TrafficClass.INTERACTIVE, 1.0, 10, 7)
    lease = await pool.acquire(request)
    assert isinstance(lease, Lease) and lease.kv_deadline_s is None
    assert "pull" not in pool.kv_decisions


def test_the_gateway_exposes_decisions_and_index_size() -> None:
    from servefleet.api.gateway_config import ApiKeyRef, GatewayConfig, GatewayTenant, hash_api_key
    from servefleet.gateway.app import Gateway

    tenant = GatewayTenant(name="t", api_keys=[ApiKeyRef(sha256=hash_api_key("k"))])
    config = GatewayConfig(tenants=[tenant], deployments=[_pool().config])
    gateway = Gateway(config)
    pool = gateway.pools["d"]
    pool.kv_decisions["pull"] = 3
    pool.kv_index.hello(A, hello())
    pool.kv_index.snapshot(A, snap(HASHES[:5]))
    text = gateway.render_metrics().decode()
    assert (
        'servefleet_gateway_kv_route_decisions_total{decision="pull",deployment="d",model="m"} 3.0'
        in text
    )
    assert 'servefleet_gateway_kv_index_blocks{deployment="d",model="m"} 5.0' in text
    assert 'servefleet_gateway_kv_events_lag_seconds{deployment="d",model="m"} 0.0' in text
    # a batch the engine published 2.5 s before the gateway applied it
    pool.kv_index.batch(A, KVEventBatch(seq=1, ts=100.0, removed=[hash_hex(HASHES[0])]), 102.5)
    text = gateway.render_metrics().decode()
    assert 'servefleet_gateway_kv_events_lag_seconds{deployment="d",model="m"} 2.5' in text
