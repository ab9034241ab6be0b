"""`GET /version` (vLLM's shape), answered alike by the engine and the gateway."""

from __future__ import annotations

from importlib import metadata


def servefleet_version() -> str:
    try:
        return metadata.version("servefleet")
    except metadata.PackageNotFoundError:  # run from a source tree without an install
        return "0+unknown"


def version_body() -> dict[str, str]:
    return {"version": servefleet_version()}
