"""`spec.autoscaling.prices`: rent-or-buy, on when set.

The autoscaler then weighs spill-over against starting replicas: a spike shorter than a cold
start is cheaper on the hosted API than on replicas that arrive too late. The prices it weighs
are the deployment's one definition of them, `spec.prices` (`prices_spec`); `replicaHour`
and `spillPerMillionTokens` here are deprecated spellings of those, mapped there. The
simulator (`servefleet sim`) prices its frontier with the same two numbers, so what it
recommends is what the running policy does.
"""

from __future__ import annotations

from pydantic import Field

from servefleet.api.api_model import ApiModel

RENT_OR_BUY_MESSAGE = (
    "spec.autoscaling.prices (rent-or-buy) weighs spec.prices: set spec.prices.replicaHour "
    "and spec.prices.hosted"
)


class ScalingPrices(ApiModel):
    """Rent-or-buy's knob; the prices it weighs (only their ratio matters) are spec.prices."""

    replica_hour: float | None = Field(
        default=None, gt=0, description="Deprecated: spec.prices.replicaHour (mapped there)."
    )
    spill_per_million_tokens: float | None = Field(
        default=None,
        gt=0,
        description="Deprecated: spec.prices.hosted (mapped there as the price of prompt and "
        "completion tokens alike).",
    )
    spill_patience: float = Field(
        default=1.0,
        gt=0,
        le=1000,
        description="Times the least a replica would cost (cold start + scale-down delay) "
        "that spill-over may cost before replicas are bought: 1 is rent-or-buy, more keeps "
        "short bursts on the hosted API longer.",
    )
