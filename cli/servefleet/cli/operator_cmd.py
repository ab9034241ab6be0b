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


SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def default_system_namespace() -> str:
    """The namespace the operator runs in: $POD_NAMESPACE, the in-cluster one, else servefleet."""
    if found := os.environ.get("POD_NAMESPACE"):
        return found
    try:
        with open(SERVICE_ACCOUNT_NAMESPACE) as file:
            return file.read().strip() or "servefleet"
    except OSError:
        return "servefleet"


def _listed(variable: str) -> list[str]:
    return [item.strip() for item in os.environ.get(variable, "").split(",") if item.strip()]


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
        "--route-signing-key-file",
        default=os.environ.get("SERVEFLEET_ROUTE_SIGNING_KEY_FILE"),
        help="file with the HMAC key the route ConfigMaps are signed with (the gateway's "
        "--route-signing-key-file holds the same key); required",
    )
    parser.add_argument(
        "--system-namespace",
        default=default_system_namespace(),
        help="the chart's namespace: engine pods admit its gateway and autoscaler pods only "
        "(default: $POD_NAMESPACE, the pod's own)",
    )
    parser.add_argument(
        "--metrics-namespace",
        action="append",
        default=_listed("SERVEFLEET_METRICS_NAMESPACES"),
        help="a namespace whose pods (Prometheus) may scrape engine pods (repeatable; "
        "default: none)",
    )
    parser.add_argument(
        "--allowed-image",
        action="append",
        default=None,
        help="an engine image teams may use: a repository (any tag), an exact reference, or "
        "REGISTRY/PATH/* (repeatable; default: vLLM's and SGLang's official repositories; "
        "--engine-image is always allowed)",
    )
    parser.add_argument(
        "--allowed-host-path-prefix",
        action="append",
        default=_listed("SERVEFLEET_ALLOWED_HOST_PATH_PREFIXES"),
        help="a node folder model.cache.hostPath may be in or under (repeatable; default: "
        "none, so hostPath caches are refused)",
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
    from pydantic import SecretBytes

    from servefleet.api.route_signature import read_signing_key
    from servefleet.kube import KubeAccess, KubeError
    from servefleet.operator.handlers import build_registry
    from servefleet.operator.policy import default_allowed_images
    from servefleet.operator.settings import OperatorSettings

    setup_logging(args.log_level, args.log_format)
    log = logging.getLogger("servefleet.operator")
    if not args.route_signing_key_file:
        log.error("--route-signing-key-file is required: the gateway serves only signed routes")
        return 2
    try:
        key = read_signing_key(args.route_signing_key_file)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    allowed = args.allowed_image
    if allowed is None:
        allowed = _listed("SERVEFLEET_ALLOWED_IMAGES") or list(default_allowed_images())
    settings = OperatorSettings(
        namespaces=args.namespace,
        engine_image=args.engine_image,
        gateway_url=args.gateway_url,
        image_pull_policy=args.image_pull_policy,
        resync_seconds=args.resync_seconds,
        route_signing_key=SecretBytes(key),
        system_namespace=args.system_namespace,
        metrics_namespaces=args.metrics_namespace,
        allowed_images=allowed,
        host_path_prefixes=args.allowed_host_path_prefix,
    )
    access = KubeAccess(kubeconfig=args.kubeconfig, context=args.context)
    try:  # fail now with a clear line, not inside kopf's login retries
        asyncio.run(access.configuration())
    except KubeError as exc:
        log.error("%s", exc)
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
