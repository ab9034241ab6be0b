"""`spec.autoscaling.prices`: what a replica and the hosted API cost, for rent-or-buy.

With both prices the autoscaler weighs spill-over against starting replicas: a spike shorter
than a cold start is cheaper on the hosted API than on replicas that arrive too late. The
simulator (`servefleet sim`) prices its frontier with the same two numbers, so what it
recommends is what the running policy does.
"""

from __future__ import annotations

from pydantic import Field

from servefleet.api.api_model import ApiModel


class ScalingPrices(ApiModel):
    """Prices in one currency; only their ratio matters to the policy."""

    replica_hour: float = Field(gt=0, description="Price of one engine replica for one hour.")
    spill_per_million_tokens: float = Field(
        gt=0,
        description="Hosted-API price of one million spilled tokens (prompt + completion).",
    )
    spill_patience: float = Field(
        default=1.0,
        gt=0,
        le=1000,
        description="Times the least a replica would cost (cold start + scale-down delay) "
        "that spill-over may cost before replicas are bought: 1 is rent-or-buy, more keeps "
        "short bursts on the hosted API longer.",
    )
