"""Replica discovery on Kubernetes: watch the EndpointSlices of a deployment's headless Service.

The list-then-watch (resume from the last version, list again after 410 Gone or any break)
is `servefleet.kube`'s; this module only turns slices into the replica URLs the pool routes to.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from servefleet.api.gateway_config import ServiceRef
from servefleet.kube import KubeAccess
from servefleet.kube.endpoints import service_selector, slice_endpoints
from servefleet.kube.resources import ENDPOINT_SLICES

if TYPE_CHECKING:
    from servefleet.kube import ObjectKey

OnEndpoints = Callable[[list[str], list[str]], None]  # (all endpoints, ready ones)


class EndpointSliceWatcher:
    """The endpoints of one headless Service, from its EndpointSlices."""

    def __init__(
        self, access: KubeAccess | None, service: ServiceRef, *, retry_s: float = 1.0
    ) -> None:
        """`access` None: the default credentials (the pod's ServiceAccount in a cluster)."""
        self.access = access or KubeAccess()
        self.service = service
        self.retry_s = retry_s

    async def run(self, on_endpoints: OnEndpoints) -> None:
        """Keep `on_endpoints` up to date until cancelled."""
        from servefleet.kube import LabelWatcher  # the client loads only when a Service is used

        def publish(slices: dict[ObjectKey, dict[str, Any]]) -> None:
            every: list[str] = []
            ready: list[str] = []
            for endpoint_slice in slices.values():
                e, r = slice_endpoints(endpoint_slice, self.service.port_name, self.service.scheme)
                every += e
                ready += r
            on_endpoints(sorted(set(every)), sorted(set(ready)))

        async with await self.access.connect() as kube:
            watcher = LabelWatcher(
                kube,
                ENDPOINT_SLICES,
                self.service.namespace,
                service_selector(self.service.name),
                retry_s=self.retry_s,
            )
            await watcher.run(publish)
