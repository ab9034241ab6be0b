"""`servefleet crd generate|check`: the CRD YAML from the pydantic spec, and a drift check.

Every CRD we ship (`servefleet.api.crd.CRDS`) is one file named after it
(`llmdeployments.servefleet.io.yaml`, `llmadapters.servefleet.io.yaml`), so both commands
take folders: the repository's `crds/` and the chart's `crds/`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    generate = sub.add_parser(
        "generate", help="write every CRD (stdout without -o, as one multi-document YAML)"
    )
    generate.add_argument(
        "-o",
        "--output",
        action="append",
        default=[],
        metavar="DIR",
        help="folder to write one <plural>.<group>.yaml per CRD into (repeatable; default: stdout)",
    )
    check = sub.add_parser("check", help="fail when a CRD file in a folder is missing or differs")
    check.add_argument("folders", nargs="+", help="folders holding the CRD files")


def _generated() -> dict[str, str]:
    """File name → YAML, for every CRD."""
    from servefleet.api.crd import CRDS, crd_yaml

    return {resource.file_name: crd_yaml(resource) for resource in CRDS}


def run(args: argparse.Namespace) -> int:
    files = _generated()
    if args.action == "generate":
        if not args.output:
            sys.stdout.write("---\n".join(files.values()))
        for out in args.output:
            Path(out).mkdir(parents=True, exist_ok=True)
            for name, text in files.items():
                (Path(out) / name).write_text(text)
        return 0
    stale = [
        Path(folder) / name
        for folder in args.folders
        for name, text in files.items()
        if not (Path(folder) / name).exists() or (Path(folder) / name).read_text() != text
    ]
    for path in stale:
        print(
            f"{path}: missing or differs from the pydantic spec; run "
            f"`servefleet crd generate -o {path.parent}`",
            file=sys.stderr,
        )
    return 1 if stale else 0
