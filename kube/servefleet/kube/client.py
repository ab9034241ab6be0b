"""A thin typed facade over the generated client's `ApiClient`: dicts in, dicts out.

Every component speaks to the API server through this class. Calls go through
`ApiClient.call_api` with the resource's path, so custom resources (LLMDeployment,
ServiceMonitor) and built-in kinds take the same road, with the same credentials, token
refresh and TLS setup, and every failure surfaces as one `KubeError`.
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

import aiohttp
from kubernetes_asyncio.client import ApiClient, Configuration
from kubernetes_asyncio.client.exceptions import OpenApiException
from pydantic import BaseModel, ConfigDict, Field

from .config import Credentials, current_credentials
from .errors import KubeError
from .resources import EVENTS, PODS, Resource, resource_of

Object = dict[str, Any]
MERGE_PATCH = "application/merge-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"


class ObjectList(BaseModel):
    """One list call: the objects and the resourceVersion a watch resumes from."""

    items: list[Object] = Field(default_factory=list)
    resource_version: str = ""


class WatchEvent(BaseModel):
    """One event of a watch stream (ERROR events are raised as KubeError instead)."""

    model_config = ConfigDict(frozen=True)

    type: Literal["ADDED", "MODIFIED", "DELETED", "BOOKMARK"]
    object: Object


class KubeClient:
    """The API calls servefleet makes; one pooled HTTP session, closed by `aclose`.

    Made by `KubeAccess.connect()`, which finds the credentials.
    """

    def __init__(
        self, configuration: Configuration, namespace: str = "default", timeout_s: float = 30.0
    ) -> None:
        self.namespace = namespace
        self._api = ApiClient(configuration)
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def __aenter__(self) -> KubeClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._api.close()

    async def credentials(self) -> Credentials:
        """The credentials in use now (refreshed first), for handing to another client."""
        return await current_credentials(self._api.configuration, self.namespace)

    # -- transport ----------------------------------------------------------------------

    async def _send(
        self,
        method: str,
        path: str,
        *,
        query: dict[str, str] | None = None,
        body: Object | None = None,
        content_type: str = "application/json",
        timeout: aiohttp.ClientTimeout | None = None,
    ) -> aiohttp.ClientResponse:
        """The raw response, status unchecked; the caller releases it."""
        try:
            response: aiohttp.ClientResponse = await self._api.call_api(
                path,
                method,
                query_params=query or {},
                header_params={"Content-Type": content_type, "Accept": "application/json"},
                body=body,
                auth_settings=["BearerToken"],
                _preload_content=False,
                _request_timeout=timeout or self._timeout,
            )
        except (aiohttp.ClientError, TimeoutError, OpenApiException, OSError) as exc:
            raise KubeError(0, f"{method} {path}: {exc or type(exc).__name__}") from exc
        return response

    async def _json(
        self, method: str, path: str, *, missing_ok: bool = False, **kwargs: Any
    ) -> Object | None:
        """The JSON body of a successful call; None for a 404 when `missing_ok`."""
        response = await self._send(method, path, **kwargs)
        try:
            text = await response.text()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise KubeError(0, f"{method} {path}: {exc}") from exc
        finally:
            response.release()
        if response.status == 404 and missing_ok:
            return None
        if response.status >= 400:
            raise KubeError(response.status, _status_message(text) or response.reason or "")
        body: Object = json.loads(text) if text else {}
        return body

    async def _required(self, method: str, path: str, **kwargs: Any) -> Object:
        body = await self._json(method, path, **kwargs)
        assert body is not None  # missing_ok is False: a 404 raised
        return body

    # -- reads --------------------------------------------------------------------------

    async def get(self, resource: Resource, namespace: str | None, name: str) -> Object | None:
        """One object, or None when it does not exist."""
        return await self._json("GET", resource.path(namespace, name), missing_ok=True)

    async def list(
        self, resource: Resource, namespace: str | None, label_selector: str | None = None
    ) -> ObjectList:
        """Every object of a kind (namespace None: cluster-wide), following pagination."""
        query = {"limit": "500"} | ({"labelSelector": label_selector} if label_selector else {})
        result = ObjectList()
        while True:
            page = await self._required("GET", resource.path(namespace), query=query)
            result.items += page.get("items") or []
            meta = page.get("metadata") or {}
            result.resource_version = str(meta.get("resourceVersion", ""))
            if not meta.get("continue"):
                return result
            query["continue"] = str(meta["continue"])

    async def has_api(self, group_version: str, plural: str) -> bool:
        """Whether the cluster serves a resource (ServiceMonitor: only with Prometheus Operator)."""
        body = await self._json("GET", f"/apis/{group_version}", missing_ok=True)
        return body is not None and any(
            r.get("name") == plural for r in body.get("resources") or []
        )

    async def pod_log(self, namespace: str, name: str, container: str, tail_lines: int = 20) -> str:
        """The last lines a container logged (what `kubectl logs --tail` shows)."""
        path = PODS.path(namespace, name, "log")
        query = {"container": container, "tailLines": str(tail_lines)}
        response = await self._send("GET", path, query=query)
        try:
            text = await response.text()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise KubeError(0, f"GET {path}: {exc}") from exc
        finally:
            response.release()
        if response.status >= 400:
            raise KubeError(response.status, _status_message(text) or response.reason or "")
        return text

    # -- writes -------------------------------------------------------------------------

    async def apply(self, obj: Object, field_manager: str, *, force: bool = True) -> Object:
        """Server-side apply; with `force` this manager takes every field it sets."""
        meta = obj["metadata"]
        path = resource_of(obj).path(meta.get("namespace"), meta["name"])
        query = {"fieldManager": field_manager, "force": "true" if force else "false"}
        return await self._required("PATCH", path, query=query, body=obj, content_type=APPLY_PATCH)

    async def create(self, obj: Object, field_manager: str) -> bool:
        """POST a new object; False when one of that name exists already (it is left as is).

        For objects that must be written once and never overwritten (a generated key), with
        only the `create` verb: no `get`, which on Secrets would mean reading them."""
        meta = obj["metadata"]
        path = resource_of(obj).path(meta.get("namespace"))
        try:
            await self._required("POST", path, query={"fieldManager": field_manager}, body=obj)
        except KubeError as exc:
            if exc.status == 409:
                return False
            raise
        return True

    async def delete(self, resource: Resource, namespace: str | None, name: str) -> bool:
        """Delete one object (its dependents in the background); False when it was gone."""
        body = await self._json(
            "DELETE",
            resource.path(namespace, name),
            body={"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"},
            missing_ok=True,
        )
        return body is not None

    async def patch(
        self,
        resource: Resource,
        namespace: str | None,
        name: str,
        patch: Object,
        field_manager: str,
        *,
        subresource: str | None = None,
    ) -> Object | None:
        """A JSON merge patch (of `subresource` when given); None when the object is gone."""
        return await self._json(
            "PATCH",
            resource.path(namespace, name, subresource),
            query={"fieldManager": field_manager},
            body=patch,
            content_type=MERGE_PATCH,
            missing_ok=True,
        )

    async def patch_status(
        self, resource: Resource, namespace: str, name: str, patch: Object, field_manager: str
    ) -> Object | None:
        """A merge patch of the status subresource; None when the object is gone."""
        return await self.patch(
            resource, namespace, name, patch, field_manager, subresource="status"
        )

    async def get_scale(self, resource: Resource, namespace: str, name: str) -> int | None:
        """`spec.replicas` as the scale subresource reports it; None while it is unset.

        For a custom resource whose replicas field is optional (LLMDeployment: unset means
        the warm minimum) the API server answers a scale read with a 500 "the spec replicas
        field ... does not exist"; that is an unset field, not a failure. Writing the scale
        works either way.
        """
        try:
            scale = await self._required("GET", resource.path(namespace, name, "scale"))
        except KubeError as exc:
            if (
                exc.status == 500
                and "replicas field" in exc.message
                and "does not exist" in exc.message
            ):
                return None
            raise
        replicas = (scale.get("spec") or {}).get("replicas")
        return None if replicas is None else int(replicas)

    async def set_scale(
        self,
        resource: Resource,
        namespace: str,
        name: str,
        replicas: int,
        field_manager: str,
        resource_version: str | None = None,
    ) -> None:
        """Write `spec.replicas` through the scale subresource, as an HPA does. With
        `resource_version`, only over that version of the object (else a KubeError 409)."""
        body: Object = {"spec": {"replicas": replicas}}
        if resource_version is not None:
            body["metadata"] = {"resourceVersion": resource_version}
        await self._required(
            "PATCH",
            resource.path(namespace, name, "scale"),
            query={"fieldManager": field_manager},
            body=body,
            content_type=MERGE_PATCH,
        )

    async def create_event(
        self,
        involved: Object,
        *,
        reason: str,
        message: str,
        component: str,
        type: Literal["Normal", "Warning"] = "Normal",
    ) -> Object:
        """A core/v1 Event about `involved` (apiVersion, kind, metadata.name/namespace/uid)."""
        meta = involved.get("metadata") or {}
        namespace = str(meta.get("namespace") or self.namespace)
        now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{meta['name']}.{uuid.uuid4().hex[:12]}", "namespace": namespace},
            "involvedObject": {
                "apiVersion": involved["apiVersion"],
                "kind": involved["kind"],
                "name": meta["name"],
                "namespace": namespace,
                **({"uid": meta["uid"]} if meta.get("uid") else {}),
            },
            "reason": reason,
            "message": message,
            "type": type,
            "source": {"component": component},
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        return await self._required("POST", EVENTS.path(namespace), body=event)

    # -- watch --------------------------------------------------------------------------

    async def watch(
        self,
        resource: Resource,
        namespace: str | None,
        resource_version: str,
        *,
        label_selector: str | None = None,
        timeout_s: int = 300,
    ) -> AsyncIterator[WatchEvent]:
        """Events after `resource_version` until the server ends the stream (`timeout_s`).

        Bookmarks are passed on so the caller can resume from the newest version; an expired
        version (410 Gone) or any other ERROR event raises KubeError with its code.
        """
        query = {
            "watch": "true",
            "resourceVersion": resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(timeout_s),
        } | ({"labelSelector": label_selector} if label_selector else {})
        read_timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=timeout_s + 30)
        path = resource.path(namespace)
        response = await self._send("GET", path, query=query, timeout=read_timeout)
        try:
            if response.status >= 400:
                raise KubeError(response.status, _status_message(await response.text()))
            async for raw in response.content:
                if raw.strip():
                    yield _watch_event(json.loads(raw))
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            raise KubeError(0, f"watch of {resource.plural} broke: {exc!r}") from exc
        finally:
            response.release()


def _watch_event(event: Object) -> WatchEvent:
    obj = event.get("object") or {}
    if event.get("type") == "ERROR":
        raise KubeError(int(obj.get("code") or 0), str(obj.get("message", obj)))
    return WatchEvent(type=event["type"], object=obj)


def _status_message(text: str) -> str:
    """The `message` of a Kubernetes Status body, else the text itself (never a secret:
    error bodies name objects and reasons, not data)."""
    try:
        body = json.loads(text)
    except ValueError:
        return text.strip()
    return str(body.get("message", text)) if isinstance(body, dict) else text.strip()
