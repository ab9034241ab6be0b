"""How one operator instance runs: what the command line and the chart's values set."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, SecretBytes

from servefleet.operator.policy import default_allowed_images


class OperatorSettings(BaseModel):
    """How this operator instance runs (from the command line / chart values)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    namespaces: list[str] = Field(
        default_factory=list, description="Namespaces to watch; empty = all."
    )
    engine_image: str = Field(description="Image for servefleet engine pods and model fetchers.")
    gateway_url: str = Field(description="Base URL of the gateway Service, for status.endpoint.")
    image_pull_policy: str = Field(
        default="IfNotPresent", description="Pull policy of engine pods."
    )
    route_signing_key: SecretBytes = Field(
        description="HMAC key of the route ConfigMaps (the gateway serves only signed ones)."
    )
    system_namespace: str = Field(
        default="servefleet",
        description="The chart's namespace: engine pods admit its gateway and autoscaler pods.",
    )
    metrics_namespaces: list[str] = Field(
        default_factory=list, description="Namespaces whose pods (Prometheus) may scrape engines."
    )
    allowed_images: list[str] = Field(
        default_factory=lambda: list(default_allowed_images()),
        description="Engine images teams may use besides engine_image (see policy).",
    )
    host_path_prefixes: list[str] = Field(
        default_factory=list, description="Node folders a hostPath cache may be in or under."
    )
    resync_seconds: float = Field(default=30.0, gt=0, description="Drift-repair period per object.")
    service_monitor_check_seconds: float = Field(
        default=300.0,
        gt=0,
        description="How often to re-check whether the ServiceMonitor CRD exists.",
    )
