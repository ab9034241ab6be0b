"""A PersistentVolumeClaim bound to a folder of the e2e node, without a provisioner.

The node runs no volume binder (kube-controller-manager's persistentvolume-binder is off:
nothing else needs it), so `bind_host_folder` binds as the binder would, on the API alone: a
hostPath PersistentVolume pre-bound to the claim (its `claimRef` names the claim's uid, which
the kubelet checks), the claim's `volumeName` and its `pv.kubernetes.io/bind-completed`
annotation (what the scheduler's volume binding reads as "bound"), and both objects' status
phase `Bound` (what the kubelet requires before it mounts the volume). Pods then mount the
folder as they would any claim.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from k8s.kubectl import Kube

ACCESS_MODES = ["ReadOnlyMany"]


def volume_name(namespace: str, claim: str) -> str:
    return f"e2e-{namespace}-{claim}"


def bind_host_folder(kube: Kube, namespace: str, claim: str, folder: Path, size: str) -> str:
    """Claim `claim` in `namespace`, bound to `folder` on the node; returns the volume's name."""
    volume = volume_name(namespace, claim)
    resources = {"requests": {"storage": size}}
    kube.apply_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "metadata": {"name": claim},
                "spec": {
                    "accessModes": ACCESS_MODES,
                    "storageClassName": "",
                    "volumeName": volume,
                    "resources": resources,
                },
            }
        ),
        namespace,
    )
    found = kube.get("pvc", claim, namespace)
    assert found is not None
    claim_ref = {"namespace": namespace, "name": claim, "uid": found["metadata"]["uid"]}
    kube.apply_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "PersistentVolume",
                "metadata": {"name": volume},
                "spec": {
                    "accessModes": ACCESS_MODES,
                    "capacity": {"storage": size},
                    "storageClassName": "",
                    "persistentVolumeReclaimPolicy": "Retain",
                    "claimRef": claim_ref,
                    "hostPath": {"path": str(folder), "type": "Directory"},
                },
            }
        )
    )
    kube.kubectl("annotate", "pvc", claim, "-n", namespace, "pv.kubernetes.io/bind-completed=yes")
    _status(kube, ["pv", volume], {"phase": "Bound"})
    bound: dict[str, object] = {
        "phase": "Bound",
        "accessModes": ACCESS_MODES,
        "capacity": {"storage": size},
    }
    _status(kube, ["pvc", claim, "-n", namespace], bound)
    return volume


def _status(kube: Kube, target: list[str], status: dict[str, object]) -> None:
    patch = json.dumps({"status": status})
    kube.kubectl("patch", *target, "--subresource=status", "--type=merge", "-p", patch)
