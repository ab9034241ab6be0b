"""Thin kopf handlers; everything they do is a call on one `Reconciler`.

kopf brings the watches, retries and the create/update/resume/delete dispatch; the
reconciler holds what we decide (children, status, drift repair), so it is tested without
kopf. Handlers for the LLMDeployment itself, for its engine Deployment and for the
operator's lifecycle are registered by separate functions, all bound to the same reconciler.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import kopf
from pydantic import ValidationError

from servefleet.api.conventions import (
    FIELD_MANAGER_OPERATOR,
    LABEL_APP_MANAGED_BY,
    LABEL_DEPLOYMENT,
)
from servefleet.api.llmadapter import ADAPTER_PLURAL, LLMAdapter
from servefleet.api.llmdeployment import API_GROUP, API_VERSION, PLURAL, LLMDeployment
from servefleet.kube import KubeAccess, KubeError
from servefleet.kube.resources import LEADER_WORKER_SETS
from servefleet.operator.reconciler import Reconciler
from servefleet.operator.settings import OperatorSettings

log = logging.getLogger("servefleet.operator")
RESOURCE = (API_GROUP, API_VERSION, PLURAL)
ADAPTER_RESOURCE = (API_GROUP, API_VERSION, ADAPTER_PLURAL)
LWS_RESOURCE = (*LEADER_WORKER_SETS.api_version.split("/"), LEADER_WORKER_SETS.plural)
GetReconciler = Callable[[], Awaitable[Reconciler]]


def plain(value: Any) -> Any:
    """kopf hands out mapping views; pydantic wants plain dicts and lists."""
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


def parse_body(body: kopf.Body) -> LLMDeployment:
    """The kopf body as our model; a spec our models reject is a permanent error."""
    try:
        return LLMDeployment.model_validate(plain(body))
    except ValidationError as exc:
        raise _invalid(body, exc) from exc


def parse_adapter(body: kopf.Body) -> LLMAdapter:
    """An LLMAdapter body as our model; as `parse_body`."""
    try:
        return LLMAdapter.model_validate(plain(body))
    except ValidationError as exc:
        raise _invalid(body, exc) from exc


def _invalid(body: kopf.Body, exc: ValidationError) -> kopf.PermanentError:
    """An InvalidSpec Warning on the object, and the error that stops kopf's retries."""
    problems = "; ".join(
        f"{'.'.join(str(p) for p in e['loc'])}: {e['msg'].removeprefix('Value error, ')}"
        for e in exc.errors()
    )
    kopf.warn(body, reason="InvalidSpec", message=problems)
    return kopf.PermanentError(f"invalid spec: {problems}")


def build_registry(settings: OperatorSettings, access: KubeAccess) -> kopf.OperatorRegistry:
    """A kopf registry with every handler bound to one Reconciler (no module globals).

    kopf watches with its own client; it logs in with the credentials of ours, asked again
    whenever kopf sees a 401, so a refreshed token (exec plugin, rotated ServiceAccount
    token) reaches both.
    """
    registry = kopf.OperatorRegistry()
    shared = SharedReconciler(settings, access)
    _register_lifecycle(registry, shared)
    _register_deployment_handlers(registry, shared.get)
    _register_engine_watch(registry, shared.get)
    _register_adapter_handlers(registry, shared.get)
    return registry


class SharedReconciler:
    """The one Reconciler of a registry, connected on first use (inside kopf's loop)."""

    def __init__(self, settings: OperatorSettings, access: KubeAccess) -> None:
        self.settings = settings
        self.access = access
        self.current: Reconciler | None = None
        self._connecting = asyncio.Lock()

    async def get(self) -> Reconciler:
        async with self._connecting:
            if self.current is None:
                self.current = Reconciler(await self.access.connect(), self.settings)
        return self.current


def configure_kopf(settings: kopf.OperatorSettings) -> None:
    """kopf's settings for this operator."""
    # Progress and diff-base go in annotations under our prefix: the status schema
    # is structural and would prune kopf's own status fields.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=API_GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=API_GROUP, key="last-handled-configuration"
    )
    settings.posting.level = logging.WARNING
    # kopf would watch CRDs cluster-wide to notice new resources; we know ours,
    # and least-privilege RBAC should not need to read every CRD in the cluster.
    settings.scanning.disabled = True
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.networking.request_timeout = 60


def _register_lifecycle(registry: kopf.OperatorRegistry, shared: SharedReconciler) -> None:
    """Startup (settings, the drift-repair loop), login, cleanup."""
    tasks: dict[str, asyncio.Task[None]] = {}

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        configure_kopf(settings)

    @kopf.on.startup(registry=registry)
    async def start_drift_repair(**_: Any) -> None:
        repair = (await shared.get()).resync_forever()
        tasks["resync"] = asyncio.create_task(repair, name="drift-repair")

    @kopf.on.login(registry=registry)
    async def login(**_: Any) -> kopf.ConnectionInfo:
        creds = await (await shared.get()).client.credentials()
        return kopf.ConnectionInfo(
            server=creds.server,
            token=creds.token.get_secret_value() if creds.token else None,
            scheme=creds.scheme,
            ca_path=creds.ca_path,
            certificate_path=creds.cert_path,
            private_key_path=creds.key_path,
            insecure=creds.insecure,
            default_namespace=creds.namespace,
        )

    @kopf.on.cleanup(registry=registry)
    async def close(**_: Any) -> None:
        if task := tasks.pop("resync", None):
            task.cancel()
        if shared.current is not None:
            await shared.current.client.aclose()


RECONCILE_HANDLER = "reconcile"
FORGET_HANDLER = "forget"


def _register_deployment_handlers(
    registry: kopf.OperatorRegistry, reconciler: GetReconciler
) -> None:
    """The LLMDeployment itself: created, changed, resumed after a restart, deleted.

    Handler ids are explicit: kopf names a handler's progress annotation after its id, and
    the default id of a nested function (`_register_..._locals_.reconcile_spec`) is not a
    valid annotation name, so a handler that had to retry failed to record it (a 422).
    """

    @kopf.on.resume(*RESOURCE, id=RECONCILE_HANDLER, registry=registry)
    @kopf.on.create(*RESOURCE, id=RECONCILE_HANDLER, registry=registry)
    @kopf.on.update(*RESOURCE, id=RECONCILE_HANDLER, field="spec", registry=registry)
    async def reconcile_spec(body: kopf.Body, **_: Any) -> None:
        await (await reconciler()).reconcile(parse_body(body))

    @kopf.on.delete(*RESOURCE, id=FORGET_HANDLER, registry=registry, optional=True)
    async def forget(name: str, namespace: str | None, **_: Any) -> None:
        (await reconciler()).forget(namespace or "", name)

    @kopf.on.event(*RESOURCE, registry=registry)
    async def deployment_deleted(
        name: str, namespace: str | None, type: str | None, **_: Any
    ) -> None:
        """Its adapters are refused at once (no finalizer, so no delete handler runs)."""
        if type == "DELETED":
            await _quietly((await reconciler()).repair(namespace or "", name), namespace, name)


ADAPTER_HANDLER = "adapter"


def _register_adapter_handlers(registry: kopf.OperatorRegistry, reconciler: GetReconciler) -> None:
    """An LLMAdapter created, changed, resumed or deleted: its deployment is reconciled
    (the adapters of the namespace judged, its route rendered), and the one it named before
    when spec.deployment changed. Statuses go through our client (`adapter_sync`)."""

    @kopf.on.resume(*ADAPTER_RESOURCE, id=ADAPTER_HANDLER, registry=registry)
    @kopf.on.create(*ADAPTER_RESOURCE, id=ADAPTER_HANDLER, registry=registry)
    @kopf.on.update(*ADAPTER_RESOURCE, id=ADAPTER_HANDLER, field="spec", registry=registry)
    async def adapter_spec(body: kopf.Body, old: Any, **_: Any) -> None:
        adapter = parse_adapter(body)
        before = (old or {}).get("deployment") if isinstance(old, Mapping) else None
        r = await reconciler()
        for name in sorted({adapter.spec.deployment, *([before] if before else [])}):
            await r.repair(adapter.namespace, name)

    @kopf.on.event(*ADAPTER_RESOURCE, registry=registry)
    async def adapter_deleted(body: kopf.Body, type: str | None, **_: Any) -> None:
        """Out of its deployment's route at once (no finalizer: no delete handler runs)."""
        deployment = (body.get("spec") or {}).get("deployment")
        namespace = body.get("metadata", {}).get("namespace")
        if type == "DELETED" and deployment and namespace:
            repair = (await reconciler()).repair(namespace, deployment)
            await _quietly(repair, namespace, deployment)


async def _quietly(work: Awaitable[None], namespace: str | None, name: str) -> None:
    """Event handlers are not retried by kopf: a failure is logged, the drift pass retries."""
    try:
        await work
    except (kopf.TemporaryError, KubeError) as exc:
        log.warning("repair of %s/%s: %s (the drift-repair pass retries)", namespace, name, exc)


def engine_needs_repair(body: Mapping[str, Any], event_type: str | None) -> bool:
    """Whether an engine Deployment event is drift to undo now rather than at the next pass:
    the Deployment was deleted, or its spec changed and the Deployment controller has not
    seen it yet (someone scaled or edited it; after our own apply the repair is a no-op)."""
    if event_type == "DELETED":
        return True
    generation = body.get("metadata", {}).get("generation")
    observed = body.get("status", {}).get("observedGeneration")
    return generation is not None and generation != observed


def group_needs_repair(event_type: str | None) -> bool:
    """A LeaderWorkerSet has no `status.observedGeneration` to tell our apply from an edit, so
    only its deletion is repaired at once; an edit waits for the drift-repair pass."""
    return event_type == "DELETED"


ENGINE_WORKLOAD_LABELS: Mapping[str, Any] = {  # a label present, a label equal
    LABEL_DEPLOYMENT: kopf.PRESENT,
    LABEL_APP_MANAGED_BY: FIELD_MANAGER_OPERATOR,
}


def _register_engine_watch(registry: kopf.OperatorRegistry, reconciler: GetReconciler) -> None:
    """The engine workloads we own, a Deployment or (replicas of several pods) a
    LeaderWorkerSet: readiness goes to status at once, drift is undone at once. kopf finds
    the LeaderWorkerSet API by discovery when it starts; without it kopf logs once that it
    cannot serve it, and the drift-repair pass carries group readiness to status (an API
    installed later is watched from the operator's next start: the chart's least-privilege
    roles do not let kopf watch CRDs)."""

    async def changed(body: kopf.Body, repair: bool) -> None:
        owner = body.get("metadata", {}).get("labels", {}).get(LABEL_DEPLOYMENT)
        if not owner:
            return
        namespace = body["metadata"]["namespace"]
        r = await reconciler()
        try:
            if repair:
                await r.repair(namespace, owner)
            else:
                await r.refresh_status(namespace, owner)
        except (kopf.TemporaryError, KubeError) as exc:
            log.warning(
                "repair of %s/%s: %s (the drift-repair pass retries)", namespace, owner, exc
            )

    @kopf.on.event("apps", "v1", "deployments", labels=ENGINE_WORKLOAD_LABELS, registry=registry)
    async def engine_changed(body: kopf.Body, type: str | None, **_: Any) -> None:
        await changed(body, engine_needs_repair(body, type))

    @kopf.on.event(*LWS_RESOURCE, labels=ENGINE_WORKLOAD_LABELS, registry=registry)
    async def group_changed(body: kopf.Body, type: str | None, **_: Any) -> None:
        await changed(body, group_needs_repair(type))
