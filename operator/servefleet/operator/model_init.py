"""Where the engine finds its weights: volumes, mounts and the fetch init container.

Per source: `builtin` needs nothing; `pvc` and `oci` are mounted read-only (an OCI image
as a Kubernetes `image` volume: the node's image store is then the cache); `url`,
`huggingface` and `s3` are downloaded by `servefleet model fetch` in an init container
into the cache volume (`model.cache`: a shared PVC or a node folder; else an emptyDir),
which the engine mounts read-only. The init container's log lines are what the operator
turns into the `ModelLoading` condition (see `model_loading`).
"""

from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass, field
from typing import Any

from servefleet.api.conventions import MODEL_MOUNT, MODEL_VOLUME
from servefleet.api.fetch_progress import FETCH_CONTAINER
from servefleet.api.llmdeployment import ModelSpec
from servefleet.api.model_source import ModelCache, ModelSource

FETCH_COMMAND = ["servefleet", "model", "fetch"]
HF_TOKEN_ENV = "HF_TOKEN"
FETCH_USER_GROUP = 10001
"""The engine image's user: a cache PVC is made group-writable for it (fsGroup)."""


@dataclass(frozen=True)
class ModelLocation:
    """What the engine pod needs to find the model."""

    model_arg: str  # the engine's --model value
    volumes: list[dict[str, Any]] = field(default_factory=list)
    mounts: list[dict[str, Any]] = field(default_factory=list)  # the engine container's
    init_containers: list[dict[str, Any]] = field(default_factory=list)
    pod_security: dict[str, Any] = field(default_factory=dict)  # merged into the pod's


def model_location(model: ModelSpec, fetch_image: str, pull_policy: str) -> ModelLocation:
    """The engine's model path and the pod parts that put the weights there."""
    source = model.source
    read_only = {"name": MODEL_VOLUME, "mountPath": MODEL_MOUNT, "readOnly": True}
    if source.builtin is not None:
        return ModelLocation(model_arg=source.builtin)
    if source.pvc is not None:
        volume = {
            "name": MODEL_VOLUME,
            "persistentVolumeClaim": {"claimName": source.pvc.claim_name, "readOnly": True},
        }
        return ModelLocation(_under_mount(source.pvc.path), [volume], [read_only])
    if source.oci is not None:
        volume = {
            "name": MODEL_VOLUME,
            "image": {"reference": source.oci.reference, "pullPolicy": source.oci.pull_policy},
        }
        return ModelLocation(_under_mount(source.oci.path), [volume], [read_only])
    return ModelLocation(
        model_arg=posixpath.join(MODEL_MOUNT, source.fetched_path()),
        volumes=[cache_volume(model.cache)],
        mounts=[read_only],
        init_containers=[fetch_container(source, fetch_image, pull_policy)],
        # A PVC's root is usually root-owned: make it group-writable for the fetcher.
        pod_security=(
            {"fsGroup": FETCH_USER_GROUP, "fsGroupChangePolicy": "OnRootMismatch"}
            if model.cache is not None and model.cache.pvc is not None
            else {}
        ),
    )


def _under_mount(path: str) -> str:
    return posixpath.join(MODEL_MOUNT, path) if path else MODEL_MOUNT


def cache_volume(cache: ModelCache | None) -> dict[str, Any]:
    """The download cache: the named PVC, a node folder, or (no cache) the pod's own."""
    if cache is None:
        return {"name": MODEL_VOLUME, "emptyDir": {}}
    if cache.pvc is not None:
        return {"name": MODEL_VOLUME, "persistentVolumeClaim": {"claimName": cache.pvc.claim_name}}
    assert cache.host_path is not None  # ModelCache holds exactly one
    return {
        "name": MODEL_VOLUME,
        "hostPath": {"path": cache.host_path.path, "type": "DirectoryOrCreate"},
    }


def fetch_container(source: ModelSource, image: str, pull_policy: str) -> dict[str, Any]:
    """`servefleet model fetch` into the cache. Credentials come from the deployment's
    Secrets as environment variables, so the values never appear in the pod spec."""
    env: list[dict[str, Any]] = [{"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"}]
    env_from: list[dict[str, Any]] = []
    if source.huggingface is not None and source.huggingface.token_secret_ref is not None:
        ref = source.huggingface.token_secret_ref
        env.append(
            {
                "name": HF_TOKEN_ENV,
                "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}},
            }
        )
    if source.s3 is not None and source.s3.credentials_secret is not None:
        env_from.append({"secretRef": {"name": source.s3.credentials_secret}})
    container: dict[str, Any] = {
        "name": FETCH_CONTAINER,
        "image": image,
        "imagePullPolicy": pull_policy,
        "command": list(FETCH_COMMAND),
        "args": [
            "--source",
            json.dumps(source.to_wire(), sort_keys=True, separators=(",", ":")),
            "--cache",
            MODEL_MOUNT,
        ],
        "env": env,
        "volumeMounts": [{"name": MODEL_VOLUME, "mountPath": MODEL_MOUNT}],
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if env_from:
        container["envFrom"] = env_from
    return container
