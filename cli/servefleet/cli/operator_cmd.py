"""`servefleet operator`: run the kopf operator that reconciles LLMDeployments."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from importlib.metadata import PackageNotFoundError, version

from servefleet.cli.logs import add_logging_arguments, setup_logging


def default_engine_image() -> str:
    """The image engine pods run: $SERVEFLEET_ENGINE_IMAGE, else ours at the package version."""
    try:
        tag = version("servefleet")
    except PackageNotFoundError:
        tag = "latest"
    return os.environ.get("SERVEFLEET_ENGINE_IMAGE", f"ghcr.io/servefleet/servefleet:{tag}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, in-cluster, ~/.kube/config)"
    )
    parser.add_argument("--context", help="kubeconfig context (default: the current one)")
    parser.add_argument(
        "--namespace",
        action="append",
        default=[],
        help="namespace to watch (repeatable; default: all namespaces)",
    )
    parser.add_argument(
        "--engine-image", default=default_engine_image(), help="image of servefleet engine pods"
    )
    parser.add_argument(
        "--gateway-url",
        default=os.environ.get(
            "SERVEFLEET_GATEWAY_URL", "http://servefleet-gateway.servefleet.svc:8080"
        ),
        help="base URL of the gateway Service (reported in status.endpoint)",
    )
    parser.add_argument(
        "--image-pull-policy",
        default="IfNotPresent",
        choices=["Always", "IfNotPresent", "Never"],
        help="imagePullPolicy of engine pods",
    )
    parser.add_argument(
        "--resync-seconds", type=float, default=30.0, help="drift-repair period per LLMDeployment"
    )
    parser.add_argument(
        "--health-port",
        type=int,
        default=8081,
        help="port of the /healthz liveness endpoint (0: off)",
    )
    add_logging_arguments(parser)


def run(args: argparse.Namespace) -> int:
    import kopf

    from servefleet.kube import KubeAccess, KubeError
    from servefleet.operator.handlers import build_registry
    from servefleet.operator.reconciler import OperatorSettings

    setup_logging(args.log_level, args.log_format)
    settings = OperatorSettings(
        namespaces=args.namespace,
        engine_image=args.engine_image,
        gateway_url=args.gateway_url,
        image_pull_policy=args.image_pull_policy,
        resync_seconds=args.resync_seconds,
    )
    access = KubeAccess(kubeconfig=args.kubeconfig, context=args.context)
    try:  # fail now with a clear line, not inside kopf's login retries
        asyncio.run(access.configuration())
    except KubeError as exc:
        logging.getLogger("servefleet.operator").error("%s", exc)
        return 2
    registry = build_registry(settings, access)
    liveness = f"http://0.0.0.0:{args.health_port}/healthz" if args.health_port else None
    asyncio.run(
        kopf.operator(
            registry=registry,
            standalone=True,
            clusterwide=not settings.namespaces,
            namespaces=settings.namespaces,
            liveness_endpoint=liveness,
        )
    )
    return 0
