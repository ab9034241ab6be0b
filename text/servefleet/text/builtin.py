"""Models that ship inside Python wheels, addressable by a short name."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from servefleet.api.builtin_models import BUILTIN_MODELS, BuiltinModel

__all__ = ["BUILTIN_MODELS", "BuiltinModel", "UnknownModelError", "is_builtin", "resolve_builtin"]


class UnknownModelError(ValueError):
    """The source names no file, folder or built-in model."""


def is_builtin(name: str) -> bool:
    return name in BUILTIN_MODELS


def resolve_builtin(name: str) -> Path:
    """The model file of a built-in; located via package metadata, never imported."""
    entry = BUILTIN_MODELS.get(name)
    if entry is None:
        raise UnknownModelError(
            f"unknown model {name!r}: not a file or folder, and not a built-in "
            f"(built-ins: {', '.join(sorted(BUILTIN_MODELS))})"
        )
    try:
        dist = importlib.metadata.distribution(entry.distribution)
    except importlib.metadata.PackageNotFoundError as exc:
        raise UnknownModelError(
            f"built-in model {name!r} needs the {entry.distribution!r} package installed"
        ) from exc
    path = Path(str(dist.locate_file(entry.file)))
    if not path.is_file():
        raise UnknownModelError(f"built-in model {name!r}: {path} is missing from its package")
    return path
