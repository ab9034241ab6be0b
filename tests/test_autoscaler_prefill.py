"""The prefill pool of a disaggregated deployment is scaled from its prompt-token signal,
by a merge patch of spec.disaggregation.prefill.replicas; the decode pool is not touched."""

from __future__ import annotations

from typing import Any

import httpx

from servefleet.api.disaggregation import PrefillPoolSpec
from servefleet.api.gateway_stats import DeploymentStats, parse_deployment_stats
from servefleet.autoscaler.cluster import ClusterAutoscaler
from servefleet.autoscaler.gateway_fleet import sum_deployment_stats
from servefleet.autoscaler.prefill import PrefillState, decide_prefill, needed_replicas
from servefleet.autoscaler.telemetry import AutoscalerMetrics
from tests.support.fake_kube import Call, fake_kube

POOL = PrefillPoolSpec(min_replicas=1, max_replicas=4, replicas=2, prompt_tokens_per_replica=1000)


def test_needed_replicas_is_tokens_over_the_target_within_the_bounds() -> None:
    assert needed_replicas(0, POOL) == 1
    assert needed_replicas(1000, POOL) == 1
    assert needed_replicas(1001, POOL) == 2
    assert needed_replicas(99_000, POOL) == 4


def test_up_at_once_down_after_the_delay_unknown_holds() -> None:
    up = decide_prefill(3500, POOL, 60.0, now=0.0, state=PrefillState())
    assert (up.current, up.desired) == (2, 4)
    unknown = decide_prefill(None, POOL, 60.0, now=0.0, state=PrefillState())
    assert unknown.desired == 2
    low = decide_prefill(100, POOL, 60.0, now=10.0, state=PrefillState())
    assert low.desired == 2 and low.state.low_since == 10.0
    still = decide_prefill(100, POOL, 60.0, now=50.0, state=low.state)
    assert still.desired == 2
    down = decide_prefill(100, POOL, 60.0, now=70.0, state=still.state)
    assert down.desired == 1 and down.state.low_since is None
    # demand back at the target resets the wait
    back = decide_prefill(1500, POOL, 60.0, now=65.0, state=low.state)
    assert back.desired == 2 and back.state.low_since is None


def test_the_signal_is_queued_plus_running_and_unknown_without_either() -> None:
    assert DeploymentStats(name="d").prefill_prompt_tokens is None
    stats = DeploymentStats(name="d", prefill_prompt_tokens_queued=300)
    assert stats.prefill_prompt_tokens == 300
    stats = parse_deployment_stats(
        [{"name": "d", "prefill_prompt_tokens_queued": 3, "prefill_prompt_tokens_running": 4}]
    )["d"]
    assert stats.prefill_prompt_tokens == 7


def test_gateways_sum_only_when_every_one_reports_it() -> None:
    a = DeploymentStats(name="d", prefill_prompt_tokens_queued=10, prefill_prompt_tokens_running=1)
    b = DeploymentStats(name="d", prefill_prompt_tokens_queued=5, prefill_prompt_tokens_running=2)
    old = DeploymentStats(name="d")  # a gateway one version behind, mid-upgrade
    assert sum_deployment_stats([{"d": a}, {"d": b}])["d"].prefill_prompt_tokens == 18
    assert sum_deployment_stats([{"d": a}, {"d": old}])["d"].prefill_prompt_tokens is None


def pd_deployment(replicas: int) -> dict[str, Any]:
    return {
        "apiVersion": "servefleet.io/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {"name": "llm", "namespace": "ns", "uid": "u1"},
        "spec": {
            "model": {"name": "m", "source": {"builtin": "smollm2-135m-instruct"}},
            "replicas": 1,
            "disaggregation": {
                "prefill": {"replicas": replicas, "maxReplicas": 3, "promptTokensPerReplica": 100}
            },
        },
        "status": {"selector": "servefleet.io/llmdeployment=llm"},
    }


class OneGateway:
    def __init__(self, stats: DeploymentStats) -> None:
        self.stats = stats

    async def deployments(self) -> dict[str, DeploymentStats]:
        return {"ns/llm": self.stats}


async def run_tick(stats: DeploymentStats, metrics: AutoscalerMetrics | None = None) -> list[Call]:
    def answer(call: Call) -> tuple[int, Any]:
        if call.path.endswith("/llmdeployments"):
            return 200, {"items": [pd_deployment(1)]}
        if call.path.endswith("/pods"):
            return 200, {"items": []}
        return 200, {"spec": {"replicas": 1}}

    async with fake_kube(answer) as (api, kube), httpx.AsyncClient() as http:
        gateway = OneGateway(stats)
        autoscaler = ClusterAutoscaler(kube, ["ns"], gateway, metrics or AutoscalerMetrics(), http)
        await autoscaler.tick()
    return api.calls


async def test_the_cluster_autoscaler_patches_the_prefill_replicas_from_the_signal() -> None:
    metrics = AutoscalerMetrics()
    stats = DeploymentStats(name="ns/llm", prefill_prompt_tokens_queued=250)
    calls = await run_tick(stats, metrics)
    text = metrics.render().decode()
    assert 'servefleet_autoscaler_prefill_desired_replicas{deployment="ns/llm"} 3.0' in text
    assert 'servefleet_autoscaler_prefill_prompt_tokens{deployment="ns/llm"} 250.0' in text
    spec_patches = [
        c for c in calls if c.method == "PATCH" and c.path.endswith("/llmdeployments/llm")
    ]
    (patch,) = spec_patches
    assert patch.body == {"spec": {"disaggregation": {"prefill": {"replicas": 3}}}}
    assert patch.query == {"fieldManager": "servefleet-autoscaler"}
    assert patch.headers["content-type"] == "application/merge-patch+json"
    # the decode pool's scale is the usual policy's (demand 0 at 1 replica: no change)
    assert not any(c.path.endswith("/scale") and c.method == "PATCH" for c in calls)


async def test_without_the_signal_the_prefill_pool_is_held() -> None:
    calls = await run_tick(DeploymentStats(name="ns/llm"))
    assert not any(c.method == "PATCH" and c.path.endswith("/llmdeployments/llm") for c in calls)
