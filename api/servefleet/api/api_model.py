"""The base of every part of the LLMDeployment spec, and the patterns they share.

Cross-field rules live twice on purpose: as pydantic validators (local mode, unit
tests, the operator) and as CEL rules in `x-kubernetes-validations` (the API server
rejects a bad CR before anything reconciles it). Both carry the same message;
`cel_rule` spells the CEL half.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel
from pydantic.json_schema import JsonDict

DNS_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
# Kubernetes resource quantity (e.g. "500m", "4Gi", "1").
QUANTITY = r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$"

Quantity = Annotated[int | str, Field(description="A Kubernetes quantity, e.g. 1, '500m', '4Gi'.")]


def cel_rule(rule: str, message: str) -> JsonDict:
    """One `x-kubernetes-validations` entry."""
    return {"rule": rule, "message": message}


class ApiModel(BaseModel):
    """Base for every part of the spec: camelCase on the wire, unknown fields are errors."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_default=True,
    )

    def to_wire(self) -> dict[str, Any]:
        """The camelCase dict Kubernetes and YAML files see (unset optionals left out)."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


class SecretKeyRef(ApiModel):
    """A key in a Secret of the same namespace (in local mode: a Secret document in the
    same file, or an environment variable; see `servefleet.api.manifests`)."""

    name: str = Field(description="Name of the Secret.", pattern=DNS_SUBDOMAIN, max_length=253)
    key: str = Field(description="Key inside the Secret whose value is used.", min_length=1)
