"""`status.loadedReplicas` and `Loaded` of LLMAdapters, from what the gateways hold."""

from __future__ import annotations

from typing import Any

import httpx

from servefleet.api.gateway_stats import DeploymentStats, GatewayReplicaStats
from servefleet.api.llmadapter import LLMAdapter
from servefleet.autoscaler.adapter_status import adapter_status_patch
from servefleet.autoscaler.cluster import ClusterAutoscaler
from servefleet.autoscaler.gateway_fleet import sum_deployment_stats
from servefleet.autoscaler.telemetry import AutoscalerMetrics
from tests.support.fake_kube import Call, fake_kube

NOW = "2026-11-27T00:00:00Z"
PODS = {"http://10.0.0.1:8000": "smol-engine-a", "http://10.0.0.2:8000": "smol-engine-b"}


def adapter(accepted: str = "True", **status: Any) -> LLMAdapter:
    conditions = [{"type": "Accepted", "status": accepted, "reason": "Fits"}]
    return LLMAdapter.model_validate(
        {
            "metadata": {"name": "fox", "namespace": "team"},
            "spec": {
                "deployment": "smol",
                "source": {"huggingface": {"repo": "org/fox"}},
            },
            "status": {"conditions": conditions, **status},
        }
    )


def stats(held: dict[str, list[str]], errors: dict[str, str] | None = None) -> DeploymentStats:
    replicas = [GatewayReplicaStats(endpoint=e, adapters=names) for e, names in held.items()]
    return DeploymentStats(name="team/smol", replicas=replicas, adapter_load_errors=errors or {})


def test_held_adapters_name_their_pods_and_say_loaded() -> None:
    patch = adapter_status_patch(
        adapter(), stats({"http://10.0.0.2:8000": ["fox"], "http://10.0.0.1:8000": []}), PODS, NOW
    )
    assert patch is not None
    status = patch["status"]
    assert status["loadedReplicas"] == ["smol-engine-b"]
    loaded = status["conditions"][-1]
    assert (loaded["type"], loaded["status"], loaded["reason"]) == ("Loaded", "True", "Loaded")
    assert status["conditions"][0]["type"] == "Accepted"  # the operator's condition is kept


def test_a_refused_load_is_loaded_false_with_the_engines_reason() -> None:
    why = "r 128 is above the engine's --max-lora-rank 64"
    patch = adapter_status_patch(adapter(), stats({}, {"fox": why}), PODS, NOW)
    assert patch is not None
    loaded = patch["status"]["conditions"][-1]
    assert (loaded["status"], loaded["reason"], loaded["message"]) == ("False", "LoadFailed", why)


def test_nothing_is_written_when_nothing_changed_or_the_adapter_is_refused() -> None:
    current = adapter(
        loadedReplicas=["smol-engine-a"],
        conditions=[
            {"type": "Accepted", "status": "True", "reason": "Fits"},
            {
                "type": "Loaded",
                "status": "True",
                "reason": "Loaded",
                "message": "held by 1 replica(s)",
            },
        ],
    )
    view = stats({"http://10.0.0.1:8000": ["fox"]})
    assert adapter_status_patch(current, view, PODS, NOW) is None
    assert adapter_status_patch(adapter(accepted="False"), view, PODS, NOW) is None


def test_gateways_views_are_merged() -> None:
    one = stats({"http://10.0.0.1:8000": ["fox"]}, {"owl": "bad"})
    two = stats({"http://10.0.0.1:8000": ["cat"], "http://10.0.0.2:8000": ["fox"]})
    merged = sum_deployment_stats([{"team/smol": one}, {"team/smol": two}])["team/smol"]
    held = {r.endpoint: r.adapters for r in merged.replicas}
    assert held == {"http://10.0.0.1:8000": ["cat", "fox"], "http://10.0.0.2:8000": ["fox"]}
    assert merged.adapter_load_errors == {"owl": "bad"}


def test_a_refused_adapter_is_shown_loaded_nowhere() -> None:
    """Refused after it was loaded (the engines may hold it until they evict it): no route
    serves it, so `kubectl get` must not show it loaded beside Accepted=False."""
    stale = adapter(
        accepted="False",
        loadedReplicas=["smol-engine-a"],
        conditions=[
            {"type": "Accepted", "status": "False", "reason": "BaseModelMismatch"},
            {"type": "Loaded", "status": "True", "reason": "Loaded"},
        ],
    )
    patch = adapter_status_patch(stale, stats({"http://10.0.0.1:8000": ["fox"]}), PODS, NOW)
    assert patch == {
        "status": {
            "loadedReplicas": None,
            "conditions": [{"type": "Accepted", "status": "False", "reason": "BaseModelMismatch",
                            "message": ""}],
        }
    }  # fmt: skip


class HeldBy:
    """The gateways' stats: `team/smol`'s replica 10.0.0.1 holds fox."""

    async def deployments(self) -> dict[str, DeploymentStats]:
        return {"team/smol": stats({"http://10.0.0.1:8000": ["fox"]})}


def listed_adapter(name: str, deployment: str, version: str, **status: Any) -> dict[str, Any]:
    body = adapter(**status).model_dump(by_alias=True, mode="json", exclude_none=True)
    body["metadata"] |= {"name": name, "resourceVersion": version}
    body["spec"]["deployment"] = deployment
    return body


async def test_the_autoscaler_writes_on_the_version_it_read_and_skips_what_it_cannot_know() -> None:
    """Each patch carries the resourceVersion it was computed from (the operator writes
    `conditions` too: a crossed write is refused with 409, not written over), a 409 is left
    to the next tick, and an adapter of a deployment gone is shown loaded nowhere."""
    smol = {
        "apiVersion": "servefleet.io/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {"name": "smol", "namespace": "team"},
        "spec": {
            "model": {"name": "m", "source": {"builtin": "smollm2-135m-instruct"}},
            "engine": {"lora": {}},
        },
    }
    pod = {
        "metadata": {"name": "smol-engine-a"},
        "spec": {"containers": [{"ports": [{"name": "http", "containerPort": 8000}]}]},
        "status": {"podIP": "10.0.0.1"},
    }
    gone_loaded = {
        "loadedReplicas": ["smol-engine-b"],
        "conditions": [
            {"type": "Accepted", "status": "False", "reason": "DeploymentNotFound"},
            {"type": "Loaded", "status": "True", "reason": "Loaded"},
        ],
    }
    adapters = [
        listed_adapter("fox", "smol", "11"),
        listed_adapter("owl", "gone", "12", accepted="False", **gone_loaded),
        listed_adapter("cat", "unknown-to-the-gateways", "13"),
    ]

    def answer(call: Call) -> tuple[int, Any]:
        if call.path.endswith("/llmdeployments"):
            return 200, {"items": [smol]}
        if call.path.endswith("/llmadapters"):
            return 200, {"items": adapters}
        if call.path.endswith("/pods"):
            return 200, {"items": [pod]}
        if call.path.endswith("/llmadapters/fox/status"):
            return 409, {"kind": "Status", "reason": "Conflict", "message": "modified"}
        return 200, {}

    async with fake_kube(answer) as (api, kube), httpx.AsyncClient() as http:
        await ClusterAutoscaler(kube, ["team"], HeldBy(), AutoscalerMetrics(), http).tick()
    patches = {c.path.rsplit("/", 2)[1]: c.body for c in api.calls if c.path.endswith("/status")}
    assert set(patches) == {"fox", "owl"}  # cat: its deployment is not in the stats
    assert patches["fox"]["metadata"] == {"resourceVersion": "11"}
    assert patches["fox"]["status"]["loadedReplicas"] == ["smol-engine-a"]
    assert patches["owl"]["metadata"] == {"resourceVersion": "12"}
    assert patches["owl"]["status"]["loadedReplicas"] is None
    assert [c["type"] for c in patches["owl"]["status"]["conditions"]] == ["Accepted"]
