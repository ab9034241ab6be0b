"""`servefleet engine`: the model server.

The port is bound first, before pydantic, torch or the model are imported, so a busy port
fails in a fraction of a second; the CPU probe runs before torch is imported too (see
servefleet.engine.cpu_isa), so everything else is imported inside `run`.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import TYPE_CHECKING, Any

from servefleet.api.engine_flags import (
    API_KEY_ENV,
    ENGINE_FLAG_BY_NAME,
    ENGINE_FLAGS,
    GROUP_TITLES,
    EngineFlag,
)
from servefleet.api.rank_place import RANK_ENV
from servefleet.cli.listen import bind_listener
from servefleet.cli.logs import add_logging_arguments, setup_logging

if TYPE_CHECKING:
    import socket

    from pydantic import ValidationError

    from servefleet.engine.config import EngineConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per row of the knob table (`servefleet.api.engine_flags`), by group."""
    groups = {group: parser.add_argument_group(title) for group, title in GROUP_TITLES.items()}
    for knob in ENGINE_FLAGS:
        groups[knob.group].add_argument(knob.flag, **_argparse_options(knob))
    add_logging_arguments(parser)


def _argparse_options(knob: EngineFlag) -> dict[str, Any]:
    """How argparse reads one knob: a bool is a switch that flips its default;
    bounds are left to EngineConfig, whose error names the flag (`_settings_error`)."""
    options: dict[str, Any] = {"dest": knob.name, "help": knob.help, "default": knob.default}
    if knob.kind is bool:
        return options | {"action": "store_false" if knob.default else "store_true"}
    options |= {"type": knob.kind, "required": knob.required, "metavar": knob.metavar}
    if knob.choices:
        options["choices"] = knob.choices
    if knob.required:
        del options["default"]
    return options


def _settings_error(exc: ValidationError) -> str:
    """Pydantic's errors as one line, in flag spelling: `--block-size: Input should be …`."""
    parts = []
    for err in exc.errors():
        knob = ENGINE_FLAG_BY_NAME.get(str(err["loc"][0])) if err["loc"] else None
        parts.append(f"{knob.flag if knob else 'settings'}: {err['msg']}")
    return "; ".join(parts)


def engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig fields from the flags (one per knob); the API key from the env when
    no flag has it (a Secret-backed env var keeps the key out of `ps` and the pod spec)."""
    settings = {knob.name: getattr(args, knob.name) for knob in ENGINE_FLAGS}
    return settings | {"api_key": args.api_key or os.environ.get(API_KEY_ENV) or None}


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level, args.log_format)
    log = logging.getLogger("servefleet.engine")
    if _worker_rank():
        return run_worker_rank(args, log)
    # First thing: a busy port ends here as one line (servefleet.cli.main reports ListenError).
    listener = bind_listener(args.host, args.port)
    from pydantic import ValidationError

    from servefleet.engine.config import EngineConfig

    try:
        config = EngineConfig(**engine_settings(args))
    except ValidationError as exc:
        listener.close()
        log.error("invalid engine settings: %s", _settings_error(exc))
        return 2
    return run_engine(config, listener)


def _worker_rank() -> bool:
    """A non-zero RANK (torch's environment): this process only runs a model shard."""
    return os.environ.get(RANK_ENV, "0").strip() not in ("", "0")


def run_worker_rank(args: argparse.Namespace, log: logging.Logger) -> int:
    """A tensor-parallel worker rank: no port, no HTTP; rank 0's steps until it stops."""
    from pydantic import ValidationError

    from servefleet.engine.config import EngineConfig

    try:
        config = EngineConfig(**engine_settings(args))
    except ValidationError as exc:
        log.error("invalid engine settings: %s", _settings_error(exc))
        return 2
    from servefleet.engine.cpu_isa import ensure_safe_cpu_isa

    log.info("cpu_isa=%r", ensure_safe_cpu_isa())
    from servefleet.engine.parallel.worker import run_worker

    return run_worker(config)


def run_engine(config: EngineConfig, listener: socket.socket) -> int:
    """Serve "loading" on the bound port at once, then probe the CPU, import torch and load
    the model behind it; a signal before the engine is built ends the process with 0."""
    from servefleet.engine.http_server import start_http_server

    http_server = start_http_server(config, listener)
    from servefleet.engine.cpu_isa import ensure_safe_cpu_isa

    logging.getLogger("servefleet.engine").info("cpu_isa=%r", ensure_safe_cpu_isa())
    from servefleet.engine.process import serve

    return serve(config, http_server)
