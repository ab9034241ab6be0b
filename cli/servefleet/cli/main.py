"""The `servefleet` command: one entry point for every role the image plays.

Subcommands are imported lazily so that `servefleet gateway` never pays for
importing torch, and so `servefleet engine` can probe the CPU before torch loads.
Expected failures (a busy port, a missing kubeconfig, an unknown model) end as one
`servefleet COMMAND: error: …` line and exit status 2; only bugs print a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from types import ModuleType

from servefleet.cli.help_format import DefaultsHelpFormatter, fill_missing_help
from servefleet.cli.listen import ListenError

# subcommand -> (module implementing add_arguments/run, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "engine": ("servefleet.cli.engine_cmd", "run the model server (OpenAI-compatible API)"),
    "bench": ("servefleet.cli.bench_cmd", "benchmark any OpenAI-compatible endpoint"),
    "gateway": ("servefleet.cli.gateway_cmd", "run the tenant-facing gateway"),
    "autoscaler": ("servefleet.cli.autoscaler_cmd", "run the queue-depth autoscaler"),
    "operator": ("servefleet.cli.operator_cmd", "run the Kubernetes operator"),
    "crd": ("servefleet.cli.crd_cmd", "generate or check the CRDs from the pydantic spec"),
    "up": ("servefleet.cli.up_cmd", "run LLMDeployments on this machine (local mode)"),
    "sim": ("servefleet.cli.sim_cmd", "replay an access log through every scaling policy"),
    "model": ("servefleet.cli.fetch_cmd", "fetch a model source into a download cache"),
    "usage": ("servefleet.cli.usage_cmd", "chargeback: per-tenant usage and cost for a period"),
}


def package_version() -> str:
    try:
        return version("servefleet")
    except PackageNotFoundError:  # a source tree that was never installed
        return "unknown"


def expected_errors() -> tuple[type[BaseException], ...]:
    """Failures caused by the user's input or machine, not by a bug: reported in one line.

    Imported only once one is raised (ListenError, the fast path, is imported above)."""
    from servefleet.api.manifests import ManifestError
    from servefleet.kube.errors import KubeError
    from servefleet.text.builtin import UnknownModelError

    return (ManifestError, KubeError, UnknownModelError)


def _available() -> dict[str, tuple[str, str]]:
    found = {}
    for name, (module, help_text) in SUBCOMMANDS.items():
        if importlib.util.find_spec(module) is not None:
            found[name] = (module, help_text)
    return found


def subcommand_parser(name: str) -> tuple[argparse.ArgumentParser, ModuleType]:
    """The parser of one subcommand (every option's help shows its default) and its module."""
    module_name, help_text = SUBCOMMANDS[name]
    module = importlib.import_module(module_name)
    sub = argparse.ArgumentParser(
        prog=f"servefleet {name}", description=help_text, formatter_class=DefaultsHelpFormatter
    )
    module.add_arguments(sub)
    fill_missing_help(sub)
    return sub, module


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    available = _available()
    parser = argparse.ArgumentParser(
        prog="servefleet", description=__doc__, formatter_class=DefaultsHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"servefleet {package_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in available.items():
        subparsers.add_parser(name, help=help_text, add_help=False)
    if not args_list or args_list[0] not in available:
        parser.parse_args(args_list)  # --version, --help, or the error for an unknown command
        parser.print_help()
        return 2
    name = args_list[0]
    sub, module = subcommand_parser(name)
    args = sub.parse_args(args_list[1:])
    try:
        return int(module.run(args) or 0)
    except ListenError as exc:
        print(f"servefleet {name}: error: {exc}", file=sys.stderr)
        return 2
    except expected_errors() as exc:
        print(f"servefleet {name}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"servefleet {name}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
