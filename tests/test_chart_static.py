"""Chart facts that need no helm binary (helm lint/template run in e2e/)."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Any

import yaml

from servefleet.api.engines import ENGINE_ADAPTERS
from servefleet.kube.resources import LEADER_WORKER_SETS
from servefleet.operator.policy import default_allowed_images, image_allowed
from servefleet.operator.pool_cleanup import PREFILL_POOL_KINDS

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
            # A row is a header (its panels follow it, or sit inside it when collapsed).
            for inner in [panel, *panel.get("panels", [])]:
                if inner["type"] == "row":
                    assert "targets" not in inner, inner["title"]
                else:
                    assert inner["targets"][0]["expr"], inner["title"]


def component_rules(component: str) -> list[dict[str, Any]]:
    """One component's RBAC rules as _rbac.tpl defines them (plain YAML, comments aside)."""
    text = (CHART / "templates" / "_rbac.tpl").read_text()
    body = text.split(f'define "servefleet.rules.{component}" -}}}}', 1)[1].split("{{- end", 1)[0]
    rules: list[dict[str, Any]] = yaml.safe_load(body)
    return rules


def verbs_on(rules: list[dict[str, Any]], resource: str) -> set[str]:
    return {v for r in rules if resource in r["resources"] for v in r["verbs"]}


def test_operator_rbac_deletes_only_a_prefill_pool_and_never_reads_secrets() -> None:
    rules = component_rules("operator")
    assert rules
    # The garbage collector removes children; the operator deletes by hand only a removed
    # prefill pool (spec.disaggregation): its objects, one by one (`pool_cleanup`), and the
    # engine workload of the other kind when replicas change between one pod and groups.
    deleting = {res for r in rules if "delete" in r["verbs"] for res in r["resources"]}
    assert deleting == {p.plural for p in PREFILL_POOL_KINDS} | {LEADER_WORKER_SETS.plural}
    assert not any("deletecollection" in r["verbs"] for r in rules)
    # Secrets: only `create` (the engine key, written once); never get/list/watch/patch.
    assert verbs_on(rules, "secrets") == {"create"}
    text = (CHART / "templates" / "rbac.yaml").read_text()
    assert "'*'" not in text and '"*"' not in text


def test_the_autoscaler_never_writes_pods_and_the_gateway_never_lists_secrets() -> None:
    """Images are mutable: `patch pods` would let the autoscaler run anything anywhere it is
    bound. It ranks pods in status.podDeletionCosts; the operator annotates them."""
    assert verbs_on(component_rules("autoscaler"), "pods") == {"list"}
    assert verbs_on(component_rules("gateway"), "secrets") == {"get"}
    assert verbs_on(component_rules("operator"), "pods") == {"list", "patch"}


def test_rbac_is_namespaced_unless_the_admin_opts_in() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["rbac"]["clusterWide"] is False
    assert values["operator"]["watchNamespaces"] == []  # = the release namespace
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    assert "toYaml (list .Release.Namespace)" in helpers
    rbac = (CHART / "templates" / "rbac.yaml").read_text()
    # The only cluster-scoped bindings are behind rbac.clusterWide.
    before_opt_in = rbac.split("{{- if $root.Values.rbac.clusterWide }}", 1)[0]
    assert "ClusterRole" not in before_opt_in.split("*/ -}}", 1)[1]


def test_default_allow_lists_are_the_examples_images_and_no_host_folder() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert sorted(values["operator"]["allowedImages"]) == sorted(default_allowed_images())
    assert values["operator"]["allowedHostPathPrefixes"] == []
    for adapter in ENGINE_ADAPTERS.values():
        if adapter.default_image:
            assert image_allowed(adapter.default_image, values["operator"]["allowedImages"])


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
