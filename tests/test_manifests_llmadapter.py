"""`load_llmadapters`: the LLMAdapter documents of a YAML file, as `load_llmdeployments` reads
the deployments of the same file (which skips the adapters)."""

from __future__ import annotations

from pathlib import Path

import pytest

from servefleet.api.llmadapter import ADAPTER_SOURCE_MESSAGE
from servefleet.api.manifests import ManifestError, load_llmadapters, load_llmdeployments

DEPLOYMENT = """
apiVersion: servefleet.io/v1alpha1
kind: LLMDeployment
metadata: {name: smol}
spec:
  model: {name: smollm2, source: {builtin: smollm2-135m-instruct}}
  engine: {lora: {maxLoras: 2}}
"""


def adapter(name: str, namespace: str = "default", source: str = "{pvc: {claimName: a}}") -> str:
    return f"""
apiVersion: servefleet.io/v1alpha1
kind: LLMAdapter
metadata: {{name: {name}, namespace: {namespace}}}
spec: {{deployment: smol, source: {source}, tenants: [team-a]}}
"""


def write(tmp_path: Path, *docs: str) -> Path:
    path = tmp_path / "file.yaml"
    path.write_text("\n---\n".join(docs))
    return path


def test_adapters_and_deployments_come_from_one_file(tmp_path: Path) -> None:
    path = write(tmp_path, DEPLOYMENT, adapter("fox"), adapter("owl", "team"))
    adapters = load_llmadapters(path)
    assert [(a.namespace, a.name, a.served_name) for a in adapters] == [
        ("default", "fox", "fox"),
        ("team", "owl", "owl"),
    ]
    assert adapters[0].spec.tenants == ["team-a"]
    assert adapters[0].spec.source.pvc is not None
    # The deployment loader skips the adapters, as it skips Secrets.
    assert [d.name for d in load_llmdeployments(path)] == ["smol"]


def test_no_adapter_is_an_empty_list_not_an_error(tmp_path: Path) -> None:
    assert load_llmadapters(write(tmp_path, DEPLOYMENT)) == []


def test_an_invalid_adapter_names_its_document_and_field(tmp_path: Path) -> None:
    bad = adapter("fox", source="{builtin: smollm2-135m-instruct}")
    with pytest.raises(ManifestError) as refused:
        load_llmadapters(write(tmp_path, DEPLOYMENT, bad))
    text = str(refused.value)
    assert "document 2 (LLMAdapter fox)" in text
    assert ADAPTER_SOURCE_MESSAGE in text


def test_an_adapter_named_twice_in_one_namespace_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="LLMAdapter default/fox appears twice"):
        load_llmadapters(write(tmp_path, adapter("fox"), adapter("fox")))
    # The same name in two namespaces is two adapters.
    assert len(load_llmadapters(write(tmp_path, adapter("fox"), adapter("fox", "other")))) == 2


def test_wrong_api_version_and_a_document_without_kind_are_refused(tmp_path: Path) -> None:
    old = adapter("fox").replace("servefleet.io/v1alpha1", "servefleet.io/v1")
    with pytest.raises(ManifestError, match=r"document 1: apiVersion 'servefleet.io/v1'"):
        load_llmadapters(write(tmp_path, old))
    with pytest.raises(ManifestError, match="document 2 has no apiVersion/kind"):
        load_llmadapters(write(tmp_path, DEPLOYMENT, "metadata: {name: x}\n"))


def test_unknown_fields_are_refused_by_path(tmp_path: Path) -> None:
    typo = adapter("fox").replace("tenants:", "tenant:")
    with pytest.raises(ManifestError, match=r"spec\.tenant: Extra inputs are not permitted"):
        load_llmadapters(write(tmp_path, typo))
