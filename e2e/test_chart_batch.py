"""The chart's Batch API store rendered by the real helm: off by default, a folder on a
PersistentVolumeClaim (or an emptyDir), or an S3-compatible bucket whose keys come from a
Secret and never reach the values or the ConfigMap; and the guards (one store; several
replicas only over a bucket)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from e2e.test_chart_render import RELEASE, Objects, find, pod_spec, render, render_error

BATCH_DIR = "/var/lib/servefleet/batches"
CLAIM = f"{RELEASE}-gateway-batches"


def gateway_config(objects: Objects) -> dict[str, Any]:
    config_map = find(objects, "ConfigMap", f"{RELEASE}-gateway")
    config: dict[str, Any] = yaml.safe_load(config_map["data"]["gateway.yaml"])
    return config


def batch_volume(objects: Objects) -> dict[str, Any] | None:
    pod = pod_spec(objects, "gateway")["template"]["spec"]
    found = [v for v in pod["volumes"] if v["name"] == "batches"]
    mounts = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "batches"]
    assert len(found) == len(mounts) <= 1
    if mounts:
        assert mounts[0]["mountPath"] == BATCH_DIR and not mounts[0].get("readOnly")
    return found[0] if found else None


def test_the_batch_api_is_off_by_default(helm: Path) -> None:
    objects = render(helm)
    assert "batch" not in gateway_config(objects)
    assert batch_volume(objects) is None
    assert not [o for o in objects if o["kind"] == "PersistentVolumeClaim"]


def test_the_folder_store_on_a_claim(helm: Path) -> None:
    persistence = {"enabled": True, "size": "20Gi", "storageClass": "fast"}
    batch = {"enabled": True, "maxFileBytes": 1000, "persistence": persistence}
    objects = render(helm, {"gateway": {"batch": batch}})
    assert gateway_config(objects)["batch"] == {"store_dir": BATCH_DIR, "max_file_bytes": 1000}
    assert batch_volume(objects) == {
        "name": "batches",
        "persistentVolumeClaim": {"claimName": CLAIM},
    }
    claim = find(objects, "PersistentVolumeClaim", CLAIM)
    assert claim["spec"] == {
        "accessModes": ["ReadWriteOnce"],
        "storageClassName": "fast",
        "resources": {"requests": {"storage": "20Gi"}},
    }
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    deployment = pod_spec(objects, "gateway")
    assert deployment["strategy"] == {"type": "Recreate"}  # the old pod lets go of the volume
    security = deployment["template"]["spec"]["securityContext"]
    assert security["fsGroup"] == security["runAsUser"] == 10001
    # Without a storage class the cluster's default is used; a pod's own fsGroup is kept.
    again = render(
        helm,
        {
            "gateway": {
                "batch": {"enabled": True, "persistence": {"enabled": True}},
                "podSecurityContext": {"runAsUser": 20000, "fsGroup": 30000},
            }
        },
    )
    assert "storageClassName" not in find(again, "PersistentVolumeClaim", CLAIM)["spec"]
    spec = pod_spec(again, "gateway")["template"]["spec"]
    assert spec["securityContext"]["fsGroup"] == 30000


def test_without_persistence_the_folder_is_an_empty_dir(helm: Path) -> None:
    objects = render(helm, {"gateway": {"batch": {"enabled": True}}})
    assert gateway_config(objects)["batch"]["store_dir"] == BATCH_DIR
    assert batch_volume(objects) == {"name": "batches", "emptyDir": {}}
    assert not [o for o in objects if o["kind"] == "PersistentVolumeClaim"]
    assert "strategy" not in pod_spec(objects, "gateway")


def test_the_bucket_store_takes_its_keys_from_a_secret(helm: Path) -> None:
    s3 = {
        "bucket": "tenant-batches",
        "endpoint": "http://minio.storage:9000",
        "region": "eu-west-1",
        "prefix": "prod/",
        "credentialsSecret": "batch-s3",
    }
    objects = render(helm, {"gateway": {"batch": {"enabled": True, "s3": s3}}})
    config = gateway_config(objects)["batch"]
    assert config["s3"] == {k: v for k, v in s3.items() if k != "credentialsSecret"}
    assert "store_dir" not in config and batch_volume(objects) is None
    env = pod_spec(objects, "gateway")["template"]["spec"]["containers"][0]["env"]
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in env}
    assert set(refs) == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"}
    assert all(r["name"] == "batch-s3" and r["key"] == name for name, r in refs.items())
    assert refs["AWS_SESSION_TOKEN"]["optional"] is True
    assert all("value" not in e for e in env)  # a reference, never a key in the manifest
    # No Secret named: the pod's own identity (IRSA), and no env at all.
    s3.pop("credentialsSecret")
    bare = render(helm, {"gateway": {"batch": {"enabled": True, "s3": s3}}})
    assert "env" not in pod_spec(bare, "gateway")["template"]["spec"]["containers"][0]


def test_the_batch_guards(helm: Path) -> None:
    both = {"enabled": True, "s3": {"bucket": "abc"}, "persistence": {"enabled": True}}
    assert "not both" in render_error(helm, {"gateway": {"batch": both}})
    two = {"gateway": {"replicas": 2, "batch": {"enabled": True}}, "redis": {"enabled": True}}
    assert "each replica would see only its own batches" in render_error(helm, two)
    # Over a bucket the replicas share the batches; Redis (required for replicas > 1)
    # leases each batch to one of them.
    shared = {"enabled": True, "s3": {"bucket": "tenant-batches"}}
    objects = render(
        helm, {"gateway": {"replicas": 2, "batch": shared}, "redis": {"enabled": True}}
    )
    assert gateway_config(objects)["batch"]["s3"]["bucket"] == "tenant-batches"
    assert pod_spec(objects, "gateway")["replicas"] == 2
    for wrong in (
        {"s3": {"bucket": "Bad_Bucket"}},
        {"s3": {"endpoint": "http://user:pass@minio:9000"}},
        {"s3": {"accessKey": "AKIA"}},
        {"persistence": {"accessMode": "ReadOnlyMany"}},
    ):
        error = render_error(helm, {"gateway": {"batch": {"enabled": True, **wrong}}})
        assert "schema" in error, error
