"""`servefleet autoscaler`: queue-depth autoscaling of every LLMDeployment in a namespace."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

from servefleet.cli.logs import setup_logging


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--namespace", default=os.environ.get("POD_NAMESPACE", "default"))
    a("--gateway-url", default="http://servefleet-gateway:8080", help="gateway base URL")
    a("--gateway-key-file", default=None, help="bearer key for the gateway's internal API")
    a("--interval", type=float, default=5.0, help="seconds between decisions")
    a("--metrics-port", type=int, default=9090, help="Prometheus /metrics (0: off)")
    a("--log-level", default="info")


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    return asyncio.run(_run(args))


async def _run(args: argparse.Namespace) -> int:
    import httpx
    from prometheus_client import start_http_server

    from servefleet.autoscaler.cluster import ClusterAutoscaler
    from servefleet.autoscaler.kube import KubeClient
    from servefleet.autoscaler.observe import HttpGatewaySource
    from servefleet.autoscaler.telemetry import AutoscalerMetrics

    log = logging.getLogger("servefleet.autoscaler")
    try:
        kube = KubeClient.in_cluster()
    except (KeyError, OSError) as exc:
        log.error("not running in a cluster (no service account): %s", exc)
        return 2
    key = None
    if args.gateway_key_file:
        with open(args.gateway_key_file) as f:
            key = f.read().strip()
    metrics = AutoscalerMetrics()
    if args.metrics_port:
        start_http_server(args.metrics_port, registry=metrics.registry)
    async with httpx.AsyncClient(timeout=3.0) as http:
        gateway = HttpGatewaySource(args.gateway_url, http, key)
        await ClusterAutoscaler(kube, args.namespace, gateway, metrics, http).run(args.interval)
    return 0
