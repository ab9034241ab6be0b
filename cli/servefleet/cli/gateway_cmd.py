"""`servefleet gateway --config FILE`: run the tenant-facing gateway."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

import yaml
from pydantic import ValidationError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="GatewayConfig file (YAML or JSON)")
    parser.add_argument("--host", default=None, help="override the config's listen host")
    parser.add_argument("--port", type=int, default=None, help="override the config's port")
    parser.add_argument("--log-level", default="info", help="debug, info, warning, error")
    parser.add_argument(
        "--kube-routes",
        action="store_true",
        help="add the operator's route ConfigMaps (label servefleet.io/gateway-route=true) "
        "to the config, hot, resolving tenant key Secrets through the API server",
    )
    parser.add_argument(
        "--kube-namespace",
        action="append",
        default=[],
        help="with --kube-routes: watch routes only in this namespace (repeatable; "
        "default: all namespaces)",
    )
    parser.add_argument(
        "--kubeconfig",
        default=None,
        help="kubeconfig for the API server (default: $KUBECONFIG, the pod's ServiceAccount, "
        "~/.kube/config)",
    )
    parser.add_argument("--context", default=None, help="kubeconfig context (default: current)")
    parser.add_argument(
        "--secret-refresh-seconds",
        type=float,
        default=30.0,
        help="with --kube-routes: how often referenced Secrets are read again (key rotation)",
    )


def load_config(path: str) -> object:
    from servefleet.api.gateway_config import GatewayConfig

    text = Path(path).read_text()
    data = yaml.safe_load(text) or {}
    return GatewayConfig.model_validate(data)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from servefleet.api.gateway_config import GatewayConfig
    from servefleet.gateway.app import Gateway
    from servefleet.gateway.kube_routes import KubeRoutedGateway, KubeRoutes
    from servefleet.kube import KubeAccess, KubeError

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    try:
        config = load_config(args.config)
    except OSError as exc:
        print(f"servefleet gateway: cannot read {args.config}: {exc.strerror}", file=sys.stderr)
        return 2
    except (yaml.YAMLError, ValidationError) as exc:
        print(f"servefleet gateway: invalid config {args.config}:\n{exc}", file=sys.stderr)
        return 2
    assert isinstance(config, GatewayConfig)
    # Credentials are loaded when the event loop starts (the client belongs to that loop).
    kubernetes = KubeAccess(kubeconfig=args.kubeconfig, context=args.context)
    if args.kube_routes:
        try:  # fail now, not as a gateway that never becomes ready
            asyncio.run(kubernetes.configuration())
        except KubeError as exc:
            print(f"servefleet gateway: {exc}", file=sys.stderr)
            return 2
    try:
        gateway = Gateway(config, kubernetes=kubernetes)
    except (OSError, RuntimeError, ValueError) as exc:  # a missing key file
        print(f"servefleet gateway: {exc}", file=sys.stderr)
        return 2
    app: object = gateway
    if args.kube_routes:
        routes = KubeRoutes(
            gateway,
            config,
            kubernetes,
            namespaces=args.kube_namespace,
            secret_refresh_s=args.secret_refresh_seconds,
        )
        app = KubeRoutedGateway(gateway, routes)
    uvicorn.run(
        app,  # type: ignore[arg-type]
        host=args.host or config.host,
        port=args.port if args.port is not None else config.port,
        log_level=args.log_level,
        access_log=False,
        http="httptools",
        loop="uvloop",
        lifespan="on",
        timeout_keep_alive=75,
    )
    return 0
