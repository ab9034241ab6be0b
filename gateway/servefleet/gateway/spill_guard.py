"""Where a Kubernetes route may spill over to: hosted APIs, never the cluster's insides.

A team writes `spillover.baseURL` in its LLMDeployment and the gateway sends prompts there
and relays the answers back: pointed at `169.254.169.254` (cloud metadata), `127.0.0.1` (the
gateway's own ports) or a Service's cluster address, that would turn the gateway into the
team's proxy into places it cannot reach itself. So a route's target must be http(s), carry
no credentials, and its host — a literal address, or every address its name resolves to when
the route loads — must be global; the platform admin may allow more in the gateway's base
config (`spillover_allowed_hosts`: host names, or CIDRs). The name is resolved when the route
loads, not at every connection: a name that later resolves elsewhere (DNS rebinding) is not
caught; allow-list hosts you trust for that.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Iterable, Mapping, Sequence
from urllib.parse import urlsplit

log = logging.getLogger("servefleet.gateway.spill_guard")

RESOLVE_TIMEOUT_S = 2.0
ALLOW_SETTING = "spillover_allowed_hosts in the gateway's base config"

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolved = Mapping[str, Sequence[str] | None]
"""host -> its addresses (None: it did not resolve)."""


def spill_host(base_url: str) -> str | None:
    """The host a base URL names (lower-case), or None when it has none."""
    try:
        host = urlsplit(base_url).hostname
    except ValueError:
        return None
    return host.lower() if host else None


def _literal(host: str) -> Address | None:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _allowed(
    address: Address, networks: Iterable[ipaddress.IPv4Network | ipaddress.IPv6Network]
) -> bool:
    return address.is_global or any(address in network for network in networks)


def _networks(allowed: Iterable[str]) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    found = []
    for entry in allowed:
        try:
            found.append(ipaddress.ip_network(entry, strict=False))
        except ValueError:
            continue  # a host name
    return found


def spill_problem(base_url: str, resolved: Resolved, allowed: Sequence[str]) -> str | None:
    """Why a route may not spill over to `base_url`, or None."""
    try:
        parts = urlsplit(base_url)
    except ValueError as exc:
        return f"spill-over baseURL {base_url!r} is not a URL ({exc})"
    host = spill_host(base_url)
    if parts.scheme not in ("http", "https") or host is None:
        return f"spill-over baseURL {base_url!r} must be http(s)://host..."
    if "@" in parts.netloc:
        return f"spill-over baseURL {base_url!r} must not carry credentials"
    if host in {a.lower() for a in allowed}:
        return None
    networks = _networks(allowed)
    literal = _literal(host)
    addresses: list[Address]
    if literal is not None:
        addresses = [literal]
    else:
        found = resolved.get(host)
        if not found:
            return f"spill-over host {host} does not resolve (tried again at the next refresh)"
        addresses = [a for a in (_literal(x.split("%", 1)[0]) for x in found) if a is not None]
        if len(addresses) != len(found):
            return f"spill-over host {host} resolves to {', '.join(found)}: not addresses"
    for address in addresses:
        if not _allowed(address, networks):
            return (
                f"spill-over host {host} is {address}, not a public address: allow it in "
                f"{ALLOW_SETTING}"
            )
    return None


async def resolve_hosts(
    hosts: Iterable[str], timeout_s: float = RESOLVE_TIMEOUT_S
) -> dict[str, list[str] | None]:
    """Every address of each host name (literals are not looked up); None when it fails."""
    loop = asyncio.get_running_loop()

    async def one(host: str) -> list[str] | None:
        try:
            infos = await asyncio.wait_for(
                loop.getaddrinfo(host, None, type=socket.SOCK_STREAM), timeout_s
            )
        except (OSError, TimeoutError) as exc:
            log.warning("spill-over host %s does not resolve: %s", host, exc)
            return None
        return sorted({str(info[4][0]) for info in infos})

    names = sorted({h for h in hosts if _literal(h) is None})
    answers = await asyncio.gather(*(one(h) for h in names))
    return dict(zip(names, answers, strict=True))
