"""`spec.chargeback`: who pays for idle replicas; the prices the usage report applies are the
deployment's one definition of them, `spec.prices` (`prices_spec`). `replicaHour` and `hosted`
here are deprecated spellings of those, mapped there.
"""

from __future__ import annotations

from pydantic import Field

from servefleet.api.api_model import ApiModel
from servefleet.api.chargeback import IdlePolicy
from servefleet.api.prices_spec import HostedPrices, PricesSpec

__all__ = ["ChargebackSpec", "HostedPrices", "Prices"]


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
        description="Deprecated: spec.prices.replicaHour (mapped there).",
    )
    hosted: HostedPrices | None = Field(
        default=None, description="Deprecated: spec.prices.hosted (mapped there)."
    )


class Prices(ApiModel):
    """The prices a report applies: `spec.prices`, both of them."""

    replica_hour: float = Field(ge=0)
    hosted: HostedPrices

    @classmethod
    def resolve(cls, prices: PricesSpec | None) -> Prices:
        """Both prices of `spec.prices` (the deprecated fields already mapped there by the
        spec); one missing is a ValueError naming the field to set."""
        if prices is None or prices.replica_hour is None:
            raise ValueError("set spec.prices.replicaHour (the report prices replica time)")
        if prices.hosted is None:
            raise ValueError("set spec.prices.hosted (the report prices spilled tokens)")
        return cls(replica_hour=prices.replica_hour, hosted=prices.hosted)
