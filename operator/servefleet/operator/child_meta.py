"""Metadata every child object of an LLMDeployment carries: the common labels and the
owner reference that makes Kubernetes delete it with its LLMDeployment. Pure."""

from __future__ import annotations

from typing import Any

from servefleet.api.conventions import (
    ENGINE_APP_NAME,
    FIELD_MANAGER_OPERATOR,
    LABEL_APP_INSTANCE,
    LABEL_APP_MANAGED_BY,
    LABEL_APP_NAME,
    LABEL_APP_PART_OF,
    LABEL_DEPLOYMENT,
    PART_OF,
)
from servefleet.api.llmdeployment import FULL_API_VERSION, KIND, LLMDeployment


def common_labels(dep: LLMDeployment) -> dict[str, str]:
    return {
        LABEL_APP_NAME: ENGINE_APP_NAME,
        LABEL_APP_INSTANCE: dep.name,
        LABEL_APP_PART_OF: PART_OF,
        LABEL_APP_MANAGED_BY: FIELD_MANAGER_OPERATOR,
        LABEL_DEPLOYMENT: dep.name,
    }


def owner_reference(dep: LLMDeployment) -> dict[str, Any]:
    if not dep.metadata.uid:
        raise ValueError(
            f"{KIND} {dep.namespace}/{dep.name} has no uid; read it from the API server"
        )
    return {
        "apiVersion": FULL_API_VERSION,
        "kind": KIND,
        "name": dep.name,
        "uid": dep.metadata.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def child_meta(
    dep: LLMDeployment, name: str, extra_labels: dict[str, str] | None = None
) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": dep.namespace,
        "labels": {**common_labels(dep), **(extra_labels or {})},
        "ownerReferences": [owner_reference(dep)],
    }
