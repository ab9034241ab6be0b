"""`servefleet gateway --config FILE`: run the tenant-facing gateway."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import yaml
from pydantic import ValidationError

from servefleet.api.conventions import INTERNAL_API_KEY_ENV
from servefleet.cli.listen import bind_listener
from servefleet.cli.logs import add_logging_arguments, setup_logging

if TYPE_CHECKING:
    from servefleet.api.gateway_config import GatewayConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="GatewayConfig file (YAML or JSON)")
    parser.add_argument(
        "--host", default=None, help="listen address (default: the config's `host`)"
    )
    parser.add_argument(
        "--port", type=int, default=None, help="listen port (default: the config's `port`)"
    )
    parser.add_argument(
        "--internal-port",
        type=int,
        default=None,
        help="port of /metrics and /internal/* (default: the config's `internal_port`, 8090); "
        "never served on the tenant port",
    )
    _add_internal_key_argument(parser)
    parser.add_argument(
        "--access-log",
        default=None,
        metavar="FILE|-",
        help="append one JSON line per request (servefleet.api.access_log; replayed by "
        "`servefleet sim --trace`) to FILE, or write it to stdout with -; keys are never logged",
    )
    add_logging_arguments(parser)
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
    parser.add_argument(
        "--route-signing-key-file",
        default=os.environ.get("SERVEFLEET_ROUTE_SIGNING_KEY_FILE"),
        metavar="PATH",
        help="with --kube-routes (required): file holding the key the operator signs routes "
        "with; a route without its valid signature is not served",
    )


def _add_internal_key_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--internal-api-key-file",
        default=None,
        metavar="PATH",
        help="file holding the Bearer key of the internal port (default: the config's "
        f"`internal_api_key`, else ${INTERNAL_API_KEY_ENV}); required whenever the internal "
        "port is served",
    )


def load_config(path: str) -> object:
    from servefleet.api.gateway_config import GatewayConfig

    text = Path(path).read_text()
    data = yaml.safe_load(text) or {}
    return GatewayConfig.model_validate(data)


def with_internal_key(
    config: GatewayConfig, key_file: str | None, port: int | None
) -> GatewayConfig:
    """The config with the internal key the command line (or environment) names, if any."""
    from servefleet.api.gateway_config import SecretValueRef

    from_env = port is not None and INTERNAL_API_KEY_ENV in os.environ
    if key_file is not None:
        ref = SecretValueRef(file=key_file)
    elif config.internal_api_key is None and from_env:
        ref = SecretValueRef(env=INTERNAL_API_KEY_ENV)
    else:
        return config
    return config.model_copy(update={"internal_api_key": ref})


def missing_internal_key(port: int) -> str:
    return (
        f"the internal port {port} is served but no internal API key is set "
        f"(internal_api_key in the config, --internal-api-key-file or ${INTERNAL_API_KEY_ENV})"
    )


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from servefleet.api.gateway_config import GatewayConfig
    from servefleet.api.http_protocol import BoundedHeadProtocol
    from servefleet.api.route_signature import read_signing_key
    from servefleet.gateway.access_log import AccessLog
    from servefleet.gateway.app import Gateway
    from servefleet.gateway.kube_routes import KubeRoutedGateway, KubeRoutes
    from servefleet.gateway.listeners import ByListener
    from servefleet.kube import KubeAccess, KubeError

    setup_logging(args.log_level, args.log_format)
    try:
        config = load_config(args.config)
    except OSError as exc:
        print(f"servefleet gateway: cannot read {args.config}: {exc.strerror}", file=sys.stderr)
        return 2
    except (yaml.YAMLError, ValidationError) as exc:
        print(f"servefleet gateway: invalid config {args.config}:\n{exc}", file=sys.stderr)
        return 2
    assert isinstance(config, GatewayConfig)
    internal_port = args.internal_port if args.internal_port is not None else config.internal_port
    config = with_internal_key(config, args.internal_api_key_file, internal_port)
    if internal_port is not None and config.internal_api_key is None:
        print(f"servefleet gateway: {missing_internal_key(internal_port)}", file=sys.stderr)
        return 2
    # Credentials are loaded when the event loop starts (the client belongs to that loop).
    kubernetes = KubeAccess(kubeconfig=args.kubeconfig, context=args.context)
    if args.kube_routes:
        try:  # fail now, not as a gateway that never becomes ready
            asyncio.run(kubernetes.configuration())
        except KubeError as exc:
            print(f"servefleet gateway: {exc}", file=sys.stderr)
            return 2
    try:
        access_log = AccessLog.open(args.access_log) if args.access_log else None
        gateway = Gateway(config, kubernetes=kubernetes, access_log=access_log)
    except (OSError, RuntimeError, ValueError) as exc:  # a missing key file
        print(f"servefleet gateway: {exc}", file=sys.stderr)
        return 2
    app: object = gateway
    if args.kube_routes:
        try:
            signing_key = read_signing_key(args.route_signing_key_file or "")
        except ValueError as exc:
            print(
                f"servefleet gateway: --kube-routes needs --route-signing-key-file: {exc}",
                file=sys.stderr,
            )
            return 2
        routes = KubeRoutes(
            gateway,
            config,
            kubernetes,
            signing_key=signing_key,
            namespaces=args.kube_namespace,
            secret_refresh_s=args.secret_refresh_seconds,
        )
        app = KubeRoutedGateway(gateway, routes)
    # Bound before serving: a busy port is one line (servefleet.cli.main reports ListenError).
    host = args.host or config.host
    listeners = [bind_listener(host, args.port if args.port is not None else config.port)]
    if internal_port is not None:  # /metrics and /internal/*: see servefleet.gateway.listeners
        listeners.append(bind_listener(host, internal_port, flag="--internal-port"))
        app = ByListener(app, gateway.internal, listeners[1].getsockname()[1])
    server = uvicorn.Server(
        uvicorn.Config(
            app,  # type: ignore[arg-type]
            log_config=None,  # the root handler of servefleet.cli.logs
            log_level=args.log_level,
            access_log=False,
            http=BoundedHeadProtocol,  # slow or huge request heads are cut
            loop="uvloop",
            lifespan="on",
            timeout_keep_alive=75,
        )
    )
    server.run(sockets=listeners)
    return 0
