"""The LLMDeployment CustomResourceDefinition, generated from the pydantic models.

Pydantic emits JSON Schema (2020-12); Kubernetes wants a *structural* OpenAPI v3
schema: no $ref, no anyOf for optionals, int-or-string spelled its own way, no
titles, no `additionalProperties: false`. This module does that translation and
adds what only Kubernetes has: subresources, printer columns, defaults for whole
sections (so nested defaults apply) and the CEL rules the models carry.
"""

from __future__ import annotations

import copy
from typing import Any

import yaml

from servefleet.api.conventions import LABEL_APP_PART_OF, PART_OF
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

CRD_NAME = f"{PLURAL}.{API_GROUP}"
GENERATED_HEADER = (
    "# Generated from servefleet.api.llmdeployment by `servefleet crd generate`; do not edit.\n"
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


def openapi_schema() -> dict[str, Any]:
    """The openAPIV3Schema of the LLMDeployment CRD."""
    raw = LLMDeployment.model_json_schema(by_alias=True, mode="validation")
    resolved = _resolve(raw, raw.get("$defs", {}))
    schema = _structural(resolved)
    props = schema["properties"]
    props["apiVersion"] = {"type": "string", "description": props["apiVersion"]["description"]}
    props["kind"] = {"type": "string", "description": props["kind"]["description"]}
    props["metadata"] = {"type": "object"}  # the API server allows nothing more here
    props["status"].pop("default", None)
    schema["required"] = ["spec"]
    schema["x-kubernetes-validations"] = [
        {
            "rule": f"self.metadata.name.size() <= {MAX_NAME_LENGTH} && "
            f"self.metadata.name.matches('{DNS_LABEL}')",
            "message": f"metadata.name must be a DNS label (a-z, 0-9, '-', starting with a letter) "
            f"of at most {MAX_NAME_LENGTH} characters",
        }
    ]
    return schema


PRINTER_COLUMNS: list[dict[str, Any]] = [
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
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def crd_manifest() -> dict[str, Any]:
    """The whole CustomResourceDefinition object."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": CRD_NAME,
            "labels": {LABEL_APP_PART_OF: PART_OF},
        },
        "spec": {
            "group": API_GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": KIND.lower(),
                "shortNames": [SHORT_NAME],
                "categories": ["servefleet", "all"],
            },
            "versions": [
                {
                    "name": API_VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": openapi_schema()},
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                }
            ],
        },
    }


def crd_yaml() -> str:
    """The CRD as the YAML committed under crds/ (stable key order, so diffs are real)."""
    return GENERATED_HEADER + yaml.safe_dump(crd_manifest(), sort_keys=False, width=100)
