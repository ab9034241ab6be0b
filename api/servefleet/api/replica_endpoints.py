"""What a replica endpoint may be: where the gateway sends prompts and the engine's key.

Only `http(s)://host:port` — no credentials, path, query or fragment, no other scheme — and,
for a replica list posted to the gateway's internal API, only an address inside the
deployment's allowed networks (`allowed_replica_networks`; unset: the addresses and host
names of its static endpoints, nothing when it has none). A name is accepted only as one the
platform itself rendered: it resolves where nobody checked it.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def replica_endpoint_problem(endpoint: str) -> str | None:
    """Why `endpoint` cannot be a replica, or None."""
    try:
        parts = urlsplit(endpoint)
        port = parts.port
    except ValueError as exc:
        return f"is not a URL ({exc})"
    if parts.scheme not in ("http", "https"):
        return "must use http or https"
    if not parts.hostname:
        return "has no host"
    if port is None:
        return "has no port"
    if "@" in parts.netloc:
        return "must not carry credentials"
    extra = parts.query or parts.fragment or endpoint.endswith(("?", "#"))
    if parts.path not in ("", "/") or extra:
        return "must be scheme://host:port only (no path, query or fragment)"
    return None


def parse_networks(cidrs: Sequence[str]) -> list[IPNetwork]:
    """The networks of `cidrs`; raises ValueError naming the first that is not a CIDR."""
    networks = []
    for cidr in cidrs:
        try:
            networks.append(ipaddress.ip_network(cidr, strict=False))
        except ValueError:
            raise ValueError(f"{cidr!r} is not a CIDR") from None
    return networks


def _address(endpoint: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(urlsplit(endpoint).hostname or "")
    except ValueError:
        return None


@dataclass(frozen=True)
class ReplicaTargets:
    """Where one deployment's replicas may be pointed at through the internal API."""

    networks: tuple[IPNetwork, ...]
    hosts: frozenset[str]  # names of static endpoints (only when no networks are configured)
    described: str  # the setting that allows them, for the refusal

    @classmethod
    def of(cls, static: Sequence[str], allowed: Sequence[str] | None) -> ReplicaTargets:
        setting = "the deployment's allowed_replica_networks ({})"
        if allowed is not None:
            described = setting.format(", ".join(allowed) or "none")
            return cls(tuple(parse_networks(allowed)), frozenset(), described)
        networks = tuple(
            ipaddress.ip_network(address) for e in static if (address := _address(e)) is not None
        )
        hosts = frozenset(
            host for e in static if (host := urlsplit(e).hostname) and _address(e) is None
        )
        return cls(
            networks, hosts, setting.format("the static endpoints' hosts" if static else "none")
        )

    def problem(self, endpoint: str) -> str | None:
        """Why `endpoint` may not be a replica of this deployment, or None."""
        problem = replica_endpoint_problem(endpoint)
        if problem is not None:
            return problem
        address = _address(endpoint)
        if address is None:
            allowed = urlsplit(endpoint).hostname in self.hosts
        else:
            allowed = any(address in network for network in self.networks)
        if allowed:
            return None
        return f"is outside {self.described}"
