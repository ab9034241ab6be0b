"""The few Kubernetes API calls the autoscaler makes, over plain httpx.

A full client library would be a heavy dependency for five requests; these are the scale
subresource, pod annotations, Events, and two lists.
"""

from __future__ import annotations

import datetime as dt
import os
import uuid
from pathlib import Path
from typing import Any

import httpx

from servefleet.api.llmdeployment import API_GROUP, API_VERSION, KIND, PLURAL

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
MERGE_PATCH = {"Content-Type": "application/merge-patch+json"}
FIELD_MANAGER = "servefleet-autoscaler"


class KubeClient:
    def __init__(self, client: httpx.AsyncClient) -> None:
        """`client` carries the API server base URL and credentials."""
        self._http = client

    @classmethod
    def in_cluster(cls) -> KubeClient:
        """The pod's service account (token re-read by httpx on each new client)."""
        host = os.environ["KUBERNETES_SERVICE_HOST"]
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        token = (SERVICE_ACCOUNT_DIR / "token").read_text().strip()
        return cls(
            httpx.AsyncClient(
                base_url=f"https://{host}:{port}",
                headers={"Authorization": f"Bearer {token}"},
                verify=str(SERVICE_ACCOUNT_DIR / "ca.crt"),
                timeout=10.0,
            )
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    def _llmd(self, namespace: str, name: str = "") -> str:
        path = f"/apis/{API_GROUP}/{API_VERSION}/namespaces/{namespace}/{PLURAL}"
        return f"{path}/{name}" if name else path

    async def _json(self, method: str, url: str, **kwargs: Any) -> dict[str, Any]:
        response = await self._http.request(method, url, **kwargs)
        response.raise_for_status()
        body: dict[str, Any] = response.json()
        return body

    async def list_llmdeployments(self, namespace: str) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = (await self._json("GET", self._llmd(namespace)))["items"]
        return items

    async def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        url = f"/api/v1/namespaces/{namespace}/pods"
        body = await self._json("GET", url, params={"labelSelector": selector})
        items: list[dict[str, Any]] = body["items"]
        return items

    async def get_scale(self, namespace: str, name: str) -> int:
        scale = await self._json("GET", self._llmd(namespace, name) + "/scale")
        return int(scale.get("spec", {}).get("replicas", 0))

    async def set_scale(self, namespace: str, name: str, replicas: int) -> None:
        await self._json(
            "PATCH",
            self._llmd(namespace, name) + "/scale",
            json={"spec": {"replicas": replicas}},
            headers=MERGE_PATCH,
            params={"fieldManager": FIELD_MANAGER},
        )

    async def annotate_pod(self, namespace: str, pod: str, annotations: dict[str, str]) -> None:
        await self._json(
            "PATCH",
            f"/api/v1/namespaces/{namespace}/pods/{pod}",
            json={"metadata": {"annotations": annotations}},
            headers=MERGE_PATCH,
            params={"fieldManager": FIELD_MANAGER},
        )

    async def post_event(
        self, *, namespace: str, deployment: str, reason: str, message: str
    ) -> None:
        now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{deployment}.{uuid.uuid4().hex[:12]}", "namespace": namespace},
            "involvedObject": {
                "apiVersion": f"{API_GROUP}/{API_VERSION}",
                "kind": KIND,
                "name": deployment,
                "namespace": namespace,
            },
            "reason": reason,
            "message": message,
            "type": "Normal",
            "source": {"component": FIELD_MANAGER},
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        await self._json("POST", f"/api/v1/namespaces/{namespace}/events", json=event)
