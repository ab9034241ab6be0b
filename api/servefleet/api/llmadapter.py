"""The LLMAdapter resource: one LoRA fine-tune served on an LLMDeployment's pool.

A namespaced resource of its own (as AIBrix's ModelAdapter) rather than a list inside the
LLMDeployment (as KubeAI's): a tenant team owns its adapters under its own RBAC
(`create llmadapters` in its namespace) without write access to the platform team's
deployment, and adding one never rolls the deployment's pods. Local mode reads the same
documents from the same YAML file. Why, in full: `api/README.md`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from servefleet.api.api_model import DNS_LABEL, ApiModel, cel_rule
from servefleet.api.deployment_status import Condition
from servefleet.api.llmdeployment import ObjectMeta
from servefleet.api.lora import ADAPTER_ARCHIVE, ADAPTER_NAME
from servefleet.api.model_source import ModelSource

ADAPTER_KIND = "LLMAdapter"
ADAPTER_PLURAL = "llmadapters"
ADAPTER_SHORT_NAME = "llma"
ADAPTER_SOURCES = ("pvc", "huggingface", "s3", "oci", "url")
"""Where adapter folders come from (a built-in is a base model, never an adapter)."""
ADAPTER_SOURCE_MESSAGE = "source: an adapter is a folder: use pvc, huggingface, s3, oci or url"
ADAPTER_URL_MESSAGE = (
    "source.url: an adapter is a folder: the url must name a .tar, .tar.gz or .tgz archive of it"
)


class LLMAdapterSpec(ApiModel):
    """Which deployment serves the adapter, where its PEFT folder is, and who may use it."""

    # The CEL twin of `_folder_source` (the API server refuses what pydantic refuses).
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel_rule(
                    " || ".join(f"has(self.source.{kind})" for kind in ADAPTER_SOURCES),
                    ADAPTER_SOURCE_MESSAGE,
                ),
                cel_rule(
                    "!has(self.source.url) || "
                    f"self.source.url.matches('{ADAPTER_ARCHIVE.pattern}')",
                    ADAPTER_URL_MESSAGE,
                ),
            ]
        }
    )

    deployment: str = Field(
        description="The LLMDeployment (same namespace) whose engines serve this adapter; its "
        "engine.lora must be set.",
        pattern=DNS_LABEL,
        max_length=63,
    )
    model: str | None = Field(
        default=None,
        description="The name clients send in the OpenAI 'model' field (default: metadata.name).",
        pattern=ADAPTER_NAME.pattern,
        max_length=128,
    )
    source: ModelSource = Field(
        description="The PEFT folder (adapter_config.json + adapter_model.safetensors): pvc, "
        "huggingface, s3 (a folder), oci (an artifact or image holding it) or url (a .tar, "
        ".tar.gz or .tgz archive of it)."
    )
    tenants: list[str] = Field(
        default_factory=list,
        max_length=100,
        json_schema_extra={"x-kubernetes-list-type": "set"},  # duplicates refused by the API
        description="Tenants of the deployment that may use the adapter (empty: every tenant "
        "of the deployment). Any other key gets 404 model_not_found, as for a model it cannot "
        "see.",
    )

    @model_validator(mode="after")
    def _folder_source(self) -> LLMAdapterSpec:
        if self.source.kind not in ADAPTER_SOURCES:
            raise ValueError(ADAPTER_SOURCE_MESSAGE)
        if self.source.url is not None and not ADAPTER_ARCHIVE.match(self.source.url):
            raise ValueError(ADAPTER_URL_MESSAGE)
        if len(set(self.tenants)) != len(self.tenants):
            raise ValueError("tenants: duplicate names")
        return self


AdapterConditionType = Literal["Accepted", "Loaded"]
ADAPTER_ACCEPTED: AdapterConditionType = "Accepted"
"""Written by the operator: the adapter fits its deployment (or why not)."""
ADAPTER_LOADED: AdapterConditionType = "Loaded"
"""Written by the autoscaler from the gateways' view: held by a replica, or why a load failed."""


class LLMAdapterStatus(ApiModel):
    """What the operator observed: whether the adapter fits its deployment, and where it
    is loaded."""

    observed_generation: int = Field(default=0, description="Last generation acted on.")
    base_model: str = Field(default="", description="The deployment's model (the parent).")
    rank: int | None = Field(default=None, description="r from the adapter's own config.")
    target_modules: list[str] = Field(
        default_factory=list, description="target_modules from the adapter's own config."
    )
    loaded_replicas: list[str] = Field(
        default_factory=list,
        max_length=1000,
        description="Engine replicas that hold the adapter now (as the gateway last saw).",
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        description="Accepted (fits its deployment) and Loaded (held by a replica, or why a "
        "load failed).",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )

    def condition(self, type_: str) -> Condition | None:
        return next((c for c in self.conditions if c.type == type_), None)


class AdapterMeta(ObjectMeta):
    """An LLMDeployment's metadata, but a name of a whole DNS label (no children are named
    after an adapter, so it needs no room for suffixes)."""

    name: str = Field(description="Name of the LLMAdapter.", pattern=DNS_LABEL, max_length=63)


class LLMAdapter(ApiModel):
    """An LLMAdapter custom resource."""

    api_version: Literal["servefleet.io/v1alpha1"] = Field(
        default="servefleet.io/v1alpha1", description="servefleet.io/v1alpha1."
    )
    kind: Literal["LLMAdapter"] = Field(default="LLMAdapter", description="LLMAdapter.")
    metadata: AdapterMeta = Field(description="Standard object metadata.")
    spec: LLMAdapterSpec = Field(description="Desired state.")
    status: LLMAdapterStatus = Field(
        default_factory=LLMAdapterStatus, description="Observed state."
    )

    @property
    def name(self) -> str:
        return self.metadata.name

    @property
    def namespace(self) -> str:
        return self.metadata.namespace

    @property
    def served_name(self) -> str:
        """What clients send as `model`."""
        return self.spec.model or self.metadata.name
