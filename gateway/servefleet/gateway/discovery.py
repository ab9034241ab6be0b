"""Replica discovery on Kubernetes: watch the EndpointSlices of a deployment's headless Service.

A small list-then-watch client over httpx instead of a full Kubernetes client: the gateway needs
one resource, and a plain HTTP client is easy to point at a fake API server in tests. On any
break (410 Gone, a dropped stream, an API error) it lists again after a short back-off, so the
replica list converges without restarting the gateway.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from servefleet.api.gateway_config import ServiceRef

log = logging.getLogger("servefleet.gateway.discovery")

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")

OnEndpoints = Callable[[list[str], list[str]], None]  # (all endpoints, ready ones)


@dataclass(frozen=True, slots=True)
class KubernetesApi:
    """Where the API server is and how to authenticate to it."""

    base_url: str
    token: str | None = None
    verify: ssl.SSLContext | bool = True

    @classmethod
    def in_cluster(cls) -> KubernetesApi:
        host = os.environ.get("KUBERNETES_SERVICE_HOST")
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise RuntimeError(
                "not running in a Kubernetes pod (KUBERNETES_SERVICE_HOST unset); "
                "use static endpoints instead of a service reference"
            )
        token = (SERVICE_ACCOUNT_DIR / "token").read_text().strip()
        context = ssl.create_default_context(cafile=str(SERVICE_ACCOUNT_DIR / "ca.crt"))
        return cls(f"https://{host}:{port}", token, context)

    @classmethod
    def from_kubeconfig(cls, path: str | os.PathLike[str]) -> KubernetesApi:
        """The current context of a kubeconfig: server, bearer token (or token file) and CA.

        Enough for a ServiceAccount token kubeconfig (what a gateway outside the cluster, or
        a test, uses); client certificates and exec plugins are not supported.
        """
        source = Path(path)
        config = yaml.safe_load(source.read_text()) or {}
        current = config.get("current-context")
        context = _named(config.get("contexts"), current, "context", source)
        cluster = _named(config.get("clusters"), context.get("cluster"), "cluster", source)
        user = _named(config.get("users"), context.get("user"), "user", source)
        token = user.get("token")
        if token is None and user.get("tokenFile"):
            token = Path(user["tokenFile"]).read_text().strip()
        if token is None:
            raise ValueError(f"{source}: user {context.get('user')!r} has no token")
        verify: ssl.SSLContext | bool = True
        if cluster.get("insecure-skip-tls-verify"):
            verify = False
        elif cluster.get("certificate-authority-data"):
            pem = base64.b64decode(cluster["certificate-authority-data"]).decode()
            verify = ssl.create_default_context(cadata=pem)
        elif cluster.get("certificate-authority"):
            verify = ssl.create_default_context(cafile=cluster["certificate-authority"])
        return cls(str(cluster["server"]).rstrip("/"), token, verify)

    def client(self) -> httpx.AsyncClient:
        headers = {"authorization": f"Bearer {self.token}"} if self.token else {}
        return httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            verify=self.verify,
            timeout=httpx.Timeout(10.0, read=None),
        )


def _named(entries: Any, name: Any, field: str, source: Path) -> dict[str, Any]:
    for entry in entries or []:
        if entry.get("name") == name:
            found: dict[str, Any] = entry.get(field) or {}
            return found
    raise ValueError(f"{source}: no {field} named {name!r}")


def slice_endpoints(
    endpoint_slice: dict[str, Any], service: ServiceRef
) -> tuple[list[str], list[str]]:
    """(all endpoint URLs, ready ones) of one EndpointSlice.

    Terminating endpoints are left out entirely: a draining pod must get no new requests.
    """
    ports = endpoint_slice.get("ports") or []
    port = None
    for candidate in ports:
        if service.port_name is None or candidate.get("name") == service.port_name:
            port = candidate.get("port")
            break
    if port is None:
        return [], []
    every: list[str] = []
    ready: list[str] = []
    for endpoint in endpoint_slice.get("endpoints") or []:
        conditions = endpoint.get("conditions") or {}
        if conditions.get("terminating"):
            continue
        for address in endpoint.get("addresses") or []:
            host = f"[{address}]" if ":" in address else address
            url = f"{service.scheme}://{host}:{port}"
            every.append(url)
            if conditions.get("ready", True):
                ready.append(url)
    return every, ready


ObjectKey = tuple[str, str]  # (namespace, name)
OnObjects = Callable[[dict[ObjectKey, dict[str, Any]]], None]


def collection_path(group_version: str, plural: str, namespace: str | None) -> str:
    """`/api/v1/configmaps`, `/api/v1/namespaces/ns/configmaps`, `/apis/g/v/...` alike."""
    root = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
    return f"{root}/namespaces/{namespace}/{plural}" if namespace else f"{root}/{plural}"


def object_key(obj: dict[str, Any]) -> ObjectKey | None:
    meta = obj.get("metadata") or {}
    name = meta.get("name")
    return None if name is None else (str(meta.get("namespace", "")), str(name))


class LabelWatcher:
    """Keeps `on_objects` up to date with every object of one kind carrying a label."""

    def __init__(
        self,
        api: KubernetesApi,
        path: str,
        label_selector: str,
        *,
        retry_s: float = 1.0,
    ) -> None:
        self.api = api
        self.path = path
        self.label_selector = label_selector
        self.retry_s = retry_s
        self.listed = asyncio.Event()  # set once the first list has been published
        self._objects: dict[ObjectKey, dict[str, Any]] = {}

    async def run(self, on_objects: OnObjects) -> None:
        """List and watch until cancelled."""
        async with self.api.client() as client:
            while True:
                try:
                    version = await self._list(client, on_objects)
                    await self._watch(client, version, on_objects)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # any break: list again
                    log.warning("watch of %s broke: %s", self.path, exc)
                await asyncio.sleep(self.retry_s)

    async def _list(self, client: httpx.AsyncClient, on_objects: OnObjects) -> str:
        response = await client.get(self.path, params={"labelSelector": self.label_selector})
        response.raise_for_status()
        body = response.json()
        self._objects = {}
        for item in body.get("items") or []:
            key = object_key(item)
            if key is not None:
                self._objects[key] = item
        on_objects(dict(self._objects))
        self.listed.set()
        return str(body.get("metadata", {}).get("resourceVersion", ""))

    async def _watch(self, client: httpx.AsyncClient, version: str, on_objects: OnObjects) -> None:
        params = {
            "labelSelector": self.label_selector,
            "watch": "true",
            "resourceVersion": version,
            "allowWatchBookmarks": "true",
        }
        async with client.stream("GET", self.path, params=params) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.strip():
                    continue
                event = json.loads(line)
                kind = event.get("type")
                obj = event.get("object") or {}
                if kind == "ERROR":
                    raise RuntimeError(f"watch error: {obj.get('message', obj)}")
                if kind == "BOOKMARK":
                    continue
                key = object_key(obj)
                if key is None:
                    continue
                if kind == "DELETED":
                    self._objects.pop(key, None)
                else:
                    self._objects[key] = obj
                on_objects(dict(self._objects))


class EndpointSliceWatcher:
    """The ready endpoints of one headless Service, from its EndpointSlices."""

    def __init__(
        self,
        api: KubernetesApi,
        service: ServiceRef,
        *,
        retry_s: float = 1.0,
    ) -> None:
        self.service = service
        self._watcher = LabelWatcher(
            api,
            collection_path("discovery.k8s.io/v1", "endpointslices", service.namespace),
            f"kubernetes.io/service-name={service.name}",
            retry_s=retry_s,
        )

    async def run(self, on_endpoints: OnEndpoints) -> None:
        """Keep `on_endpoints` up to date until cancelled."""

        def publish(slices: dict[ObjectKey, dict[str, Any]]) -> None:
            every: list[str] = []
            ready: list[str] = []
            for endpoint_slice in slices.values():
                e, r = slice_endpoints(endpoint_slice, self.service)
                every += e
                ready += r
            on_endpoints(sorted(set(every)), sorted(set(ready)))

        await self._watcher.run(publish)
