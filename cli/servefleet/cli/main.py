"""The `servefleet` command: one entry point for every role the image plays.

Subcommands are imported lazily so that `servefleet gateway` never pays for
importing torch, and so `servefleet engine` can probe the CPU before torch loads.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Sequence

# subcommand -> (module implementing add_arguments/run, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "engine": ("servefleet.cli.engine_cmd", "run the model server (OpenAI-compatible API)"),
    "bench": ("servefleet.cli.bench_cmd", "benchmark any OpenAI-compatible endpoint"),
    "gateway": ("servefleet.cli.gateway_cmd", "run the tenant-facing gateway"),
    "autoscaler": ("servefleet.cli.autoscaler_cmd", "run the queue-depth autoscaler"),
    "operator": ("servefleet.cli.operator_cmd", "run the Kubernetes operator"),
    "crd": ("servefleet.cli.crd_cmd", "generate or check the CRD from the pydantic spec"),
    "up": ("servefleet.cli.up_cmd", "run LLMDeployments on this machine (local mode)"),
    "sim": ("servefleet.cli.sim_cmd", "replay an access log through every scaling policy"),
}


def _available() -> dict[str, tuple[str, str]]:
    found = {}
    for name, (module, help_text) in SUBCOMMANDS.items():
        if importlib.util.find_spec(module) is not None:
            found[name] = (module, help_text)
    return found


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    available = _available()
    parser = argparse.ArgumentParser(prog="servefleet", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in available.items():
        subparsers.add_parser(name, help=help_text, add_help=False)
    if not args_list or args_list[0] not in available:
        parser.parse_args(args_list)  # prints usage / the error for an unknown command
        parser.print_help()
        return 2
    name = args_list[0]
    module = importlib.import_module(available[name][0])
    sub = argparse.ArgumentParser(prog=f"servefleet {name}", description=available[name][1])
    module.add_arguments(sub)
    args = sub.parse_args(args_list[1:])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
