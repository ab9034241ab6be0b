"""List, then watch from the listed version, resuming where the stream ended.

A watch ends routinely (the server's timeout); it resumes from the newest resourceVersion
seen, bookmarks included, without listing again. Only when that version has expired
(410 Gone) or the stream broke does it list again, so the objects converge after any break.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from .client import KubeClient, Object
from .errors import KubeError
from .resources import Resource

log = logging.getLogger("servefleet.kube.watch")

ObjectKey = tuple[str, str]  # (namespace, name)
OnObjects = Callable[[dict[ObjectKey, Object]], None]


def object_key(obj: Object) -> ObjectKey | None:
    meta = obj.get("metadata") or {}
    name = meta.get("name")
    return None if name is None else (str(meta.get("namespace", "")), str(name))


class LabelWatcher:
    """Keeps `on_objects` up to date with every object of one kind carrying a label."""

    def __init__(
        self,
        kube: KubeClient,
        resource: Resource,
        namespace: str | None,
        label_selector: str,
        *,
        retry_s: float = 1.0,
        timeout_s: int = 300,
    ) -> None:
        self.kube = kube
        self.resource = resource
        self.namespace = namespace
        self.label_selector = label_selector
        self.retry_s = retry_s
        self.timeout_s = timeout_s
        self.listed = asyncio.Event()  # set once the first list has been published
        self._objects: dict[ObjectKey, Object] = {}

    async def run(self, on_objects: OnObjects) -> None:
        """List and watch until cancelled."""
        while True:
            try:
                version = await self._list(on_objects)
                while True:  # resume after each routine end of the stream
                    version = await self._watch(version, on_objects)
            except asyncio.CancelledError:
                raise
            except KubeError as exc:
                if exc.status == 410:
                    log.info("watch of %s expired; listing again", self.resource.plural)
                    continue
                log.warning("watch of %s broke: %s", self.resource.plural, exc)
            except Exception as exc:  # any break: list again after a pause
                log.warning("watch of %s broke: %r", self.resource.plural, exc)
            await asyncio.sleep(self.retry_s)

    async def _list(self, on_objects: OnObjects) -> str:
        listed = await self.kube.list(self.resource, self.namespace, self.label_selector)
        self._objects = {}
        for item in listed.items:
            key = object_key(item)
            if key is not None:
                self._objects[key] = item
        on_objects(dict(self._objects))
        self.listed.set()
        return listed.resource_version

    async def _watch(self, version: str, on_objects: OnObjects) -> str:
        """One watch stream; returns the newest resourceVersion it saw."""
        async for event in self.kube.watch(
            self.resource,
            self.namespace,
            version,
            label_selector=self.label_selector,
            timeout_s=self.timeout_s,
        ):
            version = str((event.object.get("metadata") or {}).get("resourceVersion") or version)
            if event.type == "BOOKMARK":
                continue
            key = object_key(event.object)
            if key is None:
                continue
            if event.type == "DELETED":
                self._objects.pop(key, None)
            else:
                self._objects[key] = event.object
            on_objects(dict(self._objects))
        return version
