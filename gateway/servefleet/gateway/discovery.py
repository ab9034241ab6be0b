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


class EndpointSliceWatcher:
    def __init__(
        self,
        api: KubernetesApi,
        service: ServiceRef,
        *,
        retry_s: float = 1.0,
    ) -> None:
        self.api = api
        self.service = service
        self.retry_s = retry_s
        self._slices: dict[str, dict[str, Any]] = {}
        self._path = f"/apis/discovery.k8s.io/v1/namespaces/{service.namespace}/endpointslices"
        self._selector = f"kubernetes.io/service-name={service.name}"

    def _publish(self, on_endpoints: OnEndpoints) -> None:
        every: list[str] = []
        ready: list[str] = []
        for endpoint_slice in self._slices.values():
            e, r = slice_endpoints(endpoint_slice, self.service)
            every += e
            ready += r
        on_endpoints(sorted(set(every)), sorted(set(ready)))

    async def run(self, on_endpoints: OnEndpoints) -> None:
        """Keep `on_endpoints` up to date until cancelled."""
        async with self.api.client() as client:
            while True:
                try:
                    version = await self._list(client, on_endpoints)
                    await self._watch(client, version, on_endpoints)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # any break: list again
                    log.warning("endpointslice watch of %s broke: %s", self.service.name, exc)
                await asyncio.sleep(self.retry_s)

    async def _list(self, client: httpx.AsyncClient, on_endpoints: OnEndpoints) -> str:
        response = await client.get(self._path, params={"labelSelector": self._selector})
        response.raise_for_status()
        body = response.json()
        self._slices = {item["metadata"]["name"]: item for item in body.get("items") or []}
        self._publish(on_endpoints)
        return str(body.get("metadata", {}).get("resourceVersion", ""))

    async def _watch(
        self, client: httpx.AsyncClient, version: str, on_endpoints: OnEndpoints
    ) -> None:
        params = {
            "labelSelector": self._selector,
            "watch": "true",
            "resourceVersion": version,
            "allowWatchBookmarks": "true",
        }
        async with client.stream("GET", self._path, params=params) as response:
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
                name = obj.get("metadata", {}).get("name")
                if name is None:
                    continue
                if kind == "DELETED":
                    self._slices.pop(name, None)
                else:
                    self._slices[name] = obj
                self._publish(on_endpoints)
