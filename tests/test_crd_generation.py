"""The CRDs (LLMDeployment, LLMAdapter) are generated from the pydantic models, the one
source; each one's two committed copies are that output and nothing else, and there is no third.

`crds/` is where the tree shows it (`kubectl apply -f crds/` without Helm); the chart carries
the same files in its own `crds/` because Helm installs only files inside a chart, and a regular
file there works with `helm package`, Argo CD and Flux alike (a symlink makes every
`helm template` warn, and not every tool follows one). `make crd` writes both folders.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from servefleet.api import parallel
from servefleet.api.crd import (
    CRD_NAME,
    CRDS,
    LLMADAPTER_RESOURCE,
    Resource,
    crd_manifest,
    crd_yaml,
)
from servefleet.api.llmadapter import ADAPTER_SOURCE_MESSAGE
from servefleet.api.llmdeployment import GROUP_DISAGGREGATION_MESSAGE
from servefleet.cli import crd_cmd

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = [ROOT / "charts" / "servefleet" / "crds", ROOT / "crds"]
COPIES = [folder / "llmdeployments.servefleet.io.yaml" for folder in FOLDERS]


def walk(node: Any, path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    if isinstance(node, dict):
        yield path, node
        for key, value in node.get("properties", {}).items():
            yield from walk(value, f"{path}.{key}")
        if isinstance(node.get("items"), dict):
            yield from walk(node["items"], f"{path}[]")
        if isinstance(node.get("additionalProperties"), dict):
            yield from walk(node["additionalProperties"], f"{path}{{}}")


def schema(resource: Resource | None = None) -> dict[str, Any]:
    version = crd_manifest(resource)["spec"]["versions"][0]
    result: dict[str, Any] = version["schema"]["openAPIV3Schema"]
    return result


def adapter_schema() -> dict[str, Any]:
    return schema(LLMADAPTER_RESOURCE)


def test_committed_crds_are_what_the_models_generate() -> None:
    assert [r.file_name for r in CRDS] == [
        "llmdeployments.servefleet.io.yaml",
        "llmadapters.servefleet.io.yaml",
    ]
    for folder in FOLDERS:
        for resource in CRDS:
            copy = folder / resource.file_name
            assert copy.read_text() == crd_yaml(resource), f"{copy} drifted: run `make crd`"


def crd_copies(root: Path, crd_name: str = CRD_NAME) -> list[Path]:
    """Every YAML file under `root` (hidden and build folders aside) defining a CRD."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("results", "build")]
        for name in files:
            path = Path(folder) / name
            if path.suffix in (".yaml", ".yml"):
                text = path.read_text(errors="replace")
                if "kind: CustomResourceDefinition" in text and f"name: {crd_name}" in text:
                    found.append(path)
    return sorted(found)


def test_there_is_no_other_copy_of_the_crd(tmp_path: Path) -> None:
    assert crd_copies(ROOT) == sorted(COPIES)
    adapter = LLMADAPTER_RESOURCE
    assert crd_copies(ROOT, adapter.crd_name) == sorted(f / adapter.file_name for f in FOLDERS)
    (tmp_path / "crds").mkdir()
    (tmp_path / "crds" / "copy.yaml").write_text(crd_yaml())
    assert crd_copies(tmp_path) == [tmp_path / "crds" / "copy.yaml"]


def test_check_command_detects_drift_and_a_missing_crd(tmp_path: Path) -> None:
    def check() -> int:
        return crd_cmd.run(argparse.Namespace(action="check", folders=[str(tmp_path)]))

    assert check() == 1  # nothing there yet
    assert crd_cmd.run(argparse.Namespace(action="generate", output=[str(tmp_path)])) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(r.file_name for r in CRDS)
    assert check() == 0
    stale = tmp_path / LLMADAPTER_RESOURCE.file_name
    stale.write_text(stale.read_text().replace("loadedReplicas", "loaded"))
    assert check() == 1
    stale.unlink()
    assert check() == 1


def test_generate_to_stdout_is_every_crd(capsys: Any) -> None:
    assert crd_cmd.run(argparse.Namespace(action="generate", output=[])) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert [d["metadata"]["name"] for d in docs] == [r.crd_name for r in CRDS]


@pytest.mark.parametrize("resource", CRDS, ids=lambda r: r.kind)
def test_schema_is_structural(resource: Resource) -> None:
    text = yaml.safe_dump(schema(resource))
    for forbidden in ("$ref", "anyOf", "oneOf", "allOf", "title:", "nullable", "const:"):
        assert forbidden not in text
    for path, node in walk(schema(resource)):
        if path.endswith("metadata"):
            continue
        assert "type" in node or node.get("x-kubernetes-int-or-string"), f"{path} has no type"
        if node.get("type") == "array":
            assert "items" in node, path


@pytest.mark.parametrize("resource", CRDS, ids=lambda r: r.kind)
def test_every_field_has_a_description(resource: Resource) -> None:
    # metadata is the API server's own: a CRD may say nothing about it.
    missing = [
        path
        for path, node in walk(schema(resource))
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
        parallel.TP_GPUS_MESSAGE,
        parallel.STAGE_PER_POD_MESSAGE,
        parallel.OURS_ONE_GPU_MESSAGE,
        parallel.OURS_TOO_MANY_MESSAGE,
        GROUP_DISAGGREGATION_MESSAGE,
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


def test_the_adapter_crd_names_columns_and_status_subresource() -> None:
    crd = crd_manifest(LLMADAPTER_RESOURCE)
    assert crd["metadata"]["name"] == "llmadapters.servefleet.io"
    names = crd["spec"]["names"]
    assert (names["kind"], names["plural"], names["shortNames"]) == (
        "LLMAdapter",
        "llmadapters",
        ["llma"],
    )
    assert names["categories"] == crd_manifest()["spec"]["names"]["categories"]
    assert crd["spec"]["scope"] == "Namespaced"
    version = crd["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}  # no scale: an adapter has no replicas
    columns = {c["name"]: c for c in version["additionalPrinterColumns"]}
    assert list(columns)[:5] == ["Deployment", "Model", "Rank", "Accepted", "Loaded"]
    assert list(columns)[-1] == "Age"
    assert columns["Model"]["jsonPath"] == ".spec.model"
    assert columns["Rank"] == {"name": "Rank", "type": "integer", "jsonPath": ".status.rank"}
    assert columns["Accepted"]["jsonPath"] == '.status.conditions[?(@.type=="Accepted")].status'
    assert columns["Loaded"]["jsonPath"] == ".status.loadedReplicas"
    # Every column points at a field the schema has (a typo would print an empty column).
    for column in columns.values():
        node = adapter_schema()
        for part in column["jsonPath"].split("[", 1)[0].strip(".").split("."):
            node = node["properties"][part] if "properties" in node else {"type": "object"}
        assert node, column


def test_the_adapter_crd_refuses_what_pydantic_refuses() -> None:
    spec = adapter_schema()["properties"]["spec"]
    assert spec["required"] == ["deployment", "source"]
    rules = {r["message"]: r["rule"] for r in spec["x-kubernetes-validations"]}
    assert rules[ADAPTER_SOURCE_MESSAGE] == (
        "has(self.source.pvc) || has(self.source.huggingface) || has(self.source.s3) || "
        "has(self.source.oci) || has(self.source.url)"
    )
    # Duplicate tenants: a set list, which the API server refuses with duplicates.
    assert spec["properties"]["tenants"]["x-kubernetes-list-type"] == "set"
    assert spec["properties"]["deployment"]["pattern"] == "^[a-z]([-a-z0-9]*[a-z0-9])?$"
    status = adapter_schema()["properties"]["status"]["properties"]
    assert status["conditions"]["x-kubernetes-list-map-keys"] == ["type"]
    # The metadata.name rule has the adapter's own bound (a DNS label), not the deployment's.
    (name_rule,) = adapter_schema()["x-kubernetes-validations"]
    assert "<= 63" in name_rule["rule"]


def test_the_adapter_source_rule_is_the_pydantic_rule() -> None:
    """The CEL rule and `LLMAdapterSpec._folder_source` accept and refuse the same sources
    (the CEL is evaluated here by hand on what `has()` sees: the source's set fields)."""
    from pydantic import ValidationError

    from servefleet.api.llmadapter import ADAPTER_SOURCES, LLMAdapterSpec
    from servefleet.api.model_source import SOURCE_FIELDS

    sources = {
        "builtin": "smollm2-135m-instruct",
        "pvc": {"claimName": "c", "path": "a"},
        "url": "https://example.com/a.tgz",
        "huggingface": {"repo": "o/r"},
        "s3": {"url": "s3://bucket/a/"},
        "oci": {"reference": "r/a:1"},
    }
    rule = adapter_schema()["properties"]["spec"]["x-kubernetes-validations"][0]["rule"]
    for kind in SOURCE_FIELDS:
        cel_accepts = f"has(self.source.{kind})" in rule
        try:
            LLMAdapterSpec.model_validate({"deployment": "d", "source": {kind: sources[kind]}})
            pydantic_accepts = True
        except ValidationError as exc:
            assert ADAPTER_SOURCE_MESSAGE in str(exc)
            pydantic_accepts = False
        assert cel_accepts == pydantic_accepts == (kind in ADAPTER_SOURCES), kind


@pytest.mark.parametrize(
    ("url", "archive"),
    [
        ("https://example.com/a.tgz", True),
        ("https://example.com/a.tar.gz?sig=1", True),
        ("http://example.com/a.tar#x", True),
        ("https://example.com/adapter_model.safetensors", False),
        ("https://example.com/a.tgz/file", False),
        ("https://example.com/a?f=a.tgz", False),
    ],
)
def test_the_adapter_url_rule_is_the_pydantic_rule(url: str, archive: bool) -> None:
    """A url source must name an archive: the CEL `matches` (RE2, evaluated here with
    Python's `re`, which agrees on this pattern) and pydantic refuse the same urls."""
    import re

    from pydantic import ValidationError

    from servefleet.api.llmadapter import ADAPTER_URL_MESSAGE, LLMAdapterSpec

    spec = adapter_schema()["properties"]["spec"]
    rules = {r["message"]: r["rule"] for r in spec["x-kubernetes-validations"]}
    pattern = rules[ADAPTER_URL_MESSAGE].split(".matches('", 1)[1].removesuffix("')")
    assert bool(re.search(pattern, url)) is archive
    try:
        LLMAdapterSpec.model_validate({"deployment": "d", "source": {"url": url}})
        accepted = True
    except ValidationError as exc:
        assert ADAPTER_URL_MESSAGE in str(exc)
        accepted = False
    assert accepted is archive
