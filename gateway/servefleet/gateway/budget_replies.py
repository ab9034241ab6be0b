"""What a client and Prometheus are told about budgets: the warning headers (from 80 % used),
the 429 `insufficient_quota` of an exhausted budget, the 503 while budgets cannot be checked,
and the used-ratio gauge. Names and the threshold come from `servefleet.api.budgets`."""

from __future__ import annotations

from servefleet.api.budgets import INSUFFICIENT_QUOTA, MICRO_USD_PER_USD, budget_header
from servefleet.api.openai_errors import error_bytes
from servefleet.gateway.asgi import Headers
from servefleet.gateway.budgets import BudgetLevel, iso_utc, tightest
from servefleet.gateway.limits import LimitDecision
from servefleet.gateway.metrics import GatewayMetrics


def _amount(level: BudgetLevel, value: int) -> str:
    if level.budget.unit == "tokens":
        return str(value)
    return f"{value / MICRO_USD_PER_USD:.6f}".rstrip("0").rstrip(".")


def budget_headers(decision: LimitDecision) -> Headers:
    """Per budget at or over the warning ratio: remaining (tokens or USD), used ratio, reset."""
    headers: Headers = []
    for _, level in sorted(tightest(decision.budgets).items()):
        if not level.warn and not level.exhausted:
            continue
        headers += [
            (budget_header(level.budget.period, level.budget.unit, "remaining").encode(),
             _amount(level, level.remaining).encode()),
            (budget_header(level.budget.period, level.budget.unit, "used-ratio").encode(),
             f"{min(level.ratio, 1.0):.3f}".encode()),
            (budget_header(level.budget.period, level.budget.unit, "reset").encode(),
             iso_utc(level.charge.resets_at).encode()),
        ]  # fmt: skip
    return headers


def record_budgets(metrics: GatewayMetrics, tenant: str, decision: LimitDecision) -> None:
    label = metrics.tenant_label(tenant)
    for (period, unit), level in tightest(decision.budgets).items():
        metrics.budget_used_ratio.labels(label, period, unit).set(level.ratio)


def exhausted_body(tenant: str, level: BudgetLevel) -> bytes:
    """OpenAI's 429 for a spent quota, naming the budget and when it resets."""
    return error_bytes(
        message=f"Tenant {tenant} has used its {level.budget.describe()} "
        f"({_amount(level, level.used)} used, this request needs "
        f"{_amount(level, level.charge.amount)}); it resets at "
        f"{iso_utc(level.charge.resets_at)}.",
        type=INSUFFICIENT_QUOTA,
        code=INSUFFICIENT_QUOTA,
    )


def unavailable_body(tenant: str, retry_after_s: float) -> bytes:
    """503 while the shared budget counters cannot be reached (not the tenant's fault)."""
    return error_bytes(
        message=f"The budgets of tenant {tenant} cannot be checked right now; "
        f"retry in {retry_after_s:.1f}s.",
        type="server_error",
        code="budget_unavailable",
    )
