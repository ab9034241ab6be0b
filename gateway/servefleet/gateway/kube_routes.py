"""`servefleet gateway --kube-routes`: serve what the operator's route ConfigMaps say, hot.

Watches ConfigMaps labelled `servefleet.io/gateway-route=true` (in every namespace, or in the
namespaces given), keeps those the operator signed (`route_merge`: with the key of
`--route-signing-key-file`), resolves the tenant key Secrets they reference through the API
server, checks spill-over targets (`spill_guard`), merges them into the base config file and
calls `Gateway.reconfigure` — no restart, no mounted Secrets.

Secrets are read one by one with GET, only those a route references (so the gateway's RBAC needs
`get` on Secrets, not `list`/`watch`, which would hand it every Secret's content), again every
`secret_refresh_s` to pick up a rotated key, and sooner while one is missing. Of a tenant key
only its SHA-256 is kept; of a spill-over key the value (it must be sent upstream). Keys are
never logged: log lines name Secrets and keys, not values.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from pydantic import SecretStr

from servefleet.api.conventions import ROUTE_LABEL_SELECTOR, SECRETS_MOUNT
from servefleet.api.gateway_config import GatewayConfig, hash_api_key
from servefleet.gateway.app import Gateway
from servefleet.gateway.route_merge import (
    ResolvedSecrets,
    Route,
    RouteError,
    SecretKeyPath,
    merge_routes,
    parse_route,
    referenced_secrets,
    resolve_route,
)
from servefleet.gateway.spill_guard import resolve_hosts, spill_host, spill_problem
from servefleet.kube import KubeAccess, KubeClient, KubeError, LabelWatcher, ObjectKey
from servefleet.kube.resources import CONFIG_MAPS, SECRETS

log = logging.getLogger("servefleet.gateway.kube_routes")

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class SecretReader:
    """GETs the referenced Secrets; keeps digests of tenant keys, values of spill-over keys."""

    def __init__(self, kube: KubeClient) -> None:
        self._kube = kube

    async def read(
        self, tenant_refs: Iterable[SecretKeyPath], spill_refs: Iterable[SecretKeyPath]
    ) -> ResolvedSecrets:
        tenant_set, spill_set = set(tenant_refs), set(spill_refs)
        by_secret: dict[tuple[str, str], list[SecretKeyPath]] = {}
        for ref in tenant_set | spill_set:
            by_secret.setdefault((ref.namespace, ref.name), []).append(ref)
        result = ResolvedSecrets()
        for (namespace, name), refs in sorted(by_secret.items()):
            data = await self._data(namespace, name)
            for ref in refs:
                encoded = data.get(ref.key)
                if encoded is None:
                    continue
                value = _decode(encoded, ref)
                if value is None:
                    continue
                if ref in tenant_set:
                    result.digests[ref] = hash_api_key(value)
                if ref in spill_set:
                    result.values[ref] = SecretStr(value)
            del data  # the Secret's other keys are never kept
        return result

    async def _data(self, namespace: str, name: str) -> dict[str, str]:
        try:
            secret = await self._kube.get(SECRETS, namespace, name)
        except KubeError as exc:
            # The error names the Secret and the reason, never its data.
            raise KubeError(
                exc.status, f"reading Secret {namespace}/{name}: {exc.message}"
            ) from exc
        data: dict[str, str] = (secret or {}).get("data") or {}
        return data


def _decode(encoded: str, ref: SecretKeyPath) -> str | None:
    try:
        return base64.b64decode(encoded, validate=True).decode().strip() or None
    except (binascii.Error, UnicodeDecodeError):
        log.warning("Secret key %s is not base64 text; ignored", ref)
        return None


class KubeRoutes:
    """Route ConfigMaps → `gateway.reconfigure`, until cancelled."""

    def __init__(
        self,
        gateway: Gateway,
        base: GatewayConfig,
        access: KubeAccess,
        *,
        signing_key: bytes,
        namespaces: Iterable[str] = (),
        mount: str = SECRETS_MOUNT,
        secret_refresh_s: float = 30.0,
        missing_retry_s: float = 2.0,
        settle_s: float = 0.2,
    ) -> None:
        self.gateway = gateway
        self.base = base
        self.access = access
        self.signing_key = signing_key
        self.namespaces: list[str | None] = [*namespaces] or [None]
        self.mount = mount
        self.secret_refresh_s = secret_refresh_s
        self.missing_retry_s = missing_retry_s
        self.settle_s = settle_s
        self.synced = asyncio.Event()  # every watch listed once and the result applied
        self.rejected: dict[str, str] = {}  # route id -> reason, for logs and tests
        self.spill_refused: dict[str, str] = {}  # route id -> why its spill-over is off
        self._configmaps: dict[str | None, dict[ObjectKey, dict[str, Any]]] = {}
        self._changed = asyncio.Event()
        self._applied: GatewayConfig | None = None

    def _on_objects(self, namespace: str | None) -> Callable[[dict[ObjectKey, Any]], None]:
        def update(objects: dict[ObjectKey, Any]) -> None:
            self._configmaps[namespace] = objects
            self._changed.set()

        return update

    async def run(self) -> None:
        async with await self.access.connect() as kube:
            await self._run(kube)

    async def _run(self, kube: KubeClient) -> None:
        watchers = [
            LabelWatcher(kube, CONFIG_MAPS, ns, ROUTE_LABEL_SELECTOR) for ns in self.namespaces
        ]
        tasks = [
            asyncio.create_task(w.run(self._on_objects(ns)), name=f"routes-{ns or 'all'}")
            for w, ns in zip(watchers, self.namespaces, strict=True)
        ]
        try:
            reader = SecretReader(kube)
            await asyncio.gather(*(w.listed.wait() for w in watchers))
            while True:
                self._changed.clear()
                try:
                    missing = await self._apply(reader)
                except Exception:  # a bad pass must not end the watch
                    log.exception("applying routes failed; retrying")
                    missing = True
                self.synced.set()
                wait = self.missing_retry_s if missing else self.secret_refresh_s
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), timeout=wait)
                await asyncio.sleep(self.settle_s)  # one apply for a burst of events
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    async def _apply(self, reader: SecretReader) -> bool:
        """One pass: parse, read Secrets, merge, reconfigure. True when a key was missing."""
        routes: list[Route] = []
        rejected: dict[str, str] = {}
        tenant_refs: set[SecretKeyPath] = set()
        spill_refs: set[SecretKeyPath] = set()
        for objects in self._configmaps.values():
            for configmap in objects.values():
                try:
                    route = parse_route(configmap, self.signing_key)
                    tenants, spills = referenced_secrets(route, self.mount)
                except RouteError as exc:
                    meta = configmap.get("metadata") or {}
                    rejected[f"{meta.get('namespace')}/{meta.get('name')}"] = str(exc)
                    continue
                routes.append(route)
                tenant_refs |= tenants
                spill_refs |= spills
        try:
            secrets = await reader.read(tenant_refs, spill_refs)
        except KubeError as exc:
            log.warning("cannot read tenant key Secrets (%s); keeping the current routes", exc)
            return True
        spill_problems = await self._spill_problems(routes)
        self._log_spill_refusals(routes, spill_problems)
        resolved: list[tuple[Route, GatewayConfig]] = []
        missing = False
        for route in routes:
            config, warnings = resolve_route(route, secrets, self.mount, spill_problems)
            for warning in warnings:
                log.warning("%s", warning)
            missing = missing or bool(warnings)
            resolved.append((route, config))
        result = merge_routes(self.base, resolved)
        rejected |= result.rejected
        for route_id, reason in sorted(rejected.items()):
            if self.rejected.get(route_id) != reason:
                log.warning("route %s rejected: %s", route_id, reason)
        self.rejected = rejected
        if result.config != self._applied:
            try:
                self.gateway.reconfigure(result.config)
            except ValueError as exc:
                log.error("routes not applied: %s", exc)
                return True
            self._applied = result.config
            log.info(
                "routes applied: %d served, %d rejected, %d deployments, %d tenants",
                len(result.served),
                len(rejected),
                len(result.config.deployments),
                len(result.config.tenants),
            )
        return missing

    def _log_spill_refusals(self, routes: Iterable[Route], problems: dict[str, str]) -> None:
        """One warning per route whose spill-over target is refused, when that changes."""
        refused = {
            route.id: problems[d.spillover.base_url]
            for route in routes
            for d in route.config.deployments
            if d.spillover is not None and d.spillover.base_url in problems
        }
        for route_id, why in sorted(refused.items()):
            if self.spill_refused.get(route_id) != why:
                log.warning("route %s: %s; spill-over off", route_id, why)
        self.spill_refused = refused

    async def _spill_problems(self, routes: Iterable[Route]) -> dict[str, str]:
        """Spill-over base URL -> why it is refused, for every route's enabled spill-over."""
        urls = {
            d.spillover.base_url
            for route in routes
            for d in route.config.deployments
            if d.spillover is not None and d.spillover.enabled and d.spillover.base_url
        }
        hosts = {h for url in urls if (h := spill_host(url)) is not None}
        resolved = await resolve_hosts(hosts) if hosts else {}
        allowed = self.base.spillover_allowed_hosts
        problems = {url: spill_problem(url, resolved, allowed) for url in urls}
        return {url: why for url, why in problems.items() if why is not None}


class KubeRoutedGateway:
    """The gateway's ASGI app plus the route watch; /ready is 503 until routes are synced.

    A new gateway pod must not answer 401 to every tenant because it has not read the
    routes yet, so readiness waits for the first full sync.
    """

    def __init__(self, gateway: Gateway, routes: KubeRoutes) -> None:
        self.gateway = gateway
        self.routes = routes
        self._task: asyncio.Task[None] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if (
            scope["type"] == "http"
            and scope["path"] == "/ready"
            and not self.routes.synced.is_set()
        ):
            await send(
                {
                    "type": "http.response.start",
                    "status": 503,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            await send({"type": "http.response.body", "body": b'{"status":"syncing routes"}'})
            return
        await self.gateway(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.gateway.start()
                except Exception as exc:
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                self._task = asyncio.create_task(self.routes.run(), name="kube-routes")
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._task is not None:
                    self._task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await self._task
                await self.gateway.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return
