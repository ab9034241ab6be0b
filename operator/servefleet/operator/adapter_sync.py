"""The LLMAdapters of a namespace judged against its LLMDeployments: statuses and Events
written, and the accepted adapters of each deployment handed to its route.

One pass judges every adapter of the namespace, oldest first, so a served name taken by two
adapters goes to the same one whichever deployment is being reconciled (`adapter_checks`).
The operator's only writes here are `llmadapters/status` (merge patch, only when it changed,
on the resourceVersion it judged: the autoscaler writes `Loaded` into the same `conditions`
list, which a merge patch replaces whole, so neither may write over the other) and Events;
it reads `adapter_config.json` over HTTP (`adapter_config`), never a Secret.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from servefleet.api.conventions import FIELD_MANAGER_OPERATOR
from servefleet.api.llmadapter import ADAPTER_KIND, LLMAdapter, LLMAdapterStatus
from servefleet.api.llmdeployment import FULL_API_VERSION, LLMDeployment
from servefleet.kube import KubeClient, KubeError
from servefleet.kube.resources import LLM_ADAPTERS, LLM_DEPLOYMENTS
from servefleet.operator.adapter_checks import (
    NameClaims,
    Verdict,
    adapter_event,
    adapter_status,
    config_verdict,
    fit_verdict,
    missing_deployment,
)
from servefleet.operator.adapter_config import AdapterConfigReader
from servefleet.operator.status import EventSpec

log = logging.getLogger("servefleet.operator")
EventPoster = Callable[[dict[str, Any], EventSpec], Awaitable[None]]


@dataclass
class NamespaceAdapters:
    """One pass over a namespace: accepted adapters per deployment, and the deployments
    whose accepted set this pass changed (their routes are stale until reconciled)."""

    accepted: dict[str, list[LLMAdapter]] = field(default_factory=dict)
    changed: set[str] = field(default_factory=set)


def _order(body: dict[str, Any]) -> tuple[str, str]:
    meta = body.get("metadata") or {}
    return str(meta.get("creationTimestamp") or "~"), str(meta.get("name") or "")


def _deployment_state(body: dict[str, Any]) -> LLMDeployment | str:
    """The live deployment, or why it cannot serve adapters."""
    if (body.get("metadata") or {}).get("deletionTimestamp"):
        return "is being deleted"
    try:
        return LLMDeployment.model_validate(body)
    except ValidationError:
        return "has an invalid spec (see its InvalidSpec event)"


class AdapterSync:
    """Judges the adapters of a namespace; holds the config reader and a lock per namespace."""

    def __init__(
        self,
        client: KubeClient,
        post_event: EventPoster,
        now: Callable[[], str],
        reader: AdapterConfigReader | None = None,
    ) -> None:
        self.client = client
        self.post_event = post_event
        self.reader = reader or AdapterConfigReader()
        self._now = now
        self._locks: dict[str, asyncio.Lock] = {}

    async def _list(self, resource: Any, namespace: str | None, kind: str) -> list[dict[str, Any]]:
        try:
            items = (await self.client.list(resource, namespace)).items
        except KubeError as exc:
            if exc.status == 404 and resource is LLM_ADAPTERS:
                return []  # the LLMAdapter CRD is not installed (yet): no adapters
            raise
        return [b for b in items if b.get("kind", kind) == kind]

    async def namespaces_with_adapters(self, namespace: str | None) -> set[str]:
        """Namespaces holding LLMAdapters (`namespace` only, or all when None)."""
        bodies = await self._list(LLM_ADAPTERS, namespace, ADAPTER_KIND)
        return {str((b.get("metadata") or {}).get("namespace") or "") for b in bodies} - {""}

    async def judge_namespace(self, namespace: str) -> NamespaceAdapters:
        """Judge every adapter of `namespace`; raises KubeError when they cannot be listed
        (then nothing is rendered from a partial picture)."""
        async with self._locks.setdefault(namespace, asyncio.Lock()):
            bodies = sorted(await self._list(LLM_ADAPTERS, namespace, ADAPTER_KIND), key=_order)
            result = NamespaceAdapters()
            if not bodies:
                return result
            states = {
                str(b["metadata"]["name"]): _deployment_state(b)
                for b in await self._list(LLM_DEPLOYMENTS, namespace, "LLMDeployment")
            }
            live = [s for s in states.values() if isinstance(s, LLMDeployment)]
            claims = NameClaims.of(live)
            for body in bodies:
                try:
                    adapter = LLMAdapter.model_validate(body)
                except ValidationError:
                    continue  # reported by the adapter handlers as InvalidSpec
                state = states.get(adapter.spec.deployment, "does not exist")
                dep = state if isinstance(state, LLMDeployment) else None
                if dep is None:
                    verdict = missing_deployment(adapter, str(state))
                else:
                    verdict = await self._judge(adapter, dep, claims)
                await self._record(adapter, verdict, dep, result, _version(body))
            return result

    async def _judge(self, adapter: LLMAdapter, dep: LLMDeployment, claims: NameClaims) -> Verdict:
        fit = fit_verdict(adapter, dep, claims)
        if not fit.accepted:
            return fit
        verdict = config_verdict(adapter, dep, fit, await self.reader.read(adapter.spec.source))
        if verdict.accepted:
            claims.claim(adapter, dep)
        return verdict

    async def _record(
        self,
        adapter: LLMAdapter,
        verdict: Verdict,
        dep: LLMDeployment | None,
        result: NamespaceAdapters,
        version: str,
    ) -> None:
        was = adapter.status.condition("Accepted")
        if (was is not None and was.status == "True") != verdict.accepted:
            result.changed.add(adapter.spec.deployment)
        if verdict.accepted:
            result.accepted.setdefault(adapter.spec.deployment, []).append(adapter)
        await self._write_status(adapter, verdict, dep, version)

    async def _write_status(
        self, adapter: LLMAdapter, verdict: Verdict, dep: LLMDeployment | None, version: str
    ) -> None:
        """Patch the status when it changed, on the resourceVersion judged. A 409 (another
        writer came first) reads it again and writes once more while its spec is the one
        judged (else its update is judged anew); other failures are logged (the next pass
        retries)."""
        for attempt in (1, 2):
            new = adapter_status(adapter, verdict, dep, self._now())
            body = _own_fields(new)
            if body == _own_fields(adapter.status):
                return
            patch = {"metadata": {"resourceVersion": version}} if version else {}
            patch["status"] = body
            try:
                await self.client.patch_status(
                    LLM_ADAPTERS, adapter.namespace, adapter.name, patch, FIELD_MANAGER_OPERATOR
                )
                break
            except KubeError as exc:
                if exc.status != 409:
                    log.warning("status of LLMAdapter %s/%s: %s", adapter.namespace,
                                adapter.name, exc)  # fmt: skip
                    return
                fresh = await self._reread(adapter) if attempt == 1 else None
                if fresh is None:
                    log.info("LLMAdapter %s/%s changed meanwhile: judged again",
                             adapter.namespace, adapter.name)  # fmt: skip
                    return
                adapter, version = fresh
        if verdict.status == "False":
            log.warning("LLMAdapter %s/%s refused: %s", adapter.namespace, adapter.name,
                        verdict.message)  # fmt: skip
        event = adapter_event(adapter.status, new)
        if event is not None:
            await self.post_event(_event_target(adapter), EventSpec(*event))

    async def _reread(self, adapter: LLMAdapter) -> tuple[LLMAdapter, str] | None:
        """The adapter as it is now and its resourceVersion, while its spec is the judged
        one; None otherwise (gone, changed, unreadable)."""
        try:
            body = await self.client.get(LLM_ADAPTERS, adapter.namespace, adapter.name)
            if body is None:
                return None
            fresh = LLMAdapter.model_validate(body)
        except (KubeError, ValidationError):
            return None
        if fresh.metadata.generation != adapter.metadata.generation:
            return None
        return fresh, _version(body)


def _version(body: dict[str, Any]) -> str:
    return str((body.get("metadata") or {}).get("resourceVersion") or "")


OWN_FIELDS = ("observedGeneration", "baseModel", "rank", "targetModules", "conditions")
"""The status fields the operator writes (a merge patch: null removes a field; `conditions`
is a list, so it is written whole, other writers' conditions included as read, on the
resourceVersion read)."""


def _own_fields(status: LLMAdapterStatus) -> dict[str, Any]:
    full = status.model_dump(by_alias=True, exclude_none=True, mode="json")
    return {name: full.get(name) for name in OWN_FIELDS}


def _event_target(adapter: LLMAdapter) -> dict[str, Any]:
    return {
        "apiVersion": FULL_API_VERSION,
        "kind": ADAPTER_KIND,
        "metadata": {
            "name": adapter.name,
            "namespace": adapter.namespace,
            "uid": adapter.metadata.uid,
        },
    }
