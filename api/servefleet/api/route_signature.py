"""The operator's signature on a route ConfigMap, which the gateway checks before serving it.

Anyone who may write ConfigMaps in a namespace could label one as a route; only the operator
holds the signing key (a Secret the chart generates and mounts into the operator and the
gateway), so only routes it rendered are served. The HMAC-SHA256 covers the route's
namespace, name, owning LLMDeployment's uid and every data key, so a signed route cannot be
copied to another namespace or name, re-parented, or edited.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping
from pathlib import Path

SIGNATURE_VERSION = "v1"
MIN_KEY_BYTES = 16


def route_signature(
    key: bytes, namespace: str, name: str, owner_uid: str, data: Mapping[str, str]
) -> str:
    """`v1:<hex HMAC-SHA256>` of the route as it is stored (data keys sorted)."""
    message = json.dumps(
        {"namespace": namespace, "name": name, "owner": owner_uid, "data": dict(data)},
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=True,
    ).encode()
    return f"{SIGNATURE_VERSION}:{hmac.new(key, message, hashlib.sha256).hexdigest()}"


def signature_matches(
    key: bytes,
    signature: str,
    namespace: str,
    name: str,
    owner_uid: str,
    data: Mapping[str, str],
) -> bool:
    """Whether `signature` is the operator's for this route (compared in constant time)."""
    expected = route_signature(key, namespace, name, owner_uid, data)
    return hmac.compare_digest(expected.encode(), signature.encode("utf-8", "replace"))


def read_signing_key(path: str | Path) -> bytes:
    """The key from its mounted file; ValueError with one clear line when it is unusable."""
    try:
        key = Path(path).read_bytes().strip()
    except OSError as exc:
        raise ValueError(f"cannot read the route signing key {path}: {exc.strerror}") from None
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"the route signing key in {path} is shorter than {MIN_KEY_BYTES} bytes")
    return key
