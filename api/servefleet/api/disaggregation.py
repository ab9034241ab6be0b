"""Disaggregated prefill/decode: the spec block and the names every component shares.

An `LLMDeployment` with `spec.disaggregation` runs two pools: the deployment's own pool
(`spec.pool`, `spec.replicas`, the scale subresource) decodes, and `disaggregation.prefill`
is a second pool that only processes prompts and hands their KV to a decode replica. An
absent block means colocated, as before. Role names follow llm-d (`llm-d.ai/role`), so its
tooling recognises our pods.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, model_validator
from pydantic.json_schema import JsonDict

from servefleet.api.api_model import ApiModel, cel_rule
from servefleet.api.engine_spec import ResourceRequirements

Role = Literal["prefill", "decode"]
ROLES: tuple[Role, ...] = ("prefill", "decode")
ROLE_LABEL = "servefleet.io/role"
LLMD_ROLE_LABEL = "llm-d.ai/role"
PREFILL_SUFFIX = "-prefill"
"""The prefill pool's Deployment and Service are named `<name>-prefill`."""

TransferBackend = Literal["http", "nixl", "mooncake"]
"""How KV moves: `http` is our engine's raw-body transfer (the only one it runs); vLLM runs
NIXL, SGLang NIXL or Mooncake."""

DEFAULT_THRESHOLD_TOKENS = 256
"""Uncached prompt tokens below which the decode replica prefills itself (llm-d's
pdThreshold): a short prompt costs less to compute than to hand over."""


TRANSFER_ENGINES: dict[str, tuple[str, ...]] = {
    "http": ("servefleet",),
    "nixl": ("vllm", "sglang"),
    "mooncake": ("sglang",),
}
"""The engine kinds each transport runs on (ours speaks only http; vLLM's NixlConnector;
SGLang's --disaggregation-transfer-backend nixl|mooncake)."""


def transfer_message(transfer: str) -> str:
    """The one error for a transport the engine kind cannot run (pydantic and CEL)."""
    kinds = " or ".join(TRANSFER_ENGINES[transfer])
    hint = {
        "http": " (vllm and sglang: transfer nixl)",
        "nixl": " (servefleet: transfer http)",
        "mooncake": "",
    }[transfer]
    return f"disaggregation.transfer {transfer} runs only on engine.kind {kinds}{hint}"


def transfer_refusal(engine_kind: str, disaggregation: DisaggregationSpec | None) -> str | None:
    """Why this engine kind cannot run the declared transport, or None."""
    if disaggregation is None or engine_kind in TRANSFER_ENGINES[disaggregation.transfer]:
        return None
    return transfer_message(disaggregation.transfer)


def transfer_cel_rules() -> list[JsonDict]:
    """The same check as `transfer_refusal`, as CEL on LLMDeploymentSpec (one rule per
    transport, so the API server's message names the one that failed)."""
    rules: list[JsonDict] = []
    for transfer, kinds in TRANSFER_ENGINES.items():
        allowed = ", ".join(f"'{k}'" for k in kinds)
        rules.append(
            cel_rule(
                "!has(self.disaggregation) || "
                "(has(self.disaggregation.transfer) ? self.disaggregation.transfer : 'http') "
                f"!= '{transfer}' || self.engine.kind in [{allowed}]",
                transfer_message(transfer),
            )
        )
    return rules


class PrefillPoolSpec(ApiModel):
    """The prefill pool: its bounds, resources, engine arguments and scaling signal."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel_rule(
                    "self.minReplicas <= self.maxReplicas",
                    "disaggregation.prefill.minReplicas must be <= maxReplicas",
                )
            ]
        }
    )

    min_replicas: int = Field(default=1, ge=1, le=1000, description="Prefill replicas kept warm.")
    max_replicas: int = Field(default=4, ge=1, le=1000, description="Most prefill replicas.")
    replicas: int | None = Field(
        default=None,
        ge=0,
        description="Desired prefill replicas (set by the autoscaler); unset means minReplicas.",
    )
    per_replica_concurrency: int = Field(
        default=4, ge=1, description="Most prompts the gateway sends one prefill replica at once."
    )
    resources: ResourceRequirements | None = Field(
        default=None, description="Container resources; unset means engine.resources."
    )
    args: list[str] = Field(
        default_factory=list,
        max_length=64,
        description="Extra engine arguments for prefill replicas only (after engine.args).",
    )
    prompt_tokens_per_replica: int = Field(
        default=4096,
        ge=1,
        description="Autoscaling target: queued plus running prompt tokens per prefill replica.",
    )

    @model_validator(mode="after")
    def _bounds(self) -> PrefillPoolSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError("disaggregation.prefill.minReplicas must be <= maxReplicas")
        return self

    def desired_replicas(self) -> int:
        wanted = self.min_replicas if self.replicas is None else self.replicas
        return max(self.min_replicas, min(self.max_replicas, wanted))


class DisaggregationSpec(ApiModel):
    """Separate prefill and decode pools; the deployment's own pool is the decode pool."""

    prefill: PrefillPoolSpec = Field(
        default_factory=PrefillPoolSpec, description="The prefill pool."
    )
    threshold: int = Field(
        default=DEFAULT_THRESHOLD_TOKENS,
        ge=0,
        description="Uncached prompt tokens below which the decode replica prefills itself.",
    )
    transfer: TransferBackend = Field(
        default="http",
        description="KV transport: http (engine.kind servefleet), nixl (vllm, sglang), "
        "mooncake (sglang).",
    )
