"""Tenant budgets: what a period and a unit mean, what a token costs, and what the gateway
tells a client about them (headers, error code, metric) — defined once for every component.

A budget is a cap on a tenant's spend per UTC calendar period: `daily` (00:00 UTC to 00:00
UTC) or `monthly` (the 1st 00:00 UTC to the next 1st), in `tokens` (prompt + completion) or in
`cost` (USD, from the deployment's `tokenPrices`). Costs are counted in whole micro-USD
(rounded up per request) so that every counter is an integer. `tokenPrices` is what a tenant
is charged, set by the team for its tenants; what serving costs the platform (a replica-hour,
the hosted API's tokens) is another fact, `spec.prices` (`prices_spec`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from servefleet.api.api_model import ApiModel

BudgetPeriod = Literal["daily", "monthly"]
BudgetUnit = Literal["tokens", "cost"]
BUDGET_PERIODS: tuple[BudgetPeriod, ...] = ("daily", "monthly")
BUDGET_UNITS: tuple[BudgetUnit, ...] = ("tokens", "cost")

MICRO_USD_PER_USD = 1_000_000
# A budget is reported (headers, alert) once this share of it is used.
BUDGET_WARN_RATIO = 0.8

# OpenAI's code and type for "you have run out of quota" (429).
INSUFFICIENT_QUOTA = "insufficient_quota"

# The gauge of how much of each budget is used (labels: tenant, period, unit).
BUDGET_USED_RATIO_METRIC = "servefleet_gateway_budget_used_ratio"


# A cost budget is priced by its deployment's `tokenPrices` (pydantic and CEL alike).
COST_BUDGET_MESSAGE = "a tenant with a cost budget needs spec.tokenPrices"
_NO_COST = "(!has({0}) || (!has({0}.dailyCostBudgetUSD) && !has({0}.monthlyCostBudgetUSD)))"
COST_BUDGET_CEL = (
    "has(self.tokenPrices) || !has(self.tenants) || self.tenants.all(t, "
    + _NO_COST.format("t.limits")
    + " && "
    + _NO_COST.format("t.modelLimits")
    + ")"
)


def budget_header(period: BudgetPeriod, unit: BudgetUnit, what: str) -> str:
    """`x-servefleet-budget-<period>-<unit>-<what>`; `what` is remaining, used-ratio, reset."""
    return f"x-servefleet-budget-{period}-{unit}-{what}"


class TokenPrices(ApiModel):
    """What one million tokens of this deployment's model cost, for cost budgets."""

    input_per_million_usd: float = Field(
        alias="inputPerMillionUSD",
        ge=0,
        le=1_000_000,
        description="USD per one million prompt tokens.",
    )
    output_per_million_usd: float = Field(
        alias="outputPerMillionUSD",
        ge=0,
        le=1_000_000,
        description="USD per one million completion tokens.",
    )

    def micro_usd(self, prompt_tokens: int, completion_tokens: int) -> int:
        """The cost of a request in whole micro-USD, rounded up (1 USD per 1M tokens is one
        micro-USD per token)."""
        exact = (
            prompt_tokens * self.input_per_million_usd
            + completion_tokens * self.output_per_million_usd
        )
        whole = int(exact)
        return whole if whole >= exact - 1e-9 else whole + 1
