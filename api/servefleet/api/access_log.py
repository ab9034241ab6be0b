"""One line of the gateway's access log: a finished request, as one JSON object per line.

It lives in `api` because two sides read it: the gateway writes it (`servefleet gateway
--access-log FILE|-`), and the autoscaler simulator (`servefleet sim --trace FILE`) replays it,
so a platform team can ask what a policy would have cost on last week's traffic. Unknown fields
are ignored, so the log may grow. There is no field for a key: a line never holds one.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from servefleet.api.outcomes import Outcome, request_outcome
from servefleet.api.traffic import TrafficClass

_EARLIER_OUTCOMES: dict[str, Outcome | None] = {
    "served": Outcome.OK,
    "shed": Outcome.SHED,
    "limited": Outcome.LIMITED,
    "failed": None,
}
"""How logs written before `servefleet.api.outcomes` spelled an outcome."""


class AccessLogLine(BaseModel):
    """A request from arrival to its last byte; times are seconds."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    ts: float = Field(description="arrival at the gateway, Unix time")
    deployment: str = Field(min_length=1)
    model: str = ""
    adapter: str | None = Field(default=None, description="the LoRA adapter asked for")
    tenant: str = ""
    traffic_class: TrafficClass = "interactive"
    outcome: Outcome = Field(default=Outcome.OK, description="`servefleet.api.outcomes`")
    prompt_tokens: int = Field(default=0, ge=0)
    completion_tokens: int = Field(default=0, ge=0)
    queue_wait_s: float = Field(default=0.0, ge=0, description="arrival to leaving the queue")
    ttft_s: float | None = Field(default=None, ge=0, description="arrival to the first token")
    duration_s: float = Field(default=0.0, ge=0, description="arrival to the last token")
    status: int = Field(default=200, ge=100, le=599)
    replica: str | None = Field(default=None, description="the replica that answered")
    reason: str | None = Field(default=None, description="why it was spilled or shed")

    @model_validator(mode="before")
    @classmethod
    def _earlier_spelling(cls, data: Any) -> Any:
        """Last week's log still replays: an outcome in the earlier words is read as ours
        (`failed` reached the pool and did not complete; its status says how)."""
        outcome = data.get("outcome") if isinstance(data, dict) else None
        if not isinstance(outcome, str) or outcome not in _EARLIER_OUTCOMES:
            return data
        status = data.get("status", 200)
        ours = _EARLIER_OUTCOMES[outcome] or request_outcome(
            Outcome.OK, status if isinstance(status, int) else 200, completed=False
        )
        return {**data, "outcome": ours}

    @property
    def service_s(self) -> float:
        """Time the request held a replica slot (what the simulator replays)."""
        return max(0.0, self.duration_s - self.queue_wait_s)

    @property
    def offered_to_pool(self) -> bool:
        """False for requests the tenant's limits refused before any capacity was asked."""
        return self.outcome is not Outcome.LIMITED

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def dump_lines(lines: Iterable[AccessLogLine]) -> Iterator[str]:
    """One JSON object per line, no trailing newline on each (the writer adds it)."""
    for line in lines:
        yield line.model_dump_json(exclude_none=True)


def parse_lines(text_lines: Iterable[str]) -> Iterator[AccessLogLine]:
    """Every non-blank line as an `AccessLogLine`; a malformed line raises with its number."""
    for number, raw in enumerate(text_lines, start=1):
        if not raw.strip():
            continue
        try:
            yield AccessLogLine.model_validate_json(raw)
        except ValueError as exc:
            raise ValueError(f"access log line {number}: {exc}") from exc
