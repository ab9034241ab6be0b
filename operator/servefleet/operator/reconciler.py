"""The reconciler: render the children, server-side apply them, write status.

`reconcile`, `repair` and `refresh_status` are idempotent: the create/update/resume handlers,
the drift-repair pass and the child watches may all fire for the same object, in any order
and after a restart, and the cluster converges to the same state without duplicates.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import kopf
from pydantic import ValidationError

from servefleet.api.conventions import FIELD_MANAGER_OPERATOR, POD_DELETION_COST
from servefleet.api.fetch_progress import FETCH_CONTAINER
from servefleet.api.llmadapter import LLMAdapter
from servefleet.api.llmdeployment import FULL_API_VERSION, KIND, LLMDeployment
from servefleet.kube import KubeClient, KubeError
from servefleet.kube.resources import (
    DEPLOYMENTS,
    LEADER_WORKER_SETS,
    LLM_DEPLOYMENTS,
    PODS,
    SERVICE_MONITORS,
)
from servefleet.operator import render
from servefleet.operator.adapter_sync import AdapterSync, NamespaceAdapters
from servefleet.operator.groups import as_deployment_status, is_group
from servefleet.operator.model_loading import LOG_TAIL_LINES, fetching_pods
from servefleet.operator.pool_cleanup import (
    missing_group_api,
    remove_other_workload,
    remove_prefill_pool,
)
from servefleet.operator.pools import prefill_object_name
from servefleet.operator.settings import OperatorSettings
from servefleet.operator.status import (
    EventSpec,
    Observed,
    compute_status,
    status_patch,
    transition_events,
)

log = logging.getLogger("servefleet.operator")


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Reconciler:
    """Holds the API client and the per-object locks; everything else is passed in."""

    def __init__(
        self, client: KubeClient, settings: OperatorSettings, post_event: EventPoster | None = None
    ) -> None:
        self.client = client
        self.post_event = post_event or self._post_event
        self.settings = settings
        self.render_settings = render.RenderSettings(
            engine_image=settings.engine_image,
            gateway_url=settings.gateway_url,
            route_signing_key=settings.route_signing_key.get_secret_value(),
            image_pull_policy=settings.image_pull_policy,
            system_namespace=settings.system_namespace,
            metrics_namespaces=tuple(settings.metrics_namespaces),
            allowed_images=tuple(settings.allowed_images),
            host_path_prefixes=tuple(settings.host_path_prefixes),
        )
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        self._service_monitor: tuple[float, bool] | None = None
        self.adapters = AdapterSync(client, self.post_event, _now)

    def _lock(self, namespace: str, name: str) -> asyncio.Lock:
        return self._locks.setdefault((namespace, name), asyncio.Lock())

    def forget(self, namespace: str, name: str) -> None:
        self._locks.pop((namespace, name), None)

    @property
    def endpoint(self) -> str:
        return self.settings.gateway_url.rstrip("/") + "/v1"

    async def _with_service_monitor(self) -> bool:
        now = time.monotonic()
        if (
            self._service_monitor is None
            or now - self._service_monitor[0] > self.settings.service_monitor_check_seconds
        ):
            try:
                exists = await self.client.has_api(
                    SERVICE_MONITORS.api_version, SERVICE_MONITORS.plural
                )
            except KubeError as exc:
                log.warning("cannot check for the ServiceMonitor API: %s", exc)
                exists = False
            self._service_monitor = (now, exists)
        return self._service_monitor[1]

    async def reconcile(self, dep: LLMDeployment, *, follow: bool = True) -> None:
        """Judge the namespace's LLMAdapters, apply every child (the route with the adapters
        accepted for `dep`), then write status. Raises kopf.TemporaryError to retry.

        A spec the admin's lists refuse (`policy`) applies nothing, so what runs keeps the
        last accepted spec; Degraded and a Warning Event say why (no retry: the drift-repair
        pass looks again, e.g. after the lists changed). With `follow`, other deployments
        whose accepted adapters this pass changed are reconciled next (once, no further)."""
        judged: NamespaceAdapters | None = None
        async with self._lock(dep.namespace, dep.name):
            # Read again under the lock: an event's or a list's body may predate a write made
            # while another pass held it, and its stale spec.replicas would shrink the pool.
            if (live := await self._read_live(dep.namespace, dep.name)) is None:
                return  # deleted meanwhile, or now invalid (the spec handlers say so)
            dep = live
            refused = render.refusal(dep, self.render_settings)
            try:
                judged = await self.adapters.judge_namespace(dep.namespace)
                error = None
            except KubeError as exc:  # a route from a partial picture would drop adapters
                error = f"listing the LLMAdapters of {dep.namespace}: {exc.message}"
            if refused is None and judged is not None:
                error = await self._apply_children(dep, judged.accepted.get(dep.name, []))
            why = None if refused is None else (refused.reason, refused.message)
            await self._write_status(dep, error, why)
        if refused is not None:
            log.warning("%s/%s refused: %s", dep.namespace, dep.name, refused.message)
        if follow and judged is not None:
            await self._follow(dep.namespace, judged.changed - {dep.name})
        if error:
            raise kopf.TemporaryError(error, delay=10)

    async def _follow(self, namespace: str, deployments: set[str]) -> None:
        """Reconcile the deployments whose routes a judgement made stale (no further)."""
        for name in sorted(deployments):
            try:
                await self.repair(namespace, name, follow=False)
            except (kopf.TemporaryError, KubeError) as exc:
                log.warning("adapters of %s/%s: %s (the drift-repair pass retries)",
                            namespace, name, exc)  # fmt: skip

    async def _apply_children(self, dep: LLMDeployment, adapters: list[LLMAdapter]) -> str | None:
        """The engine key, spec.replicas, deletion costs, then every child; the error, if any."""
        try:
            if missing := await missing_group_api(self.client, dep):
                return missing
            await self._ensure_engine_key(dep)
            dep = await self._ensure_replicas(dep)
        except KubeError as exc:
            return f"preparing {dep.name}: {exc.message}"
        children = render.children(
            dep, self.render_settings, await self._with_service_monitor(), adapters
        )
        await self._apply_deletion_costs(dep)
        for obj in children:
            try:
                await self.client.apply(obj, FIELD_MANAGER_OPERATOR)
            except KubeError as exc:
                return f"applying {obj['kind']} {obj['metadata']['name']}: {exc.message}"
        try:  # replicas changed between one pod and groups: the new workload is applied
            if other := await remove_other_workload(self.client, dep):
                log.info("%s/%s: removed %s", dep.namespace, dep.name, other)
        except KubeError as exc:
            return f"removing the old engine workload of {dep.name}: {exc.message}"
        if dep.spec.disaggregation is None and dep.status.prefill is not None:
            try:  # the block was deleted: status still shows the pool that ran
                removed = await remove_prefill_pool(self.client, dep)
            except KubeError as exc:
                return f"removing the prefill pool of {dep.name}: {exc.message}"
            log.info("%s/%s: removed %s", dep.namespace, dep.name, ", ".join(removed) or "nothing")
        return None

    async def _apply_deletion_costs(self, dep: LLMDeployment) -> None:
        """Copy the autoscaler's ranking (status.podDeletionCosts) onto this deployment's own
        engine pods, before the engine Deployment is scaled: the ReplicaSet then removes the
        idlest replica. Best effort: without it the ReplicaSet picks by its own rules. Not
        for groups: a LeaderWorkerSet removes its highest-indexed groups (`groups`)."""
        costs = {c.pod: str(c.cost) for c in dep.status.pod_deletion_costs}
        if not costs or is_group(dep):
            return
        try:
            listed = await self.client.list(PODS, dep.namespace, render.selector_string(dep))
            for pod in listed.items:
                meta = pod.get("metadata", {})
                name, annotations = meta.get("name"), meta.get("annotations") or {}
                if name not in costs or annotations.get(POD_DELETION_COST) == costs[name]:
                    continue
                patch = {"metadata": {"annotations": {POD_DELETION_COST: costs[name]}}}
                await self.client.patch(PODS, dep.namespace, name, patch, FIELD_MANAGER_OPERATOR)
        except KubeError as exc:
            log.warning("deletion costs of %s/%s: %s", dep.namespace, dep.name, exc)

    async def _ensure_replicas(self, dep: LLMDeployment) -> LLMDeployment:
        """Give an unset spec.replicas its value (the warm minimum) through the scale subresource;
        the object to render from.

        The API server cannot read the scale of a custom resource whose replicas path is
        absent (a 500 for an HPA or `kubectl get --subresource=scale`), while the YAML in Git
        must leave the field out so that syncs never reset the autoscaler's count. The write
        holds only over the version read: a count set meanwhile (`kubectl scale`, the
        autoscaler) is never overwritten with the minimum.
        """
        for _ in range(3):
            if dep.spec.replicas is not None:
                return dep
            try:
                await self.client.set_scale(
                    LLM_DEPLOYMENTS, dep.namespace, dep.name, dep.spec.desired_replicas(),
                    FIELD_MANAGER_OPERATOR, resource_version=dep.metadata.resource_version,
                )  # fmt: skip
                return dep
            except KubeError as exc:
                if exc.status != 409:
                    raise
            dep = await self._read_live(dep.namespace, dep.name) or dep
        raise KubeError(409, f"{dep.name} changed three times while spec.replicas was set")

    async def _ensure_engine_key(self, dep: LLMDeployment) -> None:
        """Create the engine key Secret when absent; an existing one is never rewritten."""
        secret = render.engine_key_secret_for(dep)
        if secret is not None:
            await self.client.create(secret, FIELD_MANAGER_OPERATOR)

    async def resync_once(self) -> int:
        """Reconcile every LLMDeployment once; returns how many were visited.

        One object's failure is logged and the pass goes on, so a broken object never keeps
        drift in the others from being repaired."""
        items: list[dict[str, Any]] = []
        namespaces: list[str | None] = [*self.settings.namespaces] or [None]
        for namespace in namespaces:
            items += (await self.client.list(LLM_DEPLOYMENTS, namespace)).items
        for body in items:
            meta = body.get("metadata", {})
            if meta.get("deletionTimestamp"):
                continue
            try:
                await self.reconcile(LLMDeployment.model_validate(body), follow=False)
            except ValidationError:
                continue  # reported by the spec handlers as InvalidSpec
            except (kopf.TemporaryError, KubeError) as exc:
                log.warning(
                    "drift repair of %s/%s: %s", meta.get("namespace"), meta.get("name"), exc
                )
        await self._judge_orphans({str(b.get("metadata", {}).get("namespace")) for b in items})
        return len(items)

    async def _judge_orphans(self, judged: set[str]) -> None:
        """Adapters in namespaces without a deployment (none reconciled judged them)."""
        namespaces: list[str | None] = [*self.settings.namespaces] or [None]
        for namespace in namespaces:
            for other in sorted(await self.adapters.namespaces_with_adapters(namespace) - judged):
                await self.adapters.judge_namespace(other)

    async def resync_forever(self) -> None:
        """Drift repair: re-apply every child on a period, so an edited or deleted child is
        put back. One loop for all objects rather than a kopf timer per object, because
        kopf timers need a finalizer, and a finalizer would make deleting an
        LLMDeployment hang whenever the operator is down. The loop outlives any failure:
        a task that died here would stop drift repair for good, and silently."""
        while True:
            await asyncio.sleep(self.settings.resync_seconds)
            started = time.monotonic()
            try:
                visited = await self.resync_once()
            except KubeError as exc:
                log.warning("drift repair pass failed: %s", exc)
            except Exception:
                log.exception("drift repair pass failed")
            else:
                log.debug(
                    "drift repair pass",
                    extra={"objects": visited, "seconds": round(time.monotonic() - started, 3)},
                )

    async def _read_live(self, namespace: str, name: str) -> LLMDeployment | None:
        """The object as it is now; None when it is gone, being deleted, or invalid (the
        spec handlers report that one), so a child's event never undoes garbage collection."""
        body = await self.client.get(LLM_DEPLOYMENTS, namespace, name)
        if body is None or body.get("metadata", {}).get("deletionTimestamp"):
            return None
        try:
            return LLMDeployment.model_validate(body)
        except ValidationError:
            return None

    async def repair(self, namespace: str, name: str, *, follow: bool = True) -> None:
        """Reconcile one LLMDeployment now (a child or an adapter of it changed, or it was
        deleted: then its adapters are judged, and refused, without it)."""
        if dep := await self._read_live(namespace, name):
            await self.reconcile(dep, follow=follow)
            return
        judged = await self.adapters.judge_namespace(namespace)
        if follow:
            await self._follow(namespace, judged.changed - {name})

    async def refresh_status(self, namespace: str, name: str) -> None:
        """Recompute status from the cluster (after an engine Deployment changed)."""
        async with self._lock(namespace, name):
            if dep := await self._read_live(namespace, name):
                refused = render.refusal(dep, self.render_settings)
                why = None if refused is None else (refused.reason, refused.message)
                await self._write_status(dep, None, why)

    async def _observe_fetches(
        self, dep: LLMDeployment
    ) -> tuple[list[dict[str, Any]] | None, dict[str, str]]:
        """Engine pods and their running fetch containers' log tails, for ModelLoading
        (only for downloaded sources; (None, {}) when they cannot be read)."""
        if not dep.spec.model.source.downloads:
            return None, {}
        try:
            pods = (await self.client.list(PODS, dep.namespace, render.selector_string(dep))).items
            logs = {
                name: await self.client.pod_log(
                    dep.namespace, name, FETCH_CONTAINER, LOG_TAIL_LINES
                )
                for name in fetching_pods(pods)
            }
        except KubeError as exc:
            log.warning("cannot read model downloads of %s/%s: %s", dep.namespace, dep.name, exc)
            return None, {}
        return pods, logs

    async def _write_status(
        self, dep: LLMDeployment, error: str | None, refused: tuple[str, str] | None = None
    ) -> None:
        name = render.engine_name(dep)
        if is_group(dep):  # groups: read as a Deployment's status (replicas = groups)
            lws = await self.client.get(LEADER_WORKER_SETS, dep.namespace, name)
            deployment = as_deployment_status(lws)
        else:
            deployment = await self.client.get(DEPLOYMENTS, dep.namespace, name)
        prefill = None
        if dep.spec.disaggregation is not None or dep.status.prefill is not None:
            prefill_name = prefill_object_name(dep.name)
            prefill = await self.client.get(DEPLOYMENTS, dep.namespace, prefill_name)
        pods, logs = await self._observe_fetches(dep)
        observed = Observed(
            deployment, error, refused, pods=pods, fetch_logs=logs, prefill_deployment=prefill
        )
        new = compute_status(dep, observed, self.endpoint, _now())
        if status_patch(new) == status_patch(dep.status):
            return
        await self.client.patch_status(
            LLM_DEPLOYMENTS, dep.namespace, dep.name, status_patch(new), FIELD_MANAGER_OPERATOR
        )
        for event in transition_events(dep.status, new):
            await self.post_event(_event_target(dep), event)

    async def _post_event(self, target: dict[str, Any], event: EventSpec) -> None:
        """Through our own client, not kopf's poster: kopf's works only inside its handlers,
        and the drift-repair pass is not one. An Event is best effort; its failure is logged."""
        try:
            await self.client.create_event(
                target,
                reason=event.reason,
                message=event.message,
                component=FIELD_MANAGER_OPERATOR,
                type=event.type,
            )
        except KubeError as exc:
            log.warning("cannot post event %s: %s", event.reason, exc)


EventPoster = Callable[[dict[str, Any], EventSpec], Awaitable[None]]


def _event_target(dep: LLMDeployment) -> dict[str, Any]:
    return {
        "apiVersion": FULL_API_VERSION,
        "kind": KIND,
        "metadata": {"name": dep.name, "namespace": dep.namespace, "uid": dep.metadata.uid},
    }
