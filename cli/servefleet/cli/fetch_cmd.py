"""`servefleet model fetch`: download a model source into the cache (the engine pod's
init container runs it; it works the same by hand)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    fetch = sub.add_parser("fetch", help="download a model.source into a cache folder")
    fetch.add_argument(
        "--source",
        required=True,
        help='the model.source as JSON, e.g. \'{"huggingface": {"repo": "org/name"}}\'',
    )
    fetch.add_argument("--cache", required=True, type=Path, help="cache root folder")
    fetch.add_argument(
        "--progress-seconds", type=float, default=5.0, help="seconds between progress lines"
    )
    fetch.add_argument(
        "--retry-seconds",
        type=float,
        default=300.0,
        help="wait after a permanent failure (not found, access denied) before trying again",
    )
    fetch.add_argument(
        "--attempts", type=int, default=0, help="tries before giving up (0 = keep trying)"
    )


def run(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from servefleet.api.model_source import ModelSource
    from servefleet.engine.fetch import FetchError, fetch_until_done
    from servefleet.engine.fetch.fetcher import RetryPolicy

    try:
        source = ModelSource.model_validate(json.loads(args.source))
    except (ValueError, ValidationError) as exc:
        print(f"servefleet model fetch: bad --source: {exc}", file=sys.stderr)
        return 2
    policy = RetryPolicy(permanent=args.retry_seconds, attempts=args.attempts)
    try:
        fetch_until_done(source, args.cache, policy, progress_interval=args.progress_seconds)
    except FetchError:
        return 1
    return 0
