"""The CRD is generated from the pydantic models, the one source; its two committed copies
are that output and nothing else, and there is no third.

`crds/` is where the tree shows it (`kubectl apply -f crds/` without Helm); the chart carries
the same file in its own `crds/` because Helm installs only files inside a chart, and a regular
file there works with `helm package`, Argo CD and Flux alike (a symlink makes every
`helm template` warn, and not every tool follows one). `make crd` writes both.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from servefleet.api.crd import CRD_NAME, crd_manifest, crd_yaml
from servefleet.cli import crd_cmd

ROOT = Path(__file__).resolve().parents[1]
COPIES = [
    ROOT / "charts" / "servefleet" / "crds" / "llmdeployments.servefleet.io.yaml",
    ROOT / "crds" / "llmdeployments.servefleet.io.yaml",
]


def walk(node: Any, path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    if isinstance(node, dict):
        yield path, node
        for key, value in node.get("properties", {}).items():
            yield from walk(value, f"{path}.{key}")
        if isinstance(node.get("items"), dict):
            yield from walk(node["items"], f"{path}[]")
        if isinstance(node.get("additionalProperties"), dict):
            yield from walk(node["additionalProperties"], f"{path}{{}}")


def schema() -> dict[str, Any]:
    result: dict[str, Any] = crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return result


def test_committed_crds_are_what_the_models_generate() -> None:
    for copy in COPIES:
        assert copy.read_text() == crd_yaml(), f"{copy} drifted from the models: run `make crd`"


def crd_copies(root: Path) -> list[Path]:
    """Every YAML file under `root` (hidden and build folders aside) defining our CRD."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("results", "build")]
        for name in files:
            path = Path(folder) / name
            if path.suffix in (".yaml", ".yml"):
                text = path.read_text(errors="replace")
                if "kind: CustomResourceDefinition" in text and f"name: {CRD_NAME}" in text:
                    found.append(path)
    return sorted(found)


def test_there_is_no_other_copy_of_the_crd(tmp_path: Path) -> None:
    assert crd_copies(ROOT) == sorted(COPIES)
    (tmp_path / "crds").mkdir()
    (tmp_path / "crds" / "copy.yaml").write_text(crd_yaml())
    assert crd_copies(tmp_path) == [tmp_path / "crds" / "copy.yaml"]


def test_check_command_detects_drift(tmp_path: Path) -> None:
    stale = tmp_path / "crd.yaml"
    stale.write_text(crd_yaml().replace("minReplicas", "minimumReplicas"))
    assert crd_cmd.run(argparse.Namespace(action="check", files=[str(stale)])) == 1
    assert crd_cmd.run(argparse.Namespace(action="generate", output=[str(stale)])) == 0
    assert crd_cmd.run(argparse.Namespace(action="check", files=[str(stale)])) == 0


def test_schema_is_structural() -> None:
    text = yaml.safe_dump(schema())
    for forbidden in ("$ref", "anyOf", "oneOf", "allOf", "title:", "nullable", "const:"):
        assert forbidden not in text
    for path, node in walk(schema()):
        if path.endswith("metadata"):
            continue
        assert "type" in node or node.get("x-kubernetes-int-or-string"), f"{path} has no type"
        if node.get("type") == "array":
            assert "items" in node, path


def test_every_field_has_a_description() -> None:
    # metadata is the API server's own: a CRD may say nothing about it.
    missing = [
        path
        for path, node in walk(schema())
        if path not in ("", ".metadata") and "description" not in node and not path.endswith("[]")
    ]
    assert missing == []


def test_defaults_and_whole_section_defaults() -> None:
    spec = schema()["properties"]["spec"]["properties"]
    assert spec["pool"]["default"] == {
        "minReplicas": 1,
        "maxReplicas": 4,
        "scaleDownDelay": 300.0,
        "perReplicaConcurrency": 16,
    }
    assert spec["engine"]["default"]["resources"] == {}
    assert spec["spillover"]["properties"]["when"]["default"]["queueFull"] is True
    assert spec["pool"]["properties"]["minReplicas"]["default"] == 1
    assert spec["engine"]["properties"]["kind"]["default"] == "servefleet"
    assert spec["engine"]["properties"]["kind"]["enum"] == ["servefleet", "vllm", "sglang"]
    assert "default" not in spec["spillover"]  # optional: absent stays absent
    assert "default" not in spec["replicas"]
    assert spec["engine"]["properties"]["kvCacheMemory"]["x-kubernetes-int-or-string"] is True
    assert spec["tenants"]["x-kubernetes-list-map-keys"] == ["name"]
    assert spec["autoscaling"]["properties"]["targetPerReplica"]["exclusiveMinimum"] is True


def test_cel_rules_cover_the_pydantic_cross_field_rules() -> None:
    messages = {
        rule["message"]
        for _, node in walk(schema())
        for rule in node.get("x-kubernetes-validations", [])
    }
    for expected in (
        "pool.minReplicas must be <= pool.maxReplicas",
        "spillover.enabled needs baseURL, model and apiKeySecretRef",
        "model.source needs exactly one of builtin, pvc, url, huggingface, s3 or oci",
        "model.cache applies only to the url, huggingface and s3 sources",
        "spillover.tenants must name tenants listed in spec.tenants",
    ):
        assert expected in messages


def test_subresources_columns_and_names() -> None:
    crd = crd_manifest()
    assert crd["metadata"]["name"] == CRD_NAME == "llmdeployments.servefleet.io"
    version = crd["spec"]["versions"][0]
    assert version["name"] == "v1alpha1"
    assert crd["spec"]["names"]["shortNames"] == ["llmd"]
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    assert version["subresources"]["status"] == {}
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns[:5] == ["Model", "Engine", "Ready", "Desired", "Queue"]
    assert columns[-1] == "Age"


def test_every_path_field_is_checked_by_the_api_server_with_a_bounded_rule() -> None:
    """`kubectl apply` itself refuses a path that climbs out of its volume, image or node
    folder; the CEL rule's string must be bounded or the API server refuses the CRD (cost)."""
    checked = {
        path: node
        for path, node in walk(schema())
        if any("'..'" in r["message"] for r in node.get("x-kubernetes-validations", []))
    }
    assert set(checked) == {
        ".spec.model.source.pvc.path",
        ".spec.model.source.oci.path",
        ".spec.model.source.s3.url",
        ".spec.model.source.url",
        ".spec.model.source.huggingface.revision",
        ".spec.model.cache.hostPath.path",
    }
    assert all(node.get("maxLength") for node in checked.values())
