"""Local mode's PersistentVolumeClaims: folders of this machine, named on the command line.

A `pvc` source (a deployment's model, an LLMAdapter's folder) names a claim and a path
*relative* to the claim's root, without `..` segments (the schema refuses anything else, so a
path cannot climb out of its volume on Kubernetes). `servefleet up --volume CLAIM=DIR` says
which folder stands for a claim here, so the very same YAML runs in both places: on
Kubernetes the claim is mounted, here it is `DIR`, and `pvc.path` is read inside either.
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping

from servefleet.api.model_source import PvcModelSource

VOLUME_FLAG = "--volume"


class UnmappedClaim(ValueError):
    """A pvc source whose claim no `--volume CLAIM=DIR` maps to a folder."""


def local_pvc_folder(pvc: PvcModelSource, volumes: Mapping[str, str], field: str) -> str:
    """The folder of this machine that `pvc` (reached as `field`, for the message) names:
    its claim's mapped folder (absolute), joined with `pvc.path`."""
    root = volumes.get(pvc.claim_name)
    if root is None:
        mapped = ", ".join(sorted(volumes)) or "none"
        raise UnmappedClaim(
            f"{field}: claim {pvc.claim_name} is not a folder of this machine: pass "
            f"`servefleet up {VOLUME_FLAG} {pvc.claim_name}=DIR` (claims mapped: {mapped})"
        )
    if not posixpath.isabs(root):
        raise ValueError(f"{VOLUME_FLAG} {pvc.claim_name}={root}: the folder must be absolute")
    return posixpath.normpath(posixpath.join(root, pvc.path)) if pvc.path else root
