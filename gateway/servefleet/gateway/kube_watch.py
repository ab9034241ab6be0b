"""List-then-watch of one kind of Kubernetes object, selected by label, over plain httpx.

The same shape as the EndpointSlice watcher in `discovery`: list, watch from the list's
resourceVersion, and on any break (410 Gone, a dropped stream, an API error) list again after
a short back-off, so the view converges without a restart. The callback always gets the whole
current set, so a consumer never has to replay events.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

import httpx

from servefleet.gateway.discovery import KubernetesApi

log = logging.getLogger("servefleet.gateway.kube_watch")

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
