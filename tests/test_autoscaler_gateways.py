"""The autoscaler counts every gateway replica's queue and reports it in status.queueDepth."""

from __future__ import annotations

from typing import Any

import httpx

from servefleet.api.gateway_stats import DeploymentStats, GatewayReplicaStats
from servefleet.autoscaler.cluster import ClusterAutoscaler
from servefleet.autoscaler.gateway_fleet import GatewayFleetSource, sum_deployment_stats
from servefleet.autoscaler.telemetry import AutoscalerMetrics
from tests.support.fake_kube import Call, fake_kube

GATEWAY_SLICE = {
    "metadata": {"name": "gw-abc", "namespace": "sys"},
    # The stats are read on the internal port; the tenant port does not serve them.
    "ports": [{"name": "http", "port": 8080}, {"name": "internal", "port": 8090}],
    "endpoints": [
        {"addresses": ["10.0.0.1"], "conditions": {"ready": True}},
        {"addresses": ["10.0.0.2"], "conditions": {"ready": True}},
        {"addresses": ["10.0.0.3"], "conditions": {"ready": False}},  # still syncing routes
    ],
}


def gateway_answer(queue: int, outstanding: int, ttft: float) -> list[dict[str, Any]]:
    replica = {"endpoint": "http://e0:8000", "state": "ready", "outstanding": outstanding}
    # Routes are scoped to their namespace: the gateway names deployment llm of ns "ns/llm".
    return [
        {
            "name": "ns/llm",
            "model": "m",
            "queue_depth": queue,
            "in_flight": outstanding,
            "ttft_p90_seconds": ttft,
            "replicas": [replica],
        }
    ]


def two_gateways() -> httpx.AsyncClient:
    answers = {"10.0.0.1": gateway_answer(3, 2, 0.5), "10.0.0.2": gateway_answer(4, 5, 1.5)}

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/internal/deployments"
        assert request.url.port == 8090
        if request.url.host not in answers:
            return httpx.Response(404)  # an engine's /metrics: not needed here
        return httpx.Response(200, json=answers[request.url.host])

    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


def test_counts_add_up_and_latency_keeps_the_worst_p90() -> None:
    a = DeploymentStats(
        name="d",
        queue_depth=1,
        in_flight=2,
        ttft_p90_seconds=0.2,
        replicas=[GatewayReplicaStats(endpoint="r0", outstanding=2, cap=8)],
    )
    b = DeploymentStats(
        name="d",
        queue_depth=5,
        in_flight=1,
        queue_wait_p90_seconds=1.0,
        replicas=[
            GatewayReplicaStats(endpoint="r0", outstanding=1, cap=8),
            GatewayReplicaStats(endpoint="r1", outstanding=3, cap=8),
        ],
    )
    only_b = DeploymentStats(name="e", queue_depth=2)
    total = sum_deployment_stats([{"d": a}, {"d": b, "e": only_b}])
    assert (total["d"].queue_depth, total["d"].in_flight) == (6, 3)
    assert (total["d"].ttft_p90_seconds, total["d"].queue_wait_p90_seconds) == (0.2, 1.0)
    assert {r.endpoint: r.outstanding for r in total["d"].replicas} == {"r0": 3, "r1": 3}
    assert total["e"].queue_depth == 2


async def test_both_gateways_queues_count() -> None:
    def answer(call: Call) -> tuple[int, Any]:
        assert call.path == "/apis/discovery.k8s.io/v1/namespaces/sys/endpointslices"
        assert call.query["labelSelector"] == "kubernetes.io/service-name=gw"
        return 200, {"metadata": {"resourceVersion": "1"}, "items": [GATEWAY_SLICE]}

    async with fake_kube(answer) as (_, kube), two_gateways() as http:
        source = GatewayFleetSource(kube, "sys", "gw", http)
        assert await source.endpoints() == ["http://10.0.0.1:8090", "http://10.0.0.2:8090"]
        stats = (await source.deployments())["ns/llm"]
    assert (stats.queue_depth, stats.in_flight, stats.ttft_p90_seconds) == (7, 7, 1.5)
    assert [(r.endpoint, r.outstanding) for r in stats.replicas] == [("http://e0:8000", 7)]


def llm_deployment(queue_depth: int) -> dict[str, Any]:
    return {
        "apiVersion": "servefleet.io/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {"name": "llm", "namespace": "ns", "uid": "u1"},
        "spec": {"model": {"name": "m", "source": {"builtin": "smollm2-135m-instruct"}}},
        "status": {"selector": "servefleet.io/llmdeployment=llm", "queueDepth": queue_depth},
    }


async def test_the_summed_queue_is_written_to_status_only_when_it_changes() -> None:
    listed = [llm_deployment(0)]

    def answer(call: Call) -> tuple[int, Any]:
        if call.path.endswith("/endpointslices"):
            return 200, {"items": [GATEWAY_SLICE]}
        if call.path.endswith("/llmdeployments"):
            return 200, {"items": listed}
        if call.path.endswith("/pods"):
            return 200, {"items": []}
        return 200, {"spec": {"replicas": 1}}  # scale, status and events: accepted

    async with fake_kube(answer) as (api, kube), two_gateways() as http:
        gateways = GatewayFleetSource(kube, "sys", "gw", http)
        autoscaler = ClusterAutoscaler(kube, ["ns"], gateways, AutoscalerMetrics(), http)
        await autoscaler.tick()
        listed[0] = llm_deployment(7)  # what the first tick wrote
        await autoscaler.tick()
    status = [c for c in api.calls if c.path.endswith("/llmdeployments/llm/status")]
    assert [(c.method, c.body, c.query) for c in status] == [
        ("PATCH", {"status": {"queueDepth": 7}}, {"fieldManager": "servefleet-autoscaler"})
    ]
    assert status[0].headers["content-type"] == "application/merge-patch+json"


async def test_with_no_namespace_named_every_namespace_is_watched() -> None:
    """With no namespace named, every namespace is watched; and a deployment is matched to
    the gateway's stats by namespace too: team-a's "llm" is not credited with ns's queue."""
    team = llm_deployment(5)
    team["metadata"]["namespace"] = "team-a"

    def answer(call: Call) -> tuple[int, Any]:
        if call.path.endswith("/endpointslices"):
            return 200, {"items": [GATEWAY_SLICE]}
        if call.path.endswith("/llmdeployments"):
            return 200, {"items": [team]}
        if call.path.endswith("/pods"):
            return 200, {"items": []}
        return 200, {"spec": {"replicas": 1}}

    async with fake_kube(answer) as (api, kube), two_gateways() as http:
        gateways = GatewayFleetSource(kube, "sys", "gw", http)
        await ClusterAutoscaler(kube, [], gateways, AutoscalerMetrics(), http).tick()
    paths = [c.path for c in api.calls]
    assert "/apis/servefleet.io/v1alpha1/llmdeployments" in paths  # cluster-wide list
    assert "/api/v1/namespaces/team-a/pods" in paths
    (status,) = [
        c.body
        for c in api.calls
        if c.path == "/apis/servefleet.io/v1alpha1/namespaces/team-a/llmdeployments/llm/status"
    ]
    assert status == {"status": {"queueDepth": 0}}  # ns/llm's 7 queued are not team-a's
