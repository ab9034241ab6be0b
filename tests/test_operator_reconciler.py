"""The reconcile loop's contract with the API, against an in-memory recorder of calls.

The real API server path is proven in e2e/; this pins down what is cheap to get wrong:
every child applied with our field manager, status written once, no rewrite when
nothing changed, Events only on transitions, and apply failures surfacing as Degraded.
"""

from __future__ import annotations

import asyncio
import copy
import re
from typing import Any

import kopf
import pytest
from pydantic import SecretBytes

from servefleet.api.conventions import (
    FIELD_MANAGER_OPERATOR,
    LABEL_APP_MANAGED_BY,
    LABEL_DEPLOYMENT,
    POD_DELETION_COST,
)
from servefleet.api.llmdeployment import LLMDeployment
from servefleet.kube import KubeAccess, KubeError, ObjectList
from servefleet.kube.resources import Resource
from servefleet.operator.handlers import (
    build_registry,
    engine_needs_repair,
    group_needs_repair,
    plain,
)
from servefleet.operator.reconciler import Reconciler
from servefleet.operator.settings import OperatorSettings
from servefleet.operator.status import EventSpec

KEY = SecretBytes(b"a-route-signing-key-for-tests")


class RecordingClient:
    def __init__(self, fail_kind: str | None = None) -> None:
        self.applied: list[tuple[dict[str, Any], str]] = []
        self.status_patches: list[dict[str, Any]] = []
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.fail_kind = fail_kind
        self.listed: list[dict[str, Any]] = []
        self.created: list[dict[str, Any]] = []
        self.scaled: list[tuple[str, int, str]] = []
        self.patched: list[tuple[str, str, dict[str, Any], str]] = []
        self.pods: list[dict[str, Any]] = []

    async def set_scale(
        self,
        resource: Resource,
        namespace: str,
        name: str,
        replicas: int,
        manager: str,
        resource_version: str | None = None,
    ) -> None:
        assert resource.kind == "LLMDeployment"
        self.scaled.append((name, replicas, manager))

    def store(self, dep: LLMDeployment) -> None:
        """Hold `dep` as the API server would (the reconciler reads it again under its lock)."""
        self.objects["LLMDeployment", dep.name] = dep.model_dump(by_alias=True, mode="json")

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
        if stored := self.objects.get(("LLMDeployment", name)):
            stored["status"] = copy.deepcopy(patch["status"])
        return patch

    async def list(
        self, resource: Resource, namespace: str | None, label_selector: str | None = None
    ) -> ObjectList:
        if resource.kind == "Pod":
            assert label_selector == "servefleet.io/component=engine,servefleet.io/llmdeployment=m"
            return ObjectList(items=self.pods)
        return ObjectList(items=self.listed)

    async def patch(
        self,
        resource: Resource,
        namespace: str | None,
        name: str,
        patch: dict[str, Any],
        field_manager: str,
    ) -> dict[str, Any]:
        self.patched.append((resource.kind, name, patch, field_manager))
        return patch

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


class StoringReconciler(Reconciler):
    """Reconciles what a test hands it: the object is stored in the fake client first, as the
    API server would hold it, because `reconcile` reads the object again under its lock."""

    async def reconcile(self, dep: LLMDeployment, *, follow: bool = True) -> None:
        self.client.store(dep)  # type: ignore[attr-defined]
        await super().reconcile(dep, follow=follow)


def reconciler(client: RecordingClient, events: list[EventSpec]) -> Reconciler:
    settings = OperatorSettings(
        engine_image="img:1", gateway_url="http://gw:8080/", route_signing_key=KEY
    )

    async def record(target: dict[str, Any], event: EventSpec) -> None:
        events.append(event)

    return StoringReconciler(client, settings, post_event=record)  # type: ignore[arg-type]


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


class StatusFailsFor(RecordingClient):
    """A client whose status write fails for one object (e.g. it was deleted mid-pass)."""

    def __init__(self, failing: str) -> None:
        super().__init__()
        self.failing = failing

    async def patch_status(
        self, resource: Resource, namespace: str, name: str, patch: dict[str, Any], manager: str
    ) -> dict[str, Any]:
        if name == self.failing:
            raise KubeError(404, f"llmdeployments {name} not found")
        return await super().patch_status(resource, namespace, name, patch, manager)


async def test_one_failing_object_does_not_stop_the_pass() -> None:
    client = StatusFailsFor("first")
    first = dep().model_dump(by_alias=True, mode="json")
    first["metadata"]["name"] = "first"
    client.listed = [first, dep().model_dump(by_alias=True, mode="json")]
    assert await reconciler(client, []).resync_once() == 2
    assert {o["metadata"]["name"] for o, _ in client.applied} >= {"first-engine", "m-engine"}
    assert len(client.status_patches) == 1  # the second object's status was still written


async def test_the_drift_repair_loop_outlives_an_unexpected_error() -> None:
    passes: list[int] = []

    class Flaky(Reconciler):
        async def resync_once(self) -> int:
            passes.append(1)
            if len(passes) == 1:
                raise RuntimeError("not a KubeError")
            if len(passes) == 3:
                raise asyncio.CancelledError
            return 0

    settings = OperatorSettings(
        engine_image="img:1", gateway_url="http://gw", resync_seconds=0.01, route_signing_key=KEY
    )
    with pytest.raises(asyncio.CancelledError):
        await Flaky(RecordingClient(), settings).resync_forever()  # type: ignore[arg-type]
    assert len(passes) == 3


async def test_repair_rereads_the_object_and_leaves_deleted_ones_alone() -> None:
    client = RecordingClient()
    r = reconciler(client, [])
    await r.repair("ns", "m")  # gone: nothing is recreated
    assert client.applied == []
    client.objects[("LLMDeployment", "m")] = dep().model_dump(by_alias=True, mode="json")
    await r.repair("ns", "m")
    assert ("Service", "m-engine") in [
        (o["kind"], o["metadata"]["name"]) for o, _ in client.applied
    ]
    client.applied.clear()
    deleting = dep().model_dump(by_alias=True, mode="json")
    deleting["metadata"]["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    client.objects[("LLMDeployment", "m")] = deleting
    await r.repair("ns", "m")
    assert client.applied == []


@pytest.mark.parametrize(
    ("event_type", "generation", "observed", "repair"),
    [
        ("DELETED", 3, 3, True),  # deleted: put it back now
        ("MODIFIED", 4, 3, True),  # spec changed (scaled, edited) and not yet observed
        ("MODIFIED", 3, 3, False),  # only status moved: refresh our status
        (None, 1, None, True),  # listed before the Deployment controller saw it
    ],
)
def test_engine_deployment_events_that_are_drift(
    event_type: str | None, generation: int, observed: int | None, repair: bool
) -> None:
    status = {} if observed is None else {"observedGeneration": observed}
    body = {"metadata": {"generation": generation}, "status": status}
    assert engine_needs_repair(body, event_type) is repair


class EventRecordingClient(RecordingClient):
    def __init__(self, fail: bool) -> None:
        super().__init__()
        self.fail = fail
        self.events: list[tuple[str, str, str]] = []

    async def create_event(
        self, involved: dict[str, Any], *, reason: str, message: str, component: str, type: str
    ) -> dict[str, Any]:
        if self.fail:
            raise KubeError(403, "events is forbidden")
        self.events.append((involved["metadata"]["name"], reason, component))
        return {}


@pytest.mark.parametrize("fail", [False, True])
async def test_events_go_through_our_client_and_never_fail_a_reconcile(fail: bool) -> None:
    """kopf's poster works only inside kopf handlers; the drift pass posts events too."""
    client = EventRecordingClient(fail)
    settings = OperatorSettings(
        engine_image="img:1", gateway_url="http://gw:8080/", route_signing_key=KEY
    )
    await StoringReconciler(client, settings).reconcile(dep())  # type: ignore[arg-type]
    assert len(client.status_patches) == 1
    expected = [] if fail else [("m", "WarmPoolNotReady", "servefleet-operator")]
    assert client.events[:1] == expected


def test_every_persisted_handler_id_is_a_valid_annotation_name() -> None:
    """kopf stores a handler's retries and progress in an annotation named after its id; an
    id the API server refuses (a nested function's `<locals>` path) turns every retry into a
    422 and a traceback, which the e2e caught under load."""
    settings = OperatorSettings(
        engine_image="img:1", gateway_url="http://gw:8080/", route_signing_key=KEY
    )
    registry = build_registry(settings, KubeAccess(server="http://127.0.0.1:1"))
    ids = [handler.id for handler in registry._changing.get_all_handlers()]
    assert ids, "no change handlers registered"
    name_part = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
    for handler_id in ids:
        part = handler_id.replace("/", ".")  # kopf's annotation key for a field handler
        assert len(part) <= 63 and name_part.fullmatch(part), handler_id


def pod(name: str, cost: str | None = None) -> dict[str, Any]:
    annotations = {} if cost is None else {"controller.kubernetes.io/pod-deletion-cost": cost}
    return {"metadata": {"name": name, "annotations": annotations}}


async def test_the_autoscalers_ranking_reaches_the_pods_before_the_scale_down() -> None:
    """The autoscaler may not write pods: it ranks them in status.podDeletionCosts, and the
    operator copies the ranks to its own engine pods before it applies the lower count."""
    client = RecordingClient()
    client.pods = [pod("m-a", "2"), pod("m-b"), pod("m-c", "0")]
    ranked = dep(
        status={
            "podDeletionCosts": [
                {"pod": "m-a", "cost": 2},
                {"pod": "m-b", "cost": -1},
                {"pod": "m-c", "cost": 1},
                {"pod": "not-an-engine-pod", "cost": 5},  # never listed: never patched
            ]
        }
    )
    await reconciler(client, []).reconcile(ranked)
    assert [(kind, name, body) for kind, name, body, _ in client.patched] == [
        ("Pod", "m-b", {"metadata": {"annotations": {POD_DELETION_COST: "-1"}}}),
        ("Pod", "m-c", {"metadata": {"annotations": {POD_DELETION_COST: "1"}}}),
    ]
    assert {manager for *_, manager in client.patched} == {"servefleet-operator"}
    # The status the operator writes leaves the ranking to the autoscaler.
    assert "podDeletionCosts" not in client.status_patches[0]["status"]
    client.patched.clear()
    await reconciler(client, []).reconcile(dep())  # no ranking: no pod is touched
    assert client.patched == []


async def test_a_refused_spec_applies_nothing_and_says_why() -> None:
    client, events = RecordingClient(), list[EventSpec]()
    evil = dep()
    evil.spec.engine.image = "evil.example/miner:1"
    await reconciler(client, events).reconcile(evil)  # no retry loop: not a TemporaryError
    assert client.applied == [] and client.created == [] and client.scaled == []
    conditions = {c["type"]: c for c in client.status_patches[0]["status"]["conditions"]}
    degraded = conditions["Degraded"]
    assert (degraded["status"], degraded["reason"]) == ("True", "ImageNotAllowed")
    assert "evil.example/miner:1" in degraded["message"]
    assert "operator.allowedImages" in degraded["message"]
    assert conditions["Progressing"]["status"] == "False"
    warning = next(e for e in events if e.type == "Warning")
    assert warning.reason == "ImageNotAllowed" and "evil.example/miner:1" in warning.message


def plain_reconciler(client: RecordingClient) -> Reconciler:
    """One that reconciles the object the fake holds, whatever body it is handed."""
    settings = OperatorSettings(engine_image="i:1", gateway_url="http://gw", route_signing_key=KEY)

    async def ignore(target: dict[str, Any], event: EventSpec) -> None:
        pass

    return Reconciler(client, settings, post_event=ignore)  # type: ignore[arg-type]


def _engine_replicas(client: RecordingClient) -> int:
    return int(client.objects["Deployment", "m-engine"]["spec"]["replicas"])


async def test_a_stale_body_never_shrinks_the_pool() -> None:
    """A drift pass listed the object before `kubectl scale` (or the autoscaler) set 3 and
    then waited for the lock: what it applies is the object as it is now, not the list's."""
    client = RecordingClient()
    now = dep()
    now.spec.replicas = 3
    client.store(now)
    await plain_reconciler(client).reconcile(dep())
    assert client.scaled == [] and _engine_replicas(client) == 3
    del client.objects["LLMDeployment", "m"]
    client.applied.clear()
    await plain_reconciler(client).reconcile(dep())
    assert client.applied == []  # deleted meanwhile: nothing is put back


class ScaledMeanwhile(RecordingClient):
    """The first write of the minimum loses a race with `kubectl scale --replicas=3`."""

    def __init__(self) -> None:
        super().__init__()
        self.versions: list[str | None] = []

    async def set_scale(
        self,
        resource: Resource,
        namespace: str,
        name: str,
        replicas: int,
        manager: str,
        resource_version: str | None = None,
    ) -> None:
        self.versions.append(resource_version)
        stored = self.objects["LLMDeployment", name]
        if len(self.versions) == 1:  # between our read and our write
            stored["spec"]["replicas"] = 3
            stored["metadata"]["resourceVersion"] = "8"
        if stored["metadata"]["resourceVersion"] != resource_version:
            raise KubeError(409, "the object has been modified")
        await super().set_scale(resource, namespace, name, replicas, manager, resource_version)


async def test_the_minimum_is_written_only_over_the_version_read() -> None:
    client = ScaledMeanwhile()
    unset = dep()
    unset.metadata.resource_version = "7"
    client.store(unset)
    await plain_reconciler(client).reconcile(unset)
    assert client.versions == ["7"]  # refused; the count read again is the one set meanwhile
    assert _engine_replicas(client) == 3


def test_the_engine_workloads_we_own_are_watched_deployment_and_leaderworkerset() -> None:
    """Group readiness reaches status when the LeaderWorkerSet changes, not only on the next
    drift-repair pass; only a deleted LeaderWorkerSet is put back at once (it has no
    observedGeneration to tell our own apply from an edit)."""
    settings = OperatorSettings(
        engine_image="img:1", gateway_url="http://gw:8080/", route_signing_key=KEY
    )
    registry = build_registry(settings, KubeAccess(server="http://127.0.0.1:1"))
    watched = {
        (h.selector.group, h.selector.any_name): h.labels
        for h in registry._watching.get_all_handlers()
        if h.selector is not None
    }
    for resource in (("apps", "deployments"), ("leaderworkerset.x-k8s.io", "leaderworkersets")):
        assert watched[resource] == {
            LABEL_DEPLOYMENT: kopf.PRESENT,
            LABEL_APP_MANAGED_BY: FIELD_MANAGER_OPERATOR,
        }
    assert group_needs_repair("DELETED")
    assert not group_needs_repair("MODIFIED") and not group_needs_repair(None)
