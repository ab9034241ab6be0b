"""The usage report: per tenant and period, what its traffic cost and would have cost.

Inputs are counter increases over the period (`UsageInputs`: engine busy seconds per tenant,
idle and replica seconds, the gateway's tokens and spilled tokens per tenant). The arithmetic:

- self-hosted cost = (busy + idle share) / 3600 x replica-hour price; idle share is 0 under the
  `platform` policy (idle is the platform's row) and idle x the tenant's share of busy time
  under `shared`;
- spilled cost = the hosted price table applied to the tenant's spilled tokens;
- all-hosted = the hosted price table applied to all its tokens (served here + spilled);
- all-self-hosted = its self-hosted cost plus its spilled tokens at the replicas' measured
  busy seconds per served token over the period (prompt and completion tokens alike).

Conservation error = |sum(busy) + idle - replica seconds| / replica seconds.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Mapping

from pydantic import BaseModel, Field

from servefleet.api.chargeback import IdlePolicy
from servefleet.api.chargeback_spec import Prices

PLATFORM_ROW = "_platform"
"""The row of idle time the platform pays for (policy `platform`)."""


class TenantTokens(BaseModel):
    prompt: float = 0.0
    completion: float = 0.0

    @property
    def total(self) -> float:
        return self.prompt + self.completion


class UsageInputs(BaseModel):
    """Counter increases over one period."""

    busy_seconds: dict[str, float] = Field(default_factory=dict)  # by tenant
    idle_seconds: float = 0.0
    replica_seconds: float = 0.0
    tokens: dict[str, TenantTokens] = Field(default_factory=dict)  # all the gateway answered
    spilled: dict[str, TenantTokens] = Field(default_factory=dict)  # of which the hosted API


class TenantUsage(BaseModel):
    tenant: str
    busy_seconds: float
    idle_share_seconds: float
    served_tokens: float
    spilled_prompt_tokens: float
    spilled_completion_tokens: float
    self_hosted_cost: float
    spilled_cost: float
    cost: float
    all_hosted_cost: float
    all_self_hosted_cost: float


class UsageReport(BaseModel):
    period_from: str
    period_to: str
    idle_policy: IdlePolicy
    replica_hour: float
    replica_seconds: float
    idle_seconds: float
    conservation_error: float
    tenants: list[TenantUsage]
    total_cost: float
    total_all_hosted_cost: float
    total_all_self_hosted_cost: float


def _served(tokens: TenantTokens | None, spilled: TenantTokens | None) -> float:
    total = tokens.total if tokens else 0.0
    return max(0.0, total - (spilled.total if spilled else 0.0))


def build_report(
    inputs: UsageInputs, prices: Prices, policy: IdlePolicy, period: tuple[str, str]
) -> UsageReport:
    busy_total = sum(inputs.busy_seconds.values())
    names = sorted({*inputs.busy_seconds, *inputs.tokens, *inputs.spilled})
    served_total = sum(_served(inputs.tokens.get(t), inputs.spilled.get(t)) for t in names)
    seconds_per_token = busy_total / served_total if served_total > 0 else 0.0
    per_second = prices.replica_hour / 3600
    rows = [
        _row(t, inputs, prices, policy, busy_total, seconds_per_token * per_second) for t in names
    ]
    if policy is IdlePolicy.PLATFORM or busy_total <= 0:
        idle_cost = inputs.idle_seconds * per_second
        rows.append(_platform_row(inputs.idle_seconds, idle_cost))
    replica = inputs.replica_seconds
    error = abs(busy_total + inputs.idle_seconds - replica) / replica if replica > 0 else 0.0
    return UsageReport(
        period_from=period[0],
        period_to=period[1],
        idle_policy=policy,
        replica_hour=prices.replica_hour,
        replica_seconds=replica,
        idle_seconds=inputs.idle_seconds,
        conservation_error=error,
        tenants=rows,
        total_cost=sum(r.cost for r in rows),
        total_all_hosted_cost=sum(r.all_hosted_cost for r in rows),
        total_all_self_hosted_cost=sum(r.all_self_hosted_cost for r in rows),
    )


def _row(
    tenant: str,
    inputs: UsageInputs,
    prices: Prices,
    policy: IdlePolicy,
    busy_total: float,
    self_cost_per_token: float,
) -> TenantUsage:
    busy = inputs.busy_seconds.get(tenant, 0.0)
    share = inputs.idle_seconds * busy / busy_total if policy is IdlePolicy.SHARED else 0.0
    if busy_total <= 0:
        share = 0.0
    tokens, spilled = inputs.tokens.get(tenant), inputs.spilled.get(tenant) or TenantTokens()
    served = _served(tokens, spilled)
    self_hosted = (busy + share) * prices.replica_hour / 3600
    spilled_cost = prices.hosted.cost(spilled.prompt, spilled.completion)
    all_tokens = tokens or TenantTokens()
    return TenantUsage(
        tenant=tenant,
        busy_seconds=busy,
        idle_share_seconds=share,
        served_tokens=served,
        spilled_prompt_tokens=spilled.prompt,
        spilled_completion_tokens=spilled.completion,
        self_hosted_cost=self_hosted,
        spilled_cost=spilled_cost,
        cost=self_hosted + spilled_cost,
        all_hosted_cost=prices.hosted.cost(
            max(all_tokens.prompt, spilled.prompt), max(all_tokens.completion, spilled.completion)
        ),
        all_self_hosted_cost=self_hosted + spilled.total * self_cost_per_token,
    )


def _platform_row(idle: float, cost: float) -> TenantUsage:
    return TenantUsage(
        tenant=PLATFORM_ROW,
        busy_seconds=0.0,
        idle_share_seconds=idle,
        served_tokens=0.0,
        spilled_prompt_tokens=0.0,
        spilled_completion_tokens=0.0,
        self_hosted_cost=cost,
        spilled_cost=0.0,
        cost=cost,
        all_hosted_cost=0.0,
        all_self_hosted_cost=cost,
    )


def to_csv(report: UsageReport) -> str:
    """One line per tenant (the platform's idle row included), the period on every line."""
    out = io.StringIO()
    fields = list(TenantUsage.model_fields)
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["period_from", "period_to", *fields])
    for row in report.tenants:
        values: Mapping[str, object] = row.model_dump()
        writer.writerow([report.period_from, report.period_to, *(values[f] for f in fields)])
    return out.getvalue()
