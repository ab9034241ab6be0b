"""`servefleet crd generate|check`: the CRD YAML from the pydantic spec, and a drift check."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    generate = sub.add_parser("generate", help="write the CRD YAML (stdout without -o)")
    generate.add_argument(
        "-o", "--output", action="append", default=[], help="file to write (repeatable)"
    )
    check = sub.add_parser("check", help="fail when a CRD file differs from the generated one")
    check.add_argument("files", nargs="+", help="CRD files to compare")


def run(args: argparse.Namespace) -> int:
    from servefleet.api.crd import crd_yaml

    text = crd_yaml()
    if args.action == "generate":
        if not args.output:
            sys.stdout.write(text)
        for out in args.output:
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            Path(out).write_text(text)
        return 0
    stale = [f for f in args.files if not Path(f).exists() or Path(f).read_text() != text]
    for f in stale:
        print(
            f"{f}: differs from the pydantic spec; run `servefleet crd generate -o {f}`",
            file=sys.stderr,
        )
    return 1 if stale else 0
