"""Who may call a deployment (`spec.tenants`) and where its overflow goes (`spec.spillover`)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field, model_validator

from servefleet.api.api_model import DNS_LABEL, ApiModel, SecretKeyRef, cel_rule

TrafficClass = Literal["interactive", "batch"]


class TenantLimits(ApiModel):
    """Rate limits of a tenant; unset means unlimited."""

    requests_per_minute: int | None = Field(default=None, ge=1, description="Requests per minute.")
    tokens_per_minute: int | None = Field(
        default=None,
        ge=1,
        description="Prompt + completion tokens per minute (reserved at admission).",
    )
    max_concurrent_requests: int | None = Field(
        default=None, ge=1, description="Requests in flight at once."
    )
    daily_token_budget: int | None = Field(
        default=None, ge=1, description="Tokens per UTC day (reserved at admission)."
    )
    monthly_token_budget: int | None = Field(
        default=None, ge=1, description="Tokens per UTC calendar month (reserved at admission)."
    )
    daily_cost_budget_usd: float | None = Field(
        default=None,
        alias="dailyCostBudgetUSD",
        gt=0,
        le=1e9,
        description="USD per UTC day, priced by the deployment's tokenPrices.",
    )
    monthly_cost_budget_usd: float | None = Field(
        default=None,
        alias="monthlyCostBudgetUSD",
        gt=0,
        le=1e9,
        description="USD per UTC calendar month, priced by the deployment's tokenPrices.",
    )

    @property
    def has_cost_budget(self) -> bool:
        return self.daily_cost_budget_usd is not None or self.monthly_cost_budget_usd is not None


class TenantSpec(ApiModel):
    """A tenant allowed to call this deployment's model. The key is only referenced:
    it lives in a Secret, never in the CR (CRs are readable by far more people)."""

    name: str = Field(
        description="Tenant name (a DNS label), used in metrics and limits.",
        pattern=DNS_LABEL,
        max_length=63,
    )
    api_key_secret_ref: SecretKeyRef = Field(description="Secret key holding the tenant's API key.")
    traffic_class: TrafficClass = Field(
        default="interactive", description="interactive goes ahead of batch; batch is shed first."
    )
    weight: float = Field(
        default=1.0, gt=0, description="Share of the pool in weighted fair queuing."
    )
    limits: TenantLimits = Field(
        default_factory=TenantLimits,
        description="Tenant-wide limits across every model (a tenant listed in several "
        "LLMDeployments must carry the same ones).",
    )
    model_limits: TenantLimits | None = Field(
        default=None, description="Extra limits for this deployment's model only."
    )


# --------------------------------------------------------------------------- spill-over


class SpilloverWhen(ApiModel):
    """When a request goes to the hosted API instead of the pool."""

    queue_full: bool = Field(
        default=True, description="The gateway queue is at admission.maxQueueDepth."
    )
    predicted_wait_over_seconds: float | None = Field(
        default=None, gt=0, description="The predicted queue wait is over this many seconds."
    )
    no_ready_replica: bool = Field(
        default=True, description="No replica is ready (scaled to zero, cold start)."
    )


class SpilloverSpec(ApiModel):
    """Send overflow to an OpenAI-compatible hosted API."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel_rule(
                    "!self.enabled || (has(self.baseURL) && has(self.model) "
                    "&& has(self.apiKeySecretRef))",
                    "spillover.enabled needs baseURL, model and apiKeySecretRef",
                )
            ]
        }
    )

    enabled: bool = Field(default=False, description="Turn spill-over on.")
    base_url: str | None = Field(
        default=None,
        alias="baseURL",
        description="Base URL of the hosted API, e.g. https://api.example.com/v1.",
        pattern=r"^https?://.+",
    )
    model: str | None = Field(
        default=None, description="Model name at the hosted API.", min_length=1
    )
    api_key_secret_ref: SecretKeyRef | None = Field(
        default=None, description="Secret key holding the hosted API's key."
    )
    tenants: list[Annotated[str, Field(max_length=63)]] = Field(
        default_factory=list,
        max_length=100,
        description="Tenants that may spill over; empty means all of them. Batch-class "
        "requests (batch lines, tenants of trafficClass batch) spill only while the pool has "
        "no ready replica: otherwise they wait for spare capacity.",
    )
    when: SpilloverWhen = Field(
        default_factory=SpilloverWhen, description="Conditions that trigger a spill-over."
    )
    max_requests_per_minute: int = Field(
        default=60,
        ge=1,
        description="Cap on spilled requests per minute, so a storm cannot run up the bill.",
    )
    timeout_seconds: float = Field(
        default=60.0, gt=0, description="Cut an upstream request after this long."
    )

    @model_validator(mode="after")
    def _needs_target(self) -> SpilloverSpec:
        if self.enabled and (
            self.base_url is None or self.model is None or self.api_key_secret_ref is None
        ):
            raise ValueError("spillover.enabled needs baseURL, model and apiKeySecretRef")
        return self
