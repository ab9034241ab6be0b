"""The CustomResourceDefinitions (LLMDeployment, LLMAdapter), generated from the pydantic models.

Pydantic emits JSON Schema (2020-12); Kubernetes wants a *structural* OpenAPI v3
schema: no $ref, no anyOf for optionals, int-or-string spelled its own way, no
titles, no `additionalProperties: false`. This module does that translation, once for
every resource (`CRDS`), and adds what only Kubernetes has: subresources, printer columns,
defaults for whole sections (so nested defaults apply) and the CEL rules the models carry.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import yaml
from pydantic import BaseModel

from servefleet.api.conventions import LABEL_APP_PART_OF, PART_OF
from servefleet.api.llmadapter import (
    ADAPTER_KIND,
    ADAPTER_PLURAL,
    ADAPTER_SHORT_NAME,
    LLMAdapter,
)
from servefleet.api.llmdeployment import (
    API_GROUP,
    API_VERSION,
    DNS_LABEL,
    KIND,
    MAX_NAME_LENGTH,
    PLURAL,
    SHORT_NAME,
    LLMDeployment,
)

_DROP_KEYS = {"title", "additionalProperties", "$defs"}


def _resolve(node: Any, defs: dict[str, Any]) -> Any:
    """Inline every $ref (the models have no recursion)."""
    if isinstance(node, list):
        return [_resolve(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = copy.deepcopy(defs[node["$ref"].rsplit("/", 1)[-1]])
        siblings = {k: v for k, v in node.items() if k != "$ref"}
        merged = _resolve(target, defs)
        # The field's own description and rules win over the model's.
        if "x-kubernetes-validations" in siblings and "x-kubernetes-validations" in merged:
            siblings["x-kubernetes-validations"] = (
                merged["x-kubernetes-validations"] + siblings["x-kubernetes-validations"]
            )
        merged.update(_resolve(siblings, defs))
        return merged
    return {key: _resolve(value, defs) for key, value in node.items()}


def _structural(node: dict[str, Any]) -> dict[str, Any]:
    """One schema node in Kubernetes' structural dialect (after $refs are inlined)."""
    node = dict(node)
    if "anyOf" in node:
        variants = [v for v in node.pop("anyOf") if v.get("type") != "null"]
        types = sorted(v.get("type", "") for v in variants)
        if types == ["integer", "string"]:
            node["x-kubernetes-int-or-string"] = True
        elif len(variants) == 1:
            inner = _structural(variants[0])
            inner.update({k: v for k, v in node.items() if k != "default" or v is not None})
            node = inner
        else:
            raise ValueError(f"no structural form for anyOf {types}")
    if node.get("default", 0) is None:
        del node["default"]
    if "const" in node:
        node["enum"] = [node.pop("const")]
    for bound, inclusive in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if bound in node and not isinstance(node[bound], bool):
            node[inclusive] = node[bound]
            node[bound] = True
    additional = node.get("additionalProperties")
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP_KEYS:
            continue
        if key == "properties":
            out[key] = {
                name: _property(sub, name in node.get("required", []))
                for name, sub in value.items()
            }
        elif key == "items":
            out[key] = _structural(value)
        else:
            out[key] = value
    if isinstance(additional, dict):
        out["additionalProperties"] = _structural(additional)
    return out


def _property(node: dict[str, Any], required: bool) -> dict[str, Any]:
    was_optional = "anyOf" in node and any(v.get("type") == "null" for v in node["anyOf"])
    prop = _structural(node)
    # A whole section that is always there defaults to its fields' defaults, so the
    # API server stores them and CEL rules can rely on them. (Not `default: {}`: the
    # API server checks a default against the CEL rules without nested defaulting.)
    if (
        not required
        and not was_optional
        and prop.get("type") == "object"
        and "properties" in prop
        and not prop.get("required")
        and "default" not in prop
    ):
        prop["default"] = {
            name: sub["default"] for name, sub in prop["properties"].items() if "default" in sub
        }
    return prop


@dataclass(frozen=True)
class Resource:
    """What differs between our custom resources; the translation above is shared."""

    model: type[BaseModel]
    kind: str
    plural: str
    short_name: str
    max_name_length: int
    printer_columns: tuple[dict[str, Any], ...]
    subresources: dict[str, Any]

    @property
    def crd_name(self) -> str:
        return f"{self.plural}.{API_GROUP}"

    @property
    def file_name(self) -> str:
        """The name of its committed copies under crds/ and the chart's crds/."""
        return f"{self.crd_name}.yaml"


def openapi_schema(resource: Resource | None = None) -> dict[str, Any]:
    """The openAPIV3Schema of a resource's CRD (the LLMDeployment's by default)."""
    resource = resource or LLMDEPLOYMENT_RESOURCE
    raw = resource.model.model_json_schema(by_alias=True, mode="validation")
    resolved = _resolve(raw, raw.get("$defs", {}))
    schema = _structural(resolved)
    props = schema["properties"]
    props["apiVersion"] = {"type": "string", "description": props["apiVersion"]["description"]}
    props["kind"] = {"type": "string", "description": props["kind"]["description"]}
    props["metadata"] = {"type": "object"}  # the API server allows nothing more here
    props["status"].pop("default", None)
    schema["required"] = ["spec"]
    longest = resource.max_name_length
    schema["x-kubernetes-validations"] = [
        {
            "rule": f"self.metadata.name.size() <= {longest} && "
            f"self.metadata.name.matches('{DNS_LABEL}')",
            "message": f"metadata.name must be a DNS label (a-z, 0-9, '-', starting with a letter) "
            f"of at most {longest} characters",
        }
    ]
    return schema


PRINTER_COLUMNS: tuple[dict[str, Any], ...] = (
    {"name": "Model", "type": "string", "jsonPath": ".spec.model.name"},
    {"name": "Engine", "type": "string", "jsonPath": ".spec.engine.kind"},
    {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas"},
    {"name": "Desired", "type": "integer", "jsonPath": ".status.desiredReplicas"},
    {"name": "Queue", "type": "integer", "jsonPath": ".status.queueDepth"},
    {
        "name": "Status",
        "type": "string",
        "jsonPath": '.status.conditions[?(@.type=="Ready")].reason',
        "priority": 1,
    },
    # Disaggregated only (empty otherwise): the prefill pool's ready replicas (`-o wide`).
    {
        "name": "Prefill",
        "type": "integer",
        "jsonPath": ".status.prefill.readyReplicas",
        "priority": 1,
    },
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
)

ADAPTER_PRINTER_COLUMNS: tuple[dict[str, Any], ...] = (
    {"name": "Deployment", "type": "string", "jsonPath": ".spec.deployment"},
    # Empty when unset: the served name is then metadata.name (the NAME column).
    {"name": "Model", "type": "string", "jsonPath": ".spec.model"},
    {"name": "Rank", "type": "integer", "jsonPath": ".status.rank"},
    {
        "name": "Accepted",
        "type": "string",
        "jsonPath": '.status.conditions[?(@.type=="Accepted")].status',
    },
    # JSONPath has no length(): the replicas themselves, which is what one wants to know.
    {"name": "Loaded", "type": "string", "jsonPath": ".status.loadedReplicas"},
    {
        "name": "Reason",
        "type": "string",
        "jsonPath": '.status.conditions[?(@.type=="Loaded")].reason',
        "priority": 1,
    },
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
)

LLMDEPLOYMENT_RESOURCE = Resource(
    model=LLMDeployment,
    kind=KIND,
    plural=PLURAL,
    short_name=SHORT_NAME,
    max_name_length=MAX_NAME_LENGTH,
    printer_columns=PRINTER_COLUMNS,
    subresources={
        "status": {},
        "scale": {
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        },
    },
)
LLMADAPTER_RESOURCE = Resource(
    model=LLMAdapter,
    kind=ADAPTER_KIND,
    plural=ADAPTER_PLURAL,
    short_name=ADAPTER_SHORT_NAME,
    max_name_length=63,  # AdapterMeta.name: a DNS label (nothing is named after an adapter)
    printer_columns=ADAPTER_PRINTER_COLUMNS,
    subresources={"status": {}},
)
CRDS: tuple[Resource, ...] = (LLMDEPLOYMENT_RESOURCE, LLMADAPTER_RESOURCE)
"""Every CRD we ship; `servefleet crd generate` writes one file each."""

CRD_NAME = LLMDEPLOYMENT_RESOURCE.crd_name


def crd_manifest(resource: Resource | None = None) -> dict[str, Any]:
    """The whole CustomResourceDefinition object (the LLMDeployment's by default)."""
    resource = resource or LLMDEPLOYMENT_RESOURCE
    kind = resource.kind
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": resource.crd_name,
            "labels": {LABEL_APP_PART_OF: PART_OF},
        },
        "spec": {
            "group": API_GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": kind,
                "listKind": f"{kind}List",
                "plural": resource.plural,
                "singular": kind.lower(),
                "shortNames": [resource.short_name],
                "categories": ["servefleet", "all"],
            },
            "versions": [
                {
                    "name": API_VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": openapi_schema(resource)},
                    "subresources": copy.deepcopy(resource.subresources),
                    "additionalPrinterColumns": [dict(c) for c in resource.printer_columns],
                }
            ],
        },
    }


def crd_yaml(resource: Resource | None = None) -> str:
    """The CRD as the YAML committed under crds/ (stable key order, so diffs are real)."""
    resource = resource or LLMDEPLOYMENT_RESOURCE
    header = (
        f"# Generated from {resource.model.__module__} by `servefleet crd generate`; do not edit.\n"
    )
    return header + yaml.safe_dump(crd_manifest(resource), sort_keys=False, width=100)
