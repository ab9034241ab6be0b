"""Route ConfigMaps as the operator writes them: owned by an LLMDeployment and signed."""

from __future__ import annotations

from typing import Any

import yaml

from servefleet.api.conventions import ANNOTATION_ROUTE_SIGNATURE, ROUTE_GATEWAY_KEY
from servefleet.api.route_signature import route_signature

ROUTE_KEY = b"route-signing-key-for-the-tests"


def signed_route(
    namespace: str,
    name: str,
    fragment: dict[str, Any],
    *,
    key: bytes = ROUTE_KEY,
    owner_uid: str = "uid-1",
) -> dict[str, Any]:
    """A route ConfigMap with `fragment` as its gateway.yaml, signed with `key`."""
    data = {ROUTE_GATEWAY_KEY: yaml.safe_dump(fragment)}
    owner = {
        "apiVersion": "servefleet.io/v1alpha1",
        "kind": "LLMDeployment",
        "name": name.removesuffix("-gateway-route"),
        "uid": owner_uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }
    signature = route_signature(key, namespace, name, owner_uid, data)
    return {
        "metadata": {
            "namespace": namespace,
            "name": name,
            "ownerReferences": [owner],
            "annotations": {ANNOTATION_ROUTE_SIGNATURE: signature},
        },
        "data": data,
    }
