"""The reconcile loop's contract with the API, against an in-memory recorder of calls.

The real API server path is proven in e2e/; this pins down what is cheap to get wrong:
every child applied with our field manager, status written once, no rewrite when
nothing changed, Events only on transitions, and apply failures surfacing as Degraded.
"""

from __future__ import annotations

import copy
from typing import Any

import kopf
import pytest

from servefleet.api import LLMDeployment
from servefleet.kube import KubeError, ObjectList
from servefleet.kube.resources import Resource
from servefleet.operator.handlers import OperatorSettings, Reconciler, plain
from servefleet.operator.status import EventSpec


class RecordingClient:
    def __init__(self, fail_kind: str | None = None) -> None:
        self.applied: list[tuple[dict[str, Any], str]] = []
        self.status_patches: list[dict[str, Any]] = []
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.fail_kind = fail_kind
        self.listed: list[dict[str, Any]] = []
        self.created: list[dict[str, Any]] = []
        self.scaled: list[tuple[str, int, str]] = []

    async def set_scale(
        self, resource: Resource, namespace: str, name: str, replicas: int, manager: str
    ) -> None:
        assert resource.kind == "LLMDeployment"
        self.scaled.append((name, replicas, manager))

    async def create(self, obj: dict[str, Any], field_manager: str) -> bool:
        assert field_manager == "servefleet-operator"
        exists = any(o["metadata"]["name"] == obj["metadata"]["name"] for o in self.created)
        if not exists:
            self.created.append(obj)
        return not exists

    async def apply(self, obj: dict[str, Any], field_manager: str) -> dict[str, Any]:
        if obj["kind"] == self.fail_kind:
            raise KubeError(403, f"{obj['kind']} is forbidden")
        self.applied.append((obj, field_manager))
        self.objects[(obj["kind"], obj["metadata"]["name"])] = obj
        return obj

    async def get(
        self, resource: Resource, namespace: str | None, name: str
    ) -> dict[str, Any] | None:
        return self.objects.get((resource.kind, name))

    async def patch_status(
        self, resource: Resource, namespace: str, name: str, patch: dict[str, Any], manager: str
    ) -> dict[str, Any]:
        assert (resource.kind, manager) == ("LLMDeployment", "servefleet-operator")
        self.status_patches.append(copy.deepcopy(patch))
        return patch

    async def list(
        self, resource: Resource, namespace: str | None, label_selector: str | None = None
    ) -> ObjectList:
        return ObjectList(items=self.listed)

    async def has_api(self, group_version: str, plural: str) -> bool:
        return False


def dep(status: dict[str, Any] | None = None) -> LLMDeployment:
    return LLMDeployment.model_validate(
        {
            "metadata": {"name": "m", "namespace": "ns", "uid": "u1", "generation": 2},
            "spec": {"model": {"name": "m", "source": {"builtin": "smollm2-135m-instruct"}}},
            "status": status or {},
        }
    )


def reconciler(client: RecordingClient, events: list[EventSpec]) -> Reconciler:
    settings = OperatorSettings(engine_image="img:1", gateway_url="http://gw:8080/")
    return Reconciler(client, settings, post_event=lambda target, event: events.append(event))  # type: ignore[arg-type]


async def test_reconcile_applies_children_and_writes_status_once() -> None:
    client, events = RecordingClient(), list[EventSpec]()
    r = reconciler(client, events)
    await r.reconcile(dep())
    assert [(o["kind"], m) for o, m in client.applied] == [
        ("ConfigMap", "servefleet-operator"),
        ("Service", "servefleet-operator"),
        ("Deployment", "servefleet-operator"),
        ("PodDisruptionBudget", "servefleet-operator"),
        ("NetworkPolicy", "servefleet-operator"),
    ]
    # The engine key Secret is created, never applied: a re-apply would rotate the key.
    assert [(o["kind"], o["metadata"]["name"]) for o in client.created] == [
        ("Secret", "m-engine-key")
    ]
    # An unset spec.replicas gets the warm minimum, so that its scale can be read (HPA, KEDA).
    assert client.scaled == [("m", dep().spec.desired_replicas(), "servefleet-operator")]
    (patch,) = client.status_patches
    assert patch["status"]["observedGeneration"] == 2
    assert patch["status"]["endpoint"] == "http://gw:8080/v1"
    assert [(e.type, e.reason) for e in events] == [
        ("Normal", "WarmPoolNotReady"),
        ("Normal", "ScalingUp"),
    ]

    # Same cluster state, status as written: nothing new to write or announce.
    written = dep(status=patch["status"])
    events.clear()
    await r.reconcile(written)
    assert len(client.status_patches) == 1
    assert events == []
    assert len(client.applied) == 10  # applied again (drift repair), idempotent by design
    assert len(client.created) == 1


async def test_apply_failure_is_degraded_and_retried() -> None:
    client, events = RecordingClient(fail_kind="Deployment"), list[EventSpec]()
    with pytest.raises(kopf.TemporaryError, match="Deployment m-engine: Deployment is forbidden"):
        await reconciler(client, events).reconcile(dep())
    degraded = next(
        c for c in client.status_patches[0]["status"]["conditions"] if c["type"] == "Degraded"
    )
    assert (degraded["status"], degraded["reason"]) == ("True", "ReconcileError")
    assert ("Warning", "ReconcileError") in [(e.type, e.reason) for e in events]


def test_plain_turns_views_into_dicts() -> None:
    body = kopf.Body({"metadata": {"name": "x"}, "spec": {"a": [{"b": 1}]}})
    assert plain(body) == {"metadata": {"name": "x"}, "spec": {"a": [{"b": 1}]}}
    assert type(plain(body)["spec"]) is dict


async def test_drift_repair_pass_visits_live_objects_only() -> None:
    client = RecordingClient()
    live = dep().model_dump(by_alias=True, mode="json")
    deleting = copy.deepcopy(live)
    deleting["metadata"].update(name="gone", deletionTimestamp="2025-01-01T00:00:00Z")
    invalid = copy.deepcopy(live)
    invalid["metadata"]["name"] = "bad"
    invalid["spec"]["pool"] = {"minReplicas": 3, "maxReplicas": 1}
    client.listed = [live, deleting, invalid]
    assert await reconciler(client, []).resync_once() == 3
    assert {o["metadata"]["name"] for o, _ in client.applied} == {"m-engine", "m-gateway-route"}
