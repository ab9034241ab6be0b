"""Chargeback: how an engine's wall time is split among the tenants that used it.

The rule (one place, so the engine, the report and the tests agree):

- Every engine step's wall time goes to the sequences in it, in proportion to their *weighted
  rows*: a decode row (one sampled position, speculative proposals included) weighs 1, a
  prompt token weighs `prompt_weight` = measured seconds per prompt token / measured seconds
  per decode row (`StepCostModel`: EWMAs over steps that are all prompt or all decode; 1
  until both have been seen). The shares of a step always add up to the step's time, so the
  weight moves time between tenants, never in or out.
- Everything else the engine's loop spends (waiting for work, draining its inbox, calls run
  between steps) is *idle*. busy + idle is therefore the loop's whole life, which the engine
  exports separately as replica seconds: conservation is checked, not assumed.
- A sequence is billed to the tenant the gateway stamped on its request (`TENANT_HEADER`),
  honoured only by an engine that requires its key (no one else can send it);
  anything else is `UNATTRIBUTED`. Per (tenant, model) series are capped
  (`TENANT_SERIES_LIMIT`); later tenants share `OTHER_TENANT`.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from servefleet.api.ewma import Ewma

TENANT_HEADER = "x-servefleet-tenant"
"""Request header from the gateway to its engines: the route-scoped tenant (`namespace/name`)."""
MAX_TENANT_CHARS = 128
UNATTRIBUTED = "_unattributed"
OTHER_TENANT = "_other"
TENANT_SERIES_LIMIT = 64

# Prometheus families (counters: the client adds `_total`); labels below.
ENGINE_BUSY_SECONDS = "servefleet_engine_busy_seconds"
ENGINE_IDLE_SECONDS = "servefleet_engine_idle_seconds"
ENGINE_REPLICA_SECONDS = "servefleet_engine_replica_seconds"
ENGINE_ATTRIBUTED_TOKENS = "servefleet_engine_attributed_tokens"
GATEWAY_SPILLED_TOKENS = "servefleet_gateway_spilled_tokens"
GATEWAY_PROMPT_TOKENS = "servefleet_gateway_prompt_tokens"  # all answered, spilled included
GATEWAY_COMPLETION_TOKENS = "servefleet_gateway_completion_tokens"
TENANT_LABEL = "tenant"
MODEL_LABEL = "model"
KIND_LABEL = "kind"  # of tokens: "prompt" or "completion"
PROMPT, COMPLETION = "prompt", "completion"


class IdlePolicy(enum.StrEnum):
    """Who pays for a warm replica's idle time."""

    PLATFORM = "platform"  # the platform team: tenants pay only for what they used
    SHARED = "shared"  # spread over tenants by their share of busy time


@dataclass(frozen=True, slots=True)
class StepShare:
    """What one sequence did in a step."""

    tenant: str
    model: str
    prompt_tokens: int = 0
    decode_rows: int = 0


def split_step(
    seconds: float, shares: Sequence[StepShare], prompt_weight: float
) -> dict[tuple[str, str], float]:
    """The step's seconds per (tenant, model), in proportion to weighted rows; they add up to
    `seconds` (a step with no rows at all is split evenly)."""
    weights = [s.prompt_tokens * prompt_weight + s.decode_rows for s in shares]
    total = sum(weights)
    out: dict[tuple[str, str], float] = {}
    for share, weight in zip(shares, weights, strict=True):
        part = seconds * (weight / total if total > 0 else 1 / len(shares))
        key = (share.tenant, share.model)
        out[key] = out.get(key, 0.0) + part
    return out


class StepCostModel:
    """Measured seconds per prompt token and per decode row (steps that are one kind only)."""

    def __init__(self, alpha: float = 0.1) -> None:
        self.per_prompt_token = Ewma(0.0, alpha)
        self.per_decode_row = Ewma(0.0, alpha)

    def observe(self, seconds: float, prompt_tokens: int, decode_rows: int) -> None:
        if prompt_tokens and not decode_rows:
            self.per_prompt_token.update(seconds / prompt_tokens)
        elif decode_rows and not prompt_tokens:
            self.per_decode_row.update(seconds / decode_rows)

    @property
    def prompt_weight(self) -> float:
        prompt, decode = self.per_prompt_token.value, self.per_decode_row.value
        return prompt / decode if prompt > 0 and decode > 0 else 1.0


def tenant_label(stamped: str | None, trusted: bool) -> str:
    """The tenant a request is billed to: the gateway's stamp, only where it is trusted."""
    if not trusted or not stamped or len(stamped) > MAX_TENANT_CHARS or not stamped.isprintable():
        return UNATTRIBUTED
    return stamped


class LabelCap:
    """Admits at most `limit` distinct tenants as labels; the rest become OTHER_TENANT."""

    def __init__(self, limit: int = TENANT_SERIES_LIMIT, fixed: Iterable[str] = ()) -> None:
        self.limit = limit
        self._seen: set[str] = set(fixed)
        self._fixed = len(self._seen)

    def __call__(self, tenant: str) -> str:
        if tenant in self._seen:
            return tenant
        if len(self._seen) - self._fixed >= self.limit:
            return OTHER_TENANT
        self._seen.add(tenant)
        return tenant
