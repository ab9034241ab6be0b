"""`spec.prices`: what this deployment's capacity costs — one replica for an hour, and the
hosted API its requests spill to, per million prompt and completion tokens. One definition,
read by every component that prices something: the autoscaler's rent-or-buy
(`spec.autoscaling.prices` turns it on), the usage report (`spec.chargeback`), `servefleet
usage`.

Not the same fact as `spec.tokenPrices`: that is what a tenant is charged per token of this
deployment (USD, the unit of cost budgets, set by the team for its tenants), whatever serving
it costs; these are what serving costs the platform (any one currency).

The fields these prices were first written in — `spec.autoscaling.prices.replicaHour` and
`.spillPerMillionTokens`, `spec.chargeback.replicaHour` and `.hosted` — are deprecated: still
accepted and mapped here (one blended `spillPerMillionTokens` is the same price for prompt and
completion tokens), refused when they give one price two values.
"""

from __future__ import annotations

import logging
from typing import TypeVar

from pydantic import Field

from servefleet.api.api_model import ApiModel

log = logging.getLogger("servefleet.api")
T = TypeVar("T")
_WARNED: set[str] = set()


class HostedPrices(ApiModel):
    """The hosted API's price table (what spilled tokens cost), per million tokens."""

    input_per_million: float = Field(ge=0, description="Price of one million prompt tokens.")
    output_per_million: float = Field(ge=0, description="Price of one million completion tokens.")

    def cost(self, prompt_tokens: float, completion_tokens: float) -> float:
        return (
            prompt_tokens * self.input_per_million + completion_tokens * self.output_per_million
        ) / 1e6

    def per_million_tokens(self) -> float:
        """One price for a token of either kind (the autoscaler counts spilled tokens, not
        their kind): the mean of the two, the exact price when they are equal."""
        return (self.input_per_million + self.output_per_million) / 2


class PricesSpec(ApiModel):
    """Prices in one currency of one deployment's replicas and of its hosted API."""

    replica_hour: float | None = Field(
        default=None, gt=0, description="Price of one engine replica for one hour."
    )
    hosted: HostedPrices | None = Field(
        default=None, description="The hosted (spill-over) API's prices per million tokens."
    )


def merged(
    prices: PricesSpec | None, deprecated: list[tuple[str, float | HostedPrices | None]]
) -> PricesSpec | None:
    """`spec.prices` with what the deprecated fields (`(path, value)`: a replica-hour price
    or a hosted table) say filled in; a ValueError naming both fields when one price is given
    two values."""
    hour = ("spec.prices.replicaHour", prices.replica_hour) if prices else None
    hosted = ("spec.prices.hosted", prices.hosted) if prices else None
    for path, value in deprecated:
        if isinstance(value, HostedPrices):
            hosted = _once(hosted, path, value, "hosted")
        elif value is not None:
            hour = _once(hour, path, value, "replicaHour")
    if (hour is None or hour[1] is None) and (hosted is None or hosted[1] is None):
        return None
    return PricesSpec(replica_hour=hour[1] if hour else None, hosted=hosted[1] if hosted else None)


def _once(
    known: tuple[str, T | None] | None, path: str, value: T, name: str
) -> tuple[str, T | None]:
    if path not in _WARNED:  # once a process: specs are validated again and again
        _WARNED.add(path)
        log.warning("%s is deprecated: set spec.prices.%s", path, name)
    if known is None or known[1] is None:
        return path, value
    if known[1] != value:
        raise ValueError(
            f"{path} and {known[0]} give one price two values: set spec.prices.{name} only"
        )
    return known
