"""`servefleet autoscaler`: queue-depth autoscaling of every LLMDeployment it watches."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from servefleet.api.conventions import INTERNAL_API_KEY_ENV
from servefleet.cli.logs import add_logging_arguments, setup_logging


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a(
        "--namespace",
        action="append",
        default=[],
        help="a namespace whose LLMDeployments it scales (repeatable; default: every namespace, "
        "like the operator)",
    )
    a("--kubeconfig", default=None, help="default: $KUBECONFIG, in-cluster, ~/.kube/config")
    a("--context", default=None, help="kubeconfig context (default: the current one)")
    a(
        "--gateway-service",
        default=None,
        help="the gateway Service as NAMESPACE/NAME: every ready replica behind it is read and "
        "their queues summed (default: only --gateway-url)",
    )
    a(
        "--gateway-url",
        default="http://servefleet-gateway:8090",
        help="one gateway's internal base URL (its internal port)",
    )
    a(
        "--internal-api-key-file",
        "--gateway-key-file",  # its former name
        dest="internal_api_key_file",
        default=None,
        metavar="PATH",
        help="file holding the gateway's internal API key, sent as a Bearer token when reading "
        f"/internal/deployments (default: ${INTERNAL_API_KEY_ENV}); required",
    )
    a("--interval", type=float, default=5.0, help="seconds between decisions")
    a("--metrics-port", type=int, default=9090, help="Prometheus /metrics (0: off)")
    add_logging_arguments(parser)


@dataclass(frozen=True)
class KeyProblem:
    message: str


def internal_api_key(path: str | None, environ: Mapping[str, str]) -> str | KeyProblem:
    """The gateway's internal key from `path`, else the environment; every gateway asks for it."""
    if path is not None:
        try:
            key = Path(path).read_text().strip()
        except OSError as exc:
            return KeyProblem(f"cannot read --internal-api-key-file {path}: {exc.strerror}")
    else:
        key = environ.get(INTERNAL_API_KEY_ENV, "").strip()
    if not key:
        return KeyProblem(
            "the gateway's internal API key is needed to read its queues: "
            f"--internal-api-key-file PATH or ${INTERNAL_API_KEY_ENV}"
        )
    return key


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level, args.log_format)
    return asyncio.run(_run(args))


async def _run(args: argparse.Namespace) -> int:
    import httpx
    from prometheus_client import start_http_server

    from servefleet.autoscaler.cluster import ClusterAutoscaler
    from servefleet.autoscaler.gateway_fleet import GatewayFleetSource
    from servefleet.autoscaler.observe import GatewaySource, HttpGatewaySource
    from servefleet.autoscaler.telemetry import AutoscalerMetrics
    from servefleet.kube import KubeAccess, KubeError

    log = logging.getLogger("servefleet.autoscaler")
    key = internal_api_key(args.internal_api_key_file, os.environ)
    if isinstance(key, KeyProblem):
        log.error("%s", key.message)
        return 2
    try:
        kube = await KubeAccess(kubeconfig=args.kubeconfig, context=args.context).connect()
    except KubeError as exc:
        log.error("cannot reach the Kubernetes API: %s", exc)
        return 2
    metrics = AutoscalerMetrics()
    if args.metrics_port:
        start_http_server(args.metrics_port, registry=metrics.registry)
    async with kube, httpx.AsyncClient(timeout=3.0) as http:
        gateway: GatewaySource
        if args.gateway_service:
            namespace, _, service = args.gateway_service.rpartition("/")
            gateway = GatewayFleetSource(
                kube, namespace or kube.namespace, service, http, api_key=key
            )
        else:
            gateway = HttpGatewaySource(args.gateway_url, http, key)
        await ClusterAutoscaler(kube, args.namespace, gateway, metrics, http).run(args.interval)
    return 0
