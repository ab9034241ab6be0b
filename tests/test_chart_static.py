"""Chart facts that need no helm binary (helm lint/template run in e2e/)."""

from __future__ import annotations

import itertools
import json
import re
import tomllib
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "servefleet"


def package_version() -> str:
    version: str = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    return version


def test_chart_versions_follow_the_package() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == package_version()
    assert chart["version"] == package_version()
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["image"]["tag"] == ""  # empty: defaults to appVersion in the templates
    assert (
        "default .Chart.AppVersion .Values.image.tag"
        in (CHART / "templates" / "_helpers.tpl").read_text()
    )


def test_dockerfile_is_pinned_and_runs_servefleet() -> None:
    text = (ROOT / "Dockerfile").read_text()
    # Every FROM is an earlier stage or an image argument whose default is pinned.
    stages = set(re.findall(r"^FROM \S+ AS (\S+)", text, flags=re.MULTILINE))
    defaults = dict(re.findall(r"^ARG (\w+_IMAGE)=(\S+)", text, flags=re.MULTILINE))
    images = re.findall(r"^FROM (\S+)", text, flags=re.MULTILINE)
    assert images and defaults
    for image in images:
        if image in stages:
            continue
        assert image.startswith("${") and image[2:-1] in defaults, image
    assert all(re.search(r":\d+\.\d+\.\d+", image) for image in defaults.values())
    assert {"control-plane", "engine", "engine-cpu"} <= stages
    assert 'ENTRYPOINT ["servefleet"]' in text
    assert "--frozen" in text


def test_dashboards_are_valid_grafana_json() -> None:
    files = sorted((CHART / "files" / "dashboards").glob("*.json"))
    assert files
    for path in files:
        dashboard = json.loads(path.read_text())
        assert dashboard["uid"] and dashboard["panels"]
        for panel in dashboard["panels"]:
            assert panel["targets"][0]["expr"]


def test_operator_rbac_never_deletes_and_never_reads_secrets() -> None:
    text = (CHART / "templates" / "rbac.yaml").read_text()
    operator_role = text.split("name: {{ $fullname }}-operator", 1)[1].split(
        "kind: ClusterRole", 1
    )[0]
    rules = [
        line
        for line in operator_role.splitlines()
        if line.strip().startswith(("verbs:", "resources:"))
    ]
    assert rules
    assert not any("delete" in line for line in rules)
    # Secrets: only `create` (the engine key, written once); never get/list/watch/patch.
    for resources, verbs in itertools.pairwise(rules):
        if "secrets" in resources:
            assert verbs.strip() == "verbs: [create]", verbs
    assert "'*'" not in text and '"*"' not in text


def schema_node(schema: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    """`node`, or the definition its `$ref` names."""
    ref = node.get("$ref")
    if not ref:
        return node
    found: dict[str, Any] = schema["definitions"][ref.removeprefix("#/definitions/")]
    return found


def undeclared_values(
    schema: dict[str, Any], node: dict[str, Any], values: Any, path: str
) -> list[str]:
    """Paths in `values` that the schema neither declares nor leaves open."""
    node = schema_node(schema, node)
    if not isinstance(values, dict) or "properties" not in node:
        return []
    missing = []
    for key, value in values.items():
        declared = node["properties"].get(key)
        if declared is None:
            missing.append(f"{path}{key}")
        else:
            missing += undeclared_values(schema, declared, value, f"{path}{key}.")
    return missing


def test_every_value_is_declared_in_the_closed_schema() -> None:
    """A key added to values.yaml without the schema fails here before `helm install`
    refuses it; and the schema refuses unknown keys at every level the chart defines."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert undeclared_values(schema, schema, values, "") == []
    assert all(
        node.get("additionalProperties") is False for node in objects_with_properties(schema)
    )


def objects_with_properties(node: Any) -> list[dict[str, Any]]:
    """Every schema object that lists its properties, nested ones included."""
    if isinstance(node, list):
        return [found for item in node for found in objects_with_properties(item)]
    if not isinstance(node, dict):
        return []
    own = [node] if isinstance(node.get("properties"), dict) else []
    return own + objects_with_properties(list(node.values()))
