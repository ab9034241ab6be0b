"""Tenant budgets inside the limiter: UTC calendar periods, what a request is charged in each
budget's unit, and the levels the gateway reports (headers, gauge, 429).

A budget's counter is named by its period (`d20419`: days since the epoch; `m2026-11`: the
calendar month), so a new period starts from zero without anything being reset, and the old
counter expires a day after its period ends. The period is taken from the gateway's clock.
"""

from __future__ import annotations

import calendar
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from servefleet.api.budgets import (
    BUDGET_WARN_RATIO,
    MICRO_USD_PER_USD,
    BudgetPeriod,
    BudgetUnit,
    TokenPrices,
)
from servefleet.api.traffic import TenantLimits

SECONDS_PER_DAY = 86400


@dataclass(frozen=True, slots=True)
class Budget:
    """One cap: `limit` tokens, or `limit` micro-USD, per UTC day or month."""

    period: BudgetPeriod
    unit: BudgetUnit
    limit: int

    def describe(self) -> str:
        if self.unit == "tokens":
            return f"{self.period} token budget of {self.limit} tokens"
        return f"{self.period} cost budget of {self.limit / MICRO_USD_PER_USD:.2f} USD"


def budgets_of(limits: TenantLimits) -> tuple[Budget, ...]:
    """The budgets a spec's limits ask for (cost converted to micro-USD)."""

    def usd(value: float) -> int:
        return max(1, round(value * MICRO_USD_PER_USD))

    made: list[Budget] = []
    if limits.daily_token_budget is not None:
        made.append(Budget("daily", "tokens", limits.daily_token_budget))
    if limits.monthly_token_budget is not None:
        made.append(Budget("monthly", "tokens", limits.monthly_token_budget))
    if limits.daily_cost_budget_usd is not None:
        made.append(Budget("daily", "cost", usd(limits.daily_cost_budget_usd)))
    if limits.monthly_cost_budget_usd is not None:
        made.append(Budget("monthly", "cost", usd(limits.monthly_cost_budget_usd)))
    return tuple(made)


@dataclass(frozen=True, slots=True)
class Spend:
    """A request's tokens and their cost (micro-USD; 0 where the model has no prices)."""

    tokens: int
    micro_usd: int = 0

    def of(self, unit: BudgetUnit) -> int:
        return self.tokens if unit == "tokens" else self.micro_usd

    @staticmethod
    def priced(prices: TokenPrices | None, prompt_tokens: int, completion_tokens: int) -> Spend:
        cost = 0 if prices is None else prices.micro_usd(prompt_tokens, completion_tokens)
        return Spend(prompt_tokens + completion_tokens, cost)


def period_id(period: BudgetPeriod, wall: float) -> str:
    if period == "daily":
        return f"d{int(wall // SECONDS_PER_DAY)}"
    when = datetime.fromtimestamp(wall, UTC)
    return f"m{when.year:04d}-{when.month:02d}"


def period_end(period: BudgetPeriod, wall: float) -> float:
    """The epoch second the current period ends (the next budget starts)."""
    if period == "daily":
        return (int(wall // SECONDS_PER_DAY) + 1) * SECONDS_PER_DAY
    when = datetime.fromtimestamp(wall, UTC)
    year, month = (when.year + 1, 1) if when.month == 12 else (when.year, when.month + 1)
    return float(calendar.timegm((year, month, 1, 0, 0, 0)))


def iso_utc(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True, slots=True)
class BudgetCharge:
    """What one reservation takes from one budget of one scope in the current period."""

    scope_key: str
    budget: Budget
    period: str  # `period_id`
    amount: int
    resets_at: float  # epoch seconds

    @property
    def name(self) -> str:
        """The counter's name under its scope (Redis key suffix, local dict key)."""
        return f"budget:{self.budget.period}:{self.budget.unit}:{self.period}"


def charges_for(
    scopes: Iterable[tuple[str, Sequence[Budget]]], spend: Spend, wall: float
) -> tuple[BudgetCharge, ...]:
    return tuple(
        BudgetCharge(
            key,
            budget,
            period_id(budget.period, wall),
            spend.of(budget.unit),
            period_end(budget.period, wall),
        )
        for key, budgets in scopes
        for budget in budgets
    )


@dataclass(frozen=True, slots=True)
class BudgetLevel:
    """A budget's use as the reservation left it (or, refused, as it was)."""

    charge: BudgetCharge
    used: int
    charged: bool = False  # `used` includes this reservation's charge (it was admitted)

    @property
    def budget(self) -> Budget:
        return self.charge.budget

    @property
    def ratio(self) -> float:
        return self.used / self.budget.limit

    @property
    def remaining(self) -> int:
        return max(0, self.budget.limit - self.used)

    @property
    def exhausted(self) -> bool:
        """This reservation does not fit."""
        return not self.charged and self.used + self.charge.amount > self.budget.limit

    @property
    def warn(self) -> bool:
        return self.ratio >= BUDGET_WARN_RATIO


def tightest(levels: Iterable[BudgetLevel]) -> dict[tuple[str, str], BudgetLevel]:
    """Per (period, unit), the level of the scope that has used the most of its budget."""
    out: dict[tuple[str, str], BudgetLevel] = {}
    for level in levels:
        key = (level.budget.period, level.budget.unit)
        if key not in out or level.ratio > out[key].ratio:
            out[key] = level
    return out
