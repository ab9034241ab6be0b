"""Scraping (vLLM, SGLang, our engine, the gateway) and the Kubernetes actuator's requests."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from servefleet.api.gateway_stats import parse_deployment_stats
from servefleet.autoscaler.actuate import KubernetesActuator
from servefleet.autoscaler.cluster import replica_from_pod
from servefleet.autoscaler.engine_metrics import MetricsFormatError, parse_engine_load
from servefleet.autoscaler.observe import ReplicaTarget, observe_deployment
from servefleet.autoscaler.policy import Decision, PolicyState, Reason, decide
from servefleet.autoscaler.signals import Observation, ReplicaLoad, ReplicaState
from servefleet.autoscaler.targets import ScalingTargets
from servefleet.autoscaler.telemetry import AutoscalerMetrics
from tests.support.fake_kube import Call, fake_kube

VLLM = """# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="a"} 3.0
vllm:num_requests_waiting{model_name="b"} 100.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="a"} 5.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="a"} 0.5
"""
SGLANG = """sglang:num_queue_reqs{model_name="a"} 2
sglang:num_running_reqs{model_name="a"} 7
sglang:token_usage{model_name="a"} 0.75
"""


def test_vllm_and_sglang_names_read_the_same_numbers() -> None:
    v = parse_engine_load(VLLM, "vllm", model_name="a")
    assert (v.waiting, v.running, v.kv_cache_usage) == (3, 5, 0.5)
    assert parse_engine_load(VLLM, "servefleet", model_name="a") == v
    s = parse_engine_load(SGLANG, "sglang")
    assert (s.waiting, s.running, s.kv_cache_usage) == (2, 7, 0.75)
    assert parse_engine_load(VLLM, "vllm").waiting == 103  # all models when none is named


def test_missing_series_and_unknown_kinds_are_errors() -> None:
    with pytest.raises(MetricsFormatError, match="sglang:num_queue_reqs"):
        parse_engine_load(VLLM, "sglang")
    with pytest.raises(ValueError, match="unknown engine kind"):
        parse_engine_load(VLLM, "tgi")


async def test_observe_combines_gateway_queue_and_engine_metrics() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "r0":
            return httpx.Response(200, text=VLLM)
        return httpx.Response(500)  # r1's /metrics is down

    gateway = parse_deployment_stats(
        [
            {
                "name": "d",
                "queue_depth": 4,
                "replicas": [{"endpoint": "http://r1:8000", "state": "ready", "outstanding": 6}],
                "unrelated": True,
            }
        ]
    )["d"]
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        obs = await observe_deployment(
            client=client,
            gateway=gateway,
            replicas=[
                ReplicaTarget(name="r0", base_url="http://r0:8000", state=ReplicaState.READY),
                ReplicaTarget(name="r1", base_url="http://r1:8000", state=ReplicaState.READY),
                ReplicaTarget(name="r2", base_url="http://r2:8000", state=ReplicaState.STARTING),
            ],
            engine_kind="vllm",
            model_name="a",
        )
    loads = {r.name: r for r in obs.replicas}
    assert loads["r0"].in_flight == 8 and loads["r0"].kv_cache_usage == 0.5
    assert loads["r1"].running == 6  # a failed scrape falls back to the gateway's count
    assert loads["r2"].state is ReplicaState.STARTING
    assert obs.demand == 4 + 8 + 6


def test_pods_map_to_replica_states() -> None:
    def pod(name: str, ready: bool, deleting: bool = False) -> dict:
        meta: dict = {"name": name}
        if deleting:
            meta["deletionTimestamp"] = "2024-01-01T00:00:00Z"
        return {
            "metadata": meta,
            "spec": {"containers": [{"ports": [{"name": "http", "containerPort": 9000}]}]},
            "status": {
                "podIP": "10.0.0.1",
                "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            },
        }

    assert replica_from_pod(pod("a", True)).state is ReplicaState.READY  # type: ignore[union-attr]
    assert replica_from_pod(pod("b", False)).state is ReplicaState.STARTING  # type: ignore[union-attr]
    gone = replica_from_pod(pod("c", True, deleting=True))
    assert gone is not None and gone.state is ReplicaState.DRAINING
    assert gone.base_url == "http://10.0.0.1:9000"
    # No address yet: scheduled and starting, or unschedulable (pending, with patience).
    starting = replica_from_pod({"metadata": {"name": "x"}, "status": {}})
    assert starting is not None and starting.state is ReplicaState.STARTING
    unschedulable = {"conditions": [{"type": "PodScheduled", "status": "False"}]}
    pending = replica_from_pod({"metadata": {"name": "y"}, "status": unschedulable})
    assert pending is not None and pending.state is ReplicaState.PENDING
    deleted = {"name": "z", "deletionTimestamp": "2024-01-01T00:00:00Z"}
    assert replica_from_pod({"metadata": deleted, "status": {}}) is None
    # An IPv6 pod: a URL (in brackets), the same string the gateway names that replica by.
    v6 = pod("d", True)
    v6["status"]["podIP"] = "fd00:10:244::8"
    assert replica_from_pod(v6).base_url == "http://[fd00:10:244::8]:9000"  # type: ignore[union-attr]


async def test_an_unreadable_gateway_is_unknown_not_an_empty_queue() -> None:
    def no_engine(request: httpx.Request) -> httpx.Response:
        raise AssertionError(f"pending replicas are not scraped: {request.url}")

    pending = ReplicaTarget(name="p", base_url="", state=ReplicaState.PENDING)
    async with httpx.AsyncClient(transport=httpx.MockTransport(no_engine)) as client:
        unread = await observe_deployment(
            client=client, gateway=None, replicas=[pending], gateway_known=False
        )
        read = await observe_deployment(client=client, gateway=None, replicas=[pending])
    assert unread.unknown == ("gateway",) and read.unknown == ()
    assert [r.state for r in unread.replicas] == [ReplicaState.PENDING]


async def test_kubernetes_actuator_annotates_scales_and_explains() -> None:
    def answer(call: Call) -> tuple[int, Any]:
        return 200, {"spec": {"replicas": 3}} if call.method == "GET" else {}

    replicas = (
        ReplicaLoad(name="p0", state=ReplicaState.READY, running=5),
        ReplicaLoad(name="p1", state=ReplicaState.READY, running=0, kv_cache_usage=0.1),
        ReplicaLoad(name="p2", state=ReplicaState.READY, running=2),
    )
    obs = Observation(replicas=replicas)
    # What the policy says for this pool (its own tests pin that down): one fewer, p1 goes.
    decision = Decision(
        desired=2,
        current=3,
        reason=Reason.SCALE_DOWN,
        victim="p1",
        demand=7,
        state=PolicyState(),
        message="down 3→2: demand 7 fits 2 replicas for 300 s",
    )
    async with fake_kube(answer) as (api, kube):
        await KubernetesActuator(kube, "ns").apply("llm", decision, obs)

    calls = [(c.method, c.path, c.body or {}) for c in api.calls]
    # The ranking goes to status.podDeletionCosts (the operator annotates the pods from it):
    # the autoscaler never writes a pod.
    assert not any("/pods" in path for method, path, _ in calls if method != "GET")
    (ranking,) = [
        body["status"]["podDeletionCosts"]
        for method, path, body in calls
        if method == "PATCH" and path.endswith("/llm/status")
    ]
    assert {r["pod"]: r["cost"] for r in ranking} == {"p1": -1, "p2": 1, "p0": 2}
    scale = [b for m, p, b in calls if m == "PATCH" and p.endswith("/llm/scale")]
    assert scale == [{"spec": {"replicas": 2}}]
    assert {c.query["fieldManager"] for c in api.calls if c.method == "PATCH"} == {
        "servefleet-autoscaler"
    }
    assert calls[-1][1] == "/api/v1/namespaces/ns/events"
    event = calls[-1][2]
    assert event["involvedObject"]["kind"] == "LLMDeployment"
    assert event["message"] == (
        "replicas 3 -> 2: down 3→2: demand 7 fits 2 replicas for 300 s "
        "(reason scale_down, demand 7, victim p1)"
    )
    order = [p for _, p, _ in calls]
    # Ranked before the scale is lowered: the operator reconciles the scale with it.
    assert order.index("/apis/servefleet.io/v1alpha1/namespaces/ns/llmdeployments/llm/status") < (
        order.index("/apis/servefleet.io/v1alpha1/namespaces/ns/llmdeployments/llm/scale", 1)
    )


async def test_kubernetes_actuator_leaves_an_unchanged_pool_alone() -> None:
    obs = Observation(replicas=(ReplicaLoad(name="p0", state=ReplicaState.READY),))
    targets = ScalingTargets(min_replicas=1, max_replicas=3, target_per_replica=4)
    async with fake_kube(lambda call: (200, {"spec": {"replicas": 1}})) as (api, kube):
        await KubernetesActuator(kube, "ns").apply("llm", decide(obs, targets, now=0), obs)
    assert api.calls == []


def test_every_decision_is_a_metric() -> None:
    metrics = AutoscalerMetrics()
    targets = ScalingTargets(min_replicas=1, max_replicas=3, target_per_replica=4)
    obs = Observation(gateway_queued=9, replicas=(ReplicaLoad(name="a", state=ReplicaState.READY),))
    metrics.record("llm", decide(obs, targets, now=0))
    text = metrics.render().decode()
    assert 'servefleet_autoscaler_desired_replicas{deployment="llm"} 3.0' in text
    assert 'servefleet_autoscaler_current_replicas{deployment="llm"} 1.0' in text
    assert 'servefleet_autoscaler_reason{deployment="llm",reason="demand"} 1.0' in text
    assert 'servefleet_autoscaler_reason{deployment="llm",reason="steady"} 0.0' in text
