"""`spec.chargeback`: who pays for idle replicas, and the prices the usage report applies.

Prices left out fall back to `spec.autoscaling.prices` (one replica-hour price; one hosted
price per million tokens for prompt and completion alike), so a deployment priced for the
autoscaler is priced for chargeback too.
"""

from __future__ import annotations

from pydantic import Field

from servefleet.api.api_model import ApiModel
from servefleet.api.chargeback import IdlePolicy
from servefleet.api.scaling_prices import ScalingPrices


class HostedPrices(ApiModel):
    """The hosted API's price table (what spilled tokens cost), per million tokens."""

    input_per_million: float = Field(ge=0, description="Price of one million prompt tokens.")
    output_per_million: float = Field(ge=0, description="Price of one million completion tokens.")

    def cost(self, prompt_tokens: float, completion_tokens: float) -> float:
        return (
            prompt_tokens * self.input_per_million + completion_tokens * self.output_per_million
        ) / 1e6


class ChargebackSpec(ApiModel):
    """Chargeback policy and prices of one deployment (`servefleet usage`)."""

    idle: IdlePolicy = Field(
        default=IdlePolicy.PLATFORM,
        description="Who pays for warm replicas' idle time: platform (a row of its own) or "
        "shared (spread over tenants by their share of busy time).",
    )
    replica_hour: float | None = Field(
        default=None,
        gt=0,
        description="Price of one replica for one hour; unset: autoscaling.prices.replicaHour.",
    )
    hosted: HostedPrices | None = Field(
        default=None,
        description="The spill-over API's prices; unset: autoscaling.prices.spillPerMillionTokens "
        "for prompt and completion tokens alike.",
    )


class Prices(ApiModel):
    """The prices a report applies, resolved from `spec.chargeback` and `spec.autoscaling`."""

    replica_hour: float = Field(ge=0)
    hosted: HostedPrices

    @classmethod
    def resolve(cls, spec: ChargebackSpec | None, scaling: ScalingPrices | None) -> Prices:
        """Chargeback's own prices first, else the autoscaler's; a price found nowhere is a
        ValueError naming the field to set."""
        spec = spec or ChargebackSpec()
        replica_hour = spec.replica_hour or (scaling.replica_hour if scaling else None)
        if replica_hour is None:
            raise ValueError("set spec.chargeback.replicaHour or spec.autoscaling.prices")
        hosted = spec.hosted
        if hosted is None:
            if scaling is None:
                raise ValueError("set spec.chargeback.hosted or spec.autoscaling.prices")
            per = scaling.spill_per_million_tokens
            hosted = HostedPrices(input_per_million=per, output_per_million=per)
        return cls(replica_hour=replica_hour, hosted=hosted)
