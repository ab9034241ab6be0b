"""Cluster DNS for the e2e node: `<service>.<namespace>.svc.cluster.local` -> its ClusterIP.

The chart's pods find each other by Service name (the autoscaler calls the gateway at
`servefleet-gateway.servefleet.svc`), and no CoreDNS image can be pulled here, so this small
UDP responder answers A queries from the API server. Everything else is NXDOMAIN (pods of
the e2e node reach nothing outside the cluster), AAAA for a known Service is empty.

Run: python dns.py --listen 10.244.0.1 --kubeconfig admin.kubeconfig
"""

from __future__ import annotations

import argparse
import json
import socket
import socketserver
import ssl
import struct
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml

DOMAIN = "cluster.local"
TYPE_A = 1
TTL_SECONDS = 5
RCODE_NXDOMAIN = 3


class ServiceLookup:
    """ClusterIP of a Service, read from the API server, cached for a couple of seconds."""

    def __init__(self, kubeconfig: Path) -> None:
        config = yaml.safe_load(kubeconfig.read_text())
        self.server = config["clusters"][0]["cluster"]["server"].rstrip("/")
        self.token = config["users"][0]["user"]["token"]
        self.context = ssl.create_default_context()
        self.context.check_hostname = False
        self.context.verify_mode = ssl.CERT_NONE
        self.cache: dict[tuple[str, str], tuple[float, str | None]] = {}

    def cluster_ip(self, namespace: str, name: str) -> str | None:
        key = (namespace, name)
        hit = self.cache.get(key)
        if hit and time.monotonic() - hit[0] < 2.0:
            return hit[1]
        url = f"{self.server}/api/v1/namespaces/{namespace}/services/{name}"
        request = urllib.request.Request(url, headers={"Authorization": f"Bearer {self.token}"})
        address: str | None = None
        try:
            with urllib.request.urlopen(request, timeout=3, context=self.context) as response:
                ip = json.load(response).get("spec", {}).get("clusterIP")
                address = ip if ip and ip != "None" else None
        except (urllib.error.URLError, OSError, ValueError):
            address = None
        self.cache[key] = (time.monotonic(), address)
        return address


def parse_question(packet: bytes) -> tuple[str, int, int]:
    """(name, qtype, offset just past the question) of the first question."""
    labels, offset = [], 12
    while packet[offset]:
        length = packet[offset]
        labels.append(packet[offset + 1 : offset + 1 + length].decode("ascii", "replace"))
        offset += 1 + length
    qtype = struct.unpack("!H", packet[offset + 1 : offset + 3])[0]
    return ".".join(labels).lower(), qtype, offset + 5


def answer(packet: bytes, lookup: ServiceLookup) -> bytes:
    ident, flags = struct.unpack("!HH", packet[:4])
    name, qtype, end = parse_question(packet)
    question = packet[12:end]
    parts = name.split(".")
    address = None
    known = False
    if name.endswith(".svc." + DOMAIN) and len(parts) == 5:
        address = lookup.cluster_ip(parts[1], parts[0])
        known = address is not None
    rcode = 0 if known else RCODE_NXDOMAIN
    records = b""
    if known and qtype == TYPE_A and address:
        records = struct.pack("!HHHIH", 0xC00C, TYPE_A, 1, TTL_SECONDS, 4) + socket.inet_aton(
            address
        )
    # QR, the query's opcode and RD, RA, the rcode.
    reply_flags = 0x8000 | (flags & 0x7900) | 0x0080 | rcode
    header = struct.pack("!HHHHHH", ident, reply_flags, 1, 1 if records else 0, 0, 0)
    return header + question + records


class Handler(socketserver.BaseRequestHandler):
    lookup: ServiceLookup

    def handle(self) -> None:
        data, sock = self.request
        try:
            reply = answer(data, self.lookup)
        except (IndexError, struct.error, UnicodeError):
            return
        sock.sendto(reply, self.client_address)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--listen", required=True)
    parser.add_argument("--port", type=int, default=53)
    parser.add_argument("--kubeconfig", type=Path, required=True)
    args = parser.parse_args()
    Handler.lookup = ServiceLookup(args.kubeconfig)
    with socketserver.ThreadingUDPServer((args.listen, args.port), Handler) as server:
        server.serve_forever()


if __name__ == "__main__":
    main()
