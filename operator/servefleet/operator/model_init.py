"""Where the engine finds its weights: volumes, mounts and the fetch init container.

Per source: `builtin` needs nothing; `pvc` and `oci` are mounted read-only (an OCI image
as a Kubernetes `image` volume: the node's image store is then the cache); `url`,
`huggingface` and `s3` are downloaded by `servefleet model fetch` in an init container
into the cache volume (`model.cache`: a shared PVC or a node folder; else an emptyDir),
which the engine mounts read-only. The init container's log lines are what the operator
turns into the `ModelLoading` condition (see `model_loading`).

A node folder is mounted as the admin's allowed prefix it is under (`policy.host_path_mount`),
with the rest as the mounts' `subPath`, never as itself: the kubelet resolves a sub path
without following symbolic links out of the volume.
"""

from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass, field
from typing import Any

from servefleet.api.conventions import MODEL_MOUNT, MODEL_VOLUME, SCRATCH_MOUNT, SCRATCH_VOLUME
from servefleet.api.fetch_progress import FETCH_CONTAINER
from servefleet.api.llmdeployment import ModelSpec
from servefleet.api.model_source import ModelCache, ModelSource
from servefleet.operator.policy import host_path_mount

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


def model_location(
    model: ModelSpec,
    fetch_image: str,
    pull_policy: str,
    host_path_prefixes: tuple[str, ...] = (),
) -> ModelLocation:
    """The engine's model path and the pod parts that put the weights there (a node folder
    cache must be under one of `host_path_prefixes`: `policy.refusal` checked it)."""
    source = model.source
    read_only: dict[str, Any] = {"name": MODEL_VOLUME, "mountPath": MODEL_MOUNT, "readOnly": True}
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
    volume, sub_path = cache_volume(model.cache, host_path_prefixes)
    if sub_path:
        read_only["subPath"] = sub_path
    return ModelLocation(
        model_arg=posixpath.join(MODEL_MOUNT, source.fetched_path()),
        volumes=[volume],
        mounts=[read_only],
        init_containers=[fetch_container(source, fetch_image, pull_policy, sub_path)],
        # A PVC's root is usually root-owned: make it group-writable for the fetcher.
        pod_security=(
            {"fsGroup": FETCH_USER_GROUP, "fsGroupChangePolicy": "OnRootMismatch"}
            if model.cache is not None and model.cache.pvc is not None
            else {}
        ),
    )


def _under_mount(path: str) -> str:
    return posixpath.join(MODEL_MOUNT, path) if path else MODEL_MOUNT


def cache_volume(
    cache: ModelCache | None, host_path_prefixes: tuple[str, ...] = ()
) -> tuple[dict[str, Any], str]:
    """The download cache and the sub path to mount: the named PVC, an allowed node folder
    (which the admin made, writable by the engine user: type Directory, never created by
    the kubelet as root), or (no cache) the pod's own emptyDir."""
    if cache is None:
        return {"name": MODEL_VOLUME, "emptyDir": {}}, ""
    if cache.pvc is not None:
        claim = {"claimName": cache.pvc.claim_name}
        return {"name": MODEL_VOLUME, "persistentVolumeClaim": claim}, ""
    assert cache.host_path is not None  # ModelCache holds exactly one
    found = host_path_mount(cache.host_path.path, host_path_prefixes)
    if found is None:
        raise ValueError(f"model.cache.hostPath.path {cache.host_path.path} is not allowed")
    prefix, sub_path = found
    return {"name": MODEL_VOLUME, "hostPath": {"path": prefix, "type": "Directory"}}, sub_path


def fetch_container(
    source: ModelSource, image: str, pull_policy: str, sub_path: str = ""
) -> dict[str, Any]:
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
        "volumeMounts": [
            {
                "name": MODEL_VOLUME,
                "mountPath": MODEL_MOUNT,
                **({"subPath": sub_path} if sub_path else {}),
            },
            {"name": SCRATCH_VOLUME, "mountPath": SCRATCH_MOUNT},
        ],
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if env_from:
        container["envFrom"] = env_from
    return container
