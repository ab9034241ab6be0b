"""One line of the gateway's access log: a finished request, as one JSON object per line.

It lives in `api` because two sides read it: the gateway writes it (`servefleet gateway
--access-log FILE|-`), and the autoscaler simulator (`servefleet sim --trace FILE`) replays it,
so a platform team can ask what a policy would have cost on last week's traffic. Unknown fields
are ignored, so the log may grow. There is no field for a key: a line never holds one.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from servefleet.api.traffic import TrafficClass

Outcome = Literal["served", "spilled", "shed", "limited", "failed"]
"""served: by a replica; spilled: by the hosted API; shed: 503 by admission; limited: 429 by
the tenant's limits (never reached the pool); failed: anything else (4xx, upstream errors)."""


class AccessLogLine(BaseModel):
    """A request from arrival to its last byte; times are seconds."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    ts: float = Field(description="arrival at the gateway, Unix time")
    deployment: str = Field(min_length=1)
    model: str = ""
    tenant: str = ""
    traffic_class: TrafficClass = "interactive"
    outcome: Outcome = "served"
    prompt_tokens: int = Field(default=0, ge=0)
    completion_tokens: int = Field(default=0, ge=0)
    queue_wait_s: float = Field(default=0.0, ge=0, description="arrival to leaving the queue")
    ttft_s: float | None = Field(default=None, ge=0, description="arrival to the first token")
    duration_s: float = Field(default=0.0, ge=0, description="arrival to the last token")
    status: int = Field(default=200, ge=100, le=599)
    replica: str | None = Field(default=None, description="the replica that answered")
    reason: str | None = Field(default=None, description="why it was spilled or shed")

    @property
    def service_s(self) -> float:
        """Time the request held a replica slot (what the simulator replays)."""
        return max(0.0, self.duration_s - self.queue_wait_s)

    @property
    def offered_to_pool(self) -> bool:
        """False for requests the tenant's limits refused before any capacity was asked."""
        return self.outcome != "limited"

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
