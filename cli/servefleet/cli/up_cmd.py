"""`servefleet up FILE`: run LLMDeployments (and the LLMAdapters on them) on this machine.

The banner with the `export`/curl lines is printed only once every deployment's warm
replicas are ready, so the first request a newcomer copies from it is served, not refused
with 503 while the engines are still loading.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from pathlib import Path
from typing import TYPE_CHECKING

from servefleet.cli.listen import bind_listener
from servefleet.cli.logs import add_logging_arguments, setup_logging

if TYPE_CHECKING:
    from servefleet.local.plane import LocalControlPlane


def volume(text: str) -> tuple[str, str]:
    """`CLAIM=DIR` → (claim, absolute folder); the folder must exist."""
    claim, sep, folder = text.partition("=")
    if not sep or not claim or not folder:
        raise argparse.ArgumentTypeError(f"{text!r}: expected CLAIM=DIR")
    path = Path(folder).expanduser().resolve()
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: {path} is not a folder")
    return claim, str(path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a(
        "file",
        type=Path,
        help="YAML with one or more LLMDeployments (and optional Secrets and LLMAdapters)",
    )
    a(
        "--host",
        default="127.0.0.1",
        help="address of the gateway (the engines always listen on 127.0.0.1, behind it)",
    )
    a("--port", type=int, default=8080, help="gateway port")
    a(
        "--secrets",
        type=Path,
        default=None,
        help="YAML with Secret documents for tenant keys (default: env, then FILE)",
    )
    a(
        "--volume",
        type=volume,
        action="append",
        default=[],
        metavar="CLAIM=DIR",
        help="serve PersistentVolumeClaim CLAIM from folder DIR: a pvc source (model or "
        "LLMAdapter) reads its path inside it (repeatable; default: no claim is served)",
    )
    a(
        "--log-dir",
        type=Path,
        default=Path.home() / ".cache" / "servefleet" / "local" / "logs",
        help="engine replica logs",
    )
    a(
        "--batch-dir",
        type=Path,
        default=Path.home() / ".cache" / "servefleet" / "local" / "batches",
        help="the Batch API's files, batches and journals (kept across runs: a batch left "
        "unfinished resumes at the next start)",
    )
    add_logging_arguments(parser)


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level, args.log_format)
    log = logging.getLogger("servefleet.up")
    from servefleet.api.manifests import ManifestError, load_llmadapters, load_llmdeployments
    from servefleet.local.adapters import check_local_adapters
    from servefleet.local.engine_command import ENGINE_HOST, LocalModeError, engine_command
    from servefleet.local.plane import LocalControlPlane, LocalOptions
    from servefleet.local.tenants import MissingSecretError, resolve_local_tenants

    volumes = dict(args.volume)
    try:
        deployments = load_llmdeployments(args.file)
        adapters = load_llmadapters(args.file)
        tenants = resolve_local_tenants(deployments, args.file, args.secrets)
        for dep in tenants.deployments:
            # Reject what local mode cannot run, now.
            engine_command(dep.spec, ENGINE_HOST, 0, volumes=volumes)
        check_local_adapters(adapters, tenants.deployments, volumes)
        options = LocalOptions(
            log_dir=args.log_dir,
            host=args.host,
            port=args.port,
            volumes=volumes,
            batch_dir=args.batch_dir,
        )
        plane = LocalControlPlane(tenants.deployments, tenants, options, adapters)
        plane.gateway_config()  # what the gateway would refuse (e.g. one name, two models)
    except (ManifestError, MissingSecretError, LocalModeError) as exc:
        log.error("%s", exc)
        return 2
    except ValueError as exc:  # the gateway config's own checks, one line
        log.error("%s", _one_line(exc))
        return 2
    # A busy gateway port ends here, as one line (servefleet.cli.main reports ListenError).
    options.listener = bind_listener(args.host, args.port)
    return asyncio.run(serve_until_signal(plane))


def _one_line(exc: ValueError) -> str:
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        return "; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())
    return str(exc)


def _starting_line(plane: LocalControlPlane) -> str:
    warm = ", ".join(f"{d.name} x{d.spec.desired_replicas()}" for d in plane.deployments)
    return (
        f"starting: loading warm replicas ({warm}); the endpoint is printed once they are "
        f"ready (engine logs: {plane.options.log_dir})"
    )


async def serve_until_signal(plane: LocalControlPlane) -> int:
    """Start the plane, wait for the warm pool, print how to use it, and stop everything on
    SIGINT or SIGTERM (also while the pool is still warming)."""
    from servefleet.local.plane import banner

    log = logging.getLogger("servefleet.up")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await plane.start()
    except (OSError, RuntimeError, SystemExit) as exc:
        log.error("could not start: %s", exc)
        await plane.stop()
        return 1
    print(_starting_line(plane), flush=True)
    warm = asyncio.create_task(plane.wait_warm())
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait({warm, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if warm.done() and not warm.exception():
        print(banner(plane), flush=True)
        print("ready: warm replicas are serving", flush=True)
    await stopped
    warm.cancel()
    print("stopping: draining engines and the gateway", flush=True)
    await plane.stop()
    print("stopped", flush=True)
    return 0
