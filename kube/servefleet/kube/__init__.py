"""The one Kubernetes client every component uses (credentials, apply, watch, events).

`KubeAccess` and `KubeError` are cheap; the rest imports the generated client (seconds of
start-up), so it is loaded on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .access import KubeAccess
from .errors import KubeError

if TYPE_CHECKING:
    from .client import KubeClient, ObjectList, WatchEvent
    from .config import Credentials
    from .watch import LabelWatcher, ObjectKey

_LAZY = {
    "KubeClient": "client",
    "ObjectList": "client",
    "WatchEvent": "client",
    "Credentials": "config",
    "LabelWatcher": "watch",
    "ObjectKey": "watch",
}

__all__ = [
    "Credentials",
    "KubeAccess",
    "KubeClient",
    "KubeError",
    "LabelWatcher",
    "ObjectKey",
    "ObjectList",
    "WatchEvent",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
