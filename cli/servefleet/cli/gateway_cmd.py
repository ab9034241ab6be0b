"""`servefleet gateway --config FILE`: run the tenant-facing gateway."""

from __future__ import annotations

import argparse
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


def load_config(path: str) -> object:
    from servefleet.api.gateway_config import GatewayConfig

    text = Path(path).read_text()
    data = yaml.safe_load(text) or {}
    return GatewayConfig.model_validate(data)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from servefleet.api.gateway_config import GatewayConfig
    from servefleet.gateway.app import Gateway

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
    try:
        gateway = Gateway(config)
    except ValueError as exc:  # a key file or env var that is missing
        print(f"servefleet gateway: {exc}", file=sys.stderr)
        return 2
    uvicorn.run(
        gateway,
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
