"""What the platform admin lets a namespace team run on the nodes. Pure.

Whoever may create an LLMDeployment picks the engine image and may ask for a node folder
as its download cache; both would reach the node if taken as they are. The admin's lists
(operator flags, chart values) bound them: engine images from an allow-list, node folders
only under allowed prefixes (none by default). A deployment outside them is refused: no
child is applied, and the `Degraded` condition and a Warning Event name the value and the
setting (see `reconciler`). Path syntax (`..`, absolute paths) is refused earlier, at
admission, by the CRD and the pydantic models.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable
from dataclasses import dataclass

from servefleet.api.engines import ENGINE_ADAPTERS, engine_adapter
from servefleet.api.llmdeployment import LLMDeployment

DEFAULT_REGISTRY = "docker.io"
IMAGE_SETTING = "the operator's --allowed-image (chart value operator.allowedImages)"
HOST_PATH_SETTING = (
    "the operator's --allowed-host-path-prefix (chart value operator.allowedHostPathPrefixes)"
)


def default_allowed_images() -> tuple[str, ...]:
    """Without a list from the admin: the repositories of vLLM's and SGLang's default images
    (the operator's own engine image is always allowed)."""
    return tuple(
        sorted(
            {image_repository(a.default_image) for a in ENGINE_ADAPTERS.values() if a.default_image}
        )
    )


@dataclass(frozen=True)
class ClusterPolicy:
    """The admin's lists. `allowed_images` entries: a repository (any tag or digest of it),
    an exact reference (`repo:tag`, `repo@sha256:...`), or `prefix/*` (every repository
    under that path). `host_path_prefixes`: node folders a cache may be in or under."""

    own_image: str
    allowed_images: tuple[str, ...] = ()
    host_path_prefixes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Refusal:
    """Why a deployment is not run: the condition's and Event's reason, and the sentence."""

    reason: str
    message: str


def _canonical_name(name: str) -> str:
    """A repository name as the runtime reads it: Docker Hub's defaults spelled out."""
    parts = name.split("/")
    if len(parts) == 1:
        parts = [DEFAULT_REGISTRY, "library", *parts]
    elif not ("." in parts[0] or ":" in parts[0] or parts[0] == "localhost"):
        parts = [DEFAULT_REGISTRY, *parts]
    return "/".join(parts)


def _split(image: str) -> tuple[str, str]:
    """(canonical repository, ':tag' / '@digest' / ':tag@digest' or '')."""
    name, at, digest = image.partition("@")
    slash, colon = name.rfind("/"), name.rfind(":")
    tag = ""
    if colon > slash:
        name, tag = name[:colon], name[colon:]
    return _canonical_name(name), tag + (at + digest if at else "")


def image_repository(image: str) -> str:
    return _split(image)[0]


def image_allowed(image: str, allowed: Iterable[str]) -> bool:
    """Whether `image` matches an allow-list entry (see ClusterPolicy)."""
    repository, reference = _split(image)
    for entry in allowed:
        if entry.endswith("/*"):
            prefix = _canonical_name(entry[:-2] + "/x")[:-1]
            if repository.startswith(prefix):
                return True
            continue
        entry_repository, entry_reference = _split(entry)
        if entry_repository == repository and entry_reference in ("", reference):
            return True
    return False


def host_path_mount(path: str, prefixes: Iterable[str]) -> tuple[str, str] | None:
    """(allowed prefix, sub path under it) for a node folder, or None when it is under no
    prefix. The pod mounts the prefix and the sub path as a volume `subPath`: the kubelet
    resolves a sub path without following symbolic links out of the volume, so a link a
    pod left in the shared folder cannot point another pod's cache at the node's files."""
    clean = posixpath.normpath(path)
    for prefix in prefixes:
        root = posixpath.normpath(prefix)
        if clean == root:
            return root, ""
        if clean.startswith(root.rstrip("/") + "/"):
            return root, clean[len(root.rstrip("/")) + 1 :]
    return None


def engine_image(dep: LLMDeployment, own_image: str) -> str:
    """The image the engine container runs: the spec's, the adapter's default, or ours."""
    adapter = engine_adapter(dep.spec.engine.kind)
    return dep.spec.engine.image or adapter.default_image or own_image


def refusal(dep: LLMDeployment, policy: ClusterPolicy) -> Refusal | None:
    """Why this deployment may not run under the admin's lists, or None."""
    image = engine_image(dep, policy.own_image)
    if image != policy.own_image and not image_allowed(image, policy.allowed_images):
        allowed = ", ".join(policy.allowed_images) or "none"
        return Refusal(
            "ImageNotAllowed",
            f"engine image {image} is not allowed by {IMAGE_SETTING}: {allowed} "
            f"(and the operator's own {policy.own_image})",
        )
    cache = dep.spec.model.cache
    if cache is not None and cache.host_path is not None:
        path = cache.host_path.path
        if host_path_mount(path, policy.host_path_prefixes) is None:
            allowed = ", ".join(policy.host_path_prefixes) or "none"
            return Refusal(
                "HostPathNotAllowed",
                f"model.cache.hostPath.path {path} is not under a node folder allowed by "
                f"{HOST_PATH_SETTING}: {allowed}",
            )
    return None
