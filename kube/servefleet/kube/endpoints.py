"""The addresses an EndpointSlice lists, as URLs: how the gateway finds engine replicas and
the autoscaler finds gateway replicas."""

from __future__ import annotations

from typing import Any

from servefleet.api.conventions import LABEL_SERVICE_NAME


def service_selector(service: str) -> str:
    """Label selector of the EndpointSlices Kubernetes maintains for a Service."""
    return f"{LABEL_SERVICE_NAME}={service}"


def address_url(address: str, port: int | str, scheme: str = "http") -> str:
    """An IP address and port as a base URL, an IPv6 one in brackets: how the gateway names a
    replica (from an EndpointSlice) and the autoscaler a pod (from its podIP), so that the
    two names of one replica are the same string."""
    host = f"[{address}]" if ":" in address else address
    return f"{scheme}://{host}:{port}"


def slice_endpoints(
    endpoint_slice: dict[str, Any], port_name: str | None, scheme: str = "http"
) -> tuple[list[str], list[str]]:
    """(all endpoint URLs, ready ones) of one EndpointSlice; `port_name` None: its first port.

    Terminating endpoints are left out entirely: a draining pod must get no new requests.
    """
    port = None
    for candidate in endpoint_slice.get("ports") or []:
        if port_name is None or candidate.get("name") == port_name:
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
            url = address_url(address, port, scheme)
            every.append(url)
            if conditions.get("ready", True):
                ready.append(url)
    return every, ready
