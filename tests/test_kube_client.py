"""The Kubernetes facade's requests and answers, against a scripted API server."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from servefleet.kube import KubeAccess, KubeError, LabelWatcher
from servefleet.kube.resources import (
    CONFIG_MAPS,
    DEPLOYMENTS,
    LLM_DEPLOYMENTS,
    PODS,
    resource_of,
)
from tests.support.fake_kube import Call, Stream, fake_kube


def test_paths_of_builtin_and_custom_resources() -> None:
    assert CONFIG_MAPS.path("ns", "a") == "/api/v1/namespaces/ns/configmaps/a"
    assert DEPLOYMENTS.path("ns") == "/apis/apps/v1/namespaces/ns/deployments"
    assert DEPLOYMENTS.path(None) == "/apis/apps/v1/deployments"
    assert (
        LLM_DEPLOYMENTS.path("ns", "m", "scale")
        == "/apis/servefleet.io/v1alpha1/namespaces/ns/llmdeployments/m/scale"
    )
    assert resource_of({"apiVersion": "v1", "kind": "Pod"}) is PODS
    with pytest.raises(KubeError, match="no resource known"):
        resource_of({"apiVersion": "v9", "kind": "Gadget"})


async def test_apply_is_a_forced_server_side_apply_with_our_manager() -> None:
    obj = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "a", "namespace": "ns"}}
    async with fake_kube(lambda call: (200, call.body)) as (api, kube):
        assert await kube.apply(obj, "me") == obj
    (call,) = api.calls
    assert (call.method, call.path) == ("PATCH", "/api/v1/namespaces/ns/configmaps/a")
    assert call.query == {"fieldManager": "me", "force": "true"}
    assert call.headers["content-type"] == "application/apply-patch+yaml"
    assert call.headers["authorization"] == "Bearer sa-token"


async def test_missing_objects_are_none_and_failures_one_error_type() -> None:
    def answer(call: Call) -> tuple[int, Any]:
        if "/gone" in call.path:
            return 404, {"kind": "Status", "message": "not found"}
        return 403, {"kind": "Status", "message": "pods is forbidden: no"}

    async with fake_kube(answer) as (_, kube):
        assert await kube.get(PODS, "ns", "gone") is None
        assert await kube.patch_status(LLM_DEPLOYMENTS, "ns", "gone", {"status": {}}, "m") is None
        with pytest.raises(KubeError) as raised:
            await kube.get(PODS, "ns", "p")
    assert (raised.value.status, raised.value.message) == (403, "pods is forbidden: no")


async def test_unreachable_server_is_a_kube_error_with_status_zero() -> None:
    kube = await KubeAccess(server="http://127.0.0.1:9").connect()  # nothing listens there
    async with kube:
        with pytest.raises(KubeError) as raised:
            await kube.get(PODS, "ns", "p")
    assert raised.value.status == 0


async def test_list_follows_pagination_and_keeps_the_resource_version() -> None:
    def answer(call: Call) -> tuple[int, Any]:
        if "continue" not in call.query:
            return 200, {"metadata": {"continue": "c1"}, "items": [{"n": 1}]}
        return 200, {"metadata": {"resourceVersion": "9"}, "items": [{"n": 2}]}

    async with fake_kube(answer) as (api, kube):
        listed = await kube.list(PODS, "ns", "a=b")
    assert listed.items == [{"n": 1}, {"n": 2}] and listed.resource_version == "9"
    assert [c.query.get("continue") for c in api.calls] == [None, "c1"]
    assert {c.query["labelSelector"] for c in api.calls} == {"a=b"}


async def test_scale_status_patch_and_events() -> None:
    def answer(call: Call) -> tuple[int, Any]:
        return 200, {"spec": {"replicas": 3}} if call.method == "GET" else {}

    target = {"apiVersion": "servefleet.io/v1alpha1", "kind": "LLMDeployment"}
    async with fake_kube(answer) as (api, kube):
        assert await kube.get_scale(LLM_DEPLOYMENTS, "ns", "m") == 3
        await kube.set_scale(LLM_DEPLOYMENTS, "ns", "m", 2, "scaler")
        await kube.patch_status(LLM_DEPLOYMENTS, "ns", "m", {"status": {"queueDepth": 4}}, "s")
        await kube.create_event(
            {**target, "metadata": {"name": "m", "namespace": "ns", "uid": "u"}},
            reason="Scaled",
            message="3 -> 2",
            component="scaler",
        )
    scale, status, event = api.calls[1:]
    assert (scale.path, scale.body, scale.query) == (
        "/apis/servefleet.io/v1alpha1/namespaces/ns/llmdeployments/m/scale",
        {"spec": {"replicas": 2}},
        {"fieldManager": "scaler"},
    )
    assert scale.headers["content-type"] == "application/merge-patch+json"
    assert status.path.endswith("/llmdeployments/m/status")
    assert status.body == {"status": {"queueDepth": 4}}
    assert (event.method, event.path) == ("POST", "/api/v1/namespaces/ns/events")
    assert event.body["involvedObject"] == {**target, "name": "m", "namespace": "ns", "uid": "u"}
    assert (event.body["reason"], event.body["source"]) == ("Scaled", {"component": "scaler"})


def names(objects: dict[tuple[str, str], Any]) -> list[str]:
    return sorted(name for _, name in objects)


async def test_an_unset_replicas_field_reads_as_none_not_as_a_failure() -> None:
    unset = 'Internal error occurred: the spec replicas field ".spec.replicas" does not exist'

    def answer(call: Call) -> tuple[int, Any]:
        if call.path.startswith("/apis/servefleet.io"):
            return 500, {"kind": "Status", "message": unset}
        return 500, {"kind": "Status", "message": "etcdserver: request timed out"}

    async with fake_kube(answer) as (_, kube):
        assert await kube.get_scale(LLM_DEPLOYMENTS, "ns", "m") is None
        with pytest.raises(KubeError, match="timed out"):
            await kube.get_scale(DEPLOYMENTS, "ns", "d")


def _cm(name: str, version: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ns", "resourceVersion": version}}


async def test_watch_resumes_after_a_routine_end_and_lists_again_after_410() -> None:
    streams = [
        # Ends routinely (the server's timeout): resume from the bookmark's version.
        Stream(
            [
                {"type": "ADDED", "object": _cm("b", "11")},
                {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "15"}}},
            ]
        ),
        # That version has expired: list again.
        Stream([{"type": "ERROR", "object": {"code": 410, "message": "too old"}}]),
        Stream([{"type": "DELETED", "object": _cm("a", "31")}], hold=True),
    ]
    lists = [
        {"metadata": {"resourceVersion": "10"}, "items": [_cm("a", "10")]},
        {"metadata": {"resourceVersion": "30"}, "items": [_cm("a", "30"), _cm("c", "30")]},
    ]

    def answer(call: Call) -> tuple[int, Any]:
        return 200, streams.pop(0) if call.query.get("watch") == "true" else lists.pop(0)

    snapshots: list[list[str]] = []
    async with fake_kube(answer) as (api, kube):
        watcher = LabelWatcher(kube, CONFIG_MAPS, "ns", "x=y", retry_s=0.01)
        task = asyncio.create_task(watcher.run(lambda objects: snapshots.append(names(objects))))
        async with asyncio.timeout(5):
            while len(snapshots) < 4:
                await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert snapshots == [["a"], ["a", "b"], ["a", "c"], ["c"]]
    requests = [(c.query.get("watch"), c.query.get("resourceVersion")) for c in api.calls]
    assert requests == [(None, None), ("true", "10"), ("true", "15"), (None, None), ("true", "30")]
    assert {c.query["labelSelector"] for c in api.calls} == {"x=y"}


async def test_delete_propagates_in_the_background_and_a_gone_object_is_false() -> None:
    def answer(call: Call) -> tuple[int, Any]:
        if call.path.endswith("/gone"):
            return 404, {"kind": "Status", "message": "not found"}
        return 200, {"kind": "Status", "status": "Success"}

    async with fake_kube(answer) as (api, kube):
        assert await kube.delete(DEPLOYMENTS, "ns", "m-prefill") is True
        assert await kube.delete(DEPLOYMENTS, "ns", "gone") is False
    call = api.calls[0]
    assert (call.method, call.path) == (
        "DELETE",
        "/apis/apps/v1/namespaces/ns/deployments/m-prefill",
    )
    assert call.body["propagationPolicy"] == "Background"
