"""One completion request on its way through the gateway, from parse to settle.

The handler fills in what the request asks for and where the pool placed it; forwarding and
relay fill in what it got (replica, usage, events, first byte, completion, a client that
left), which is what its reservation is settled with and what its outcome is decided from
(`call_outcome`: the metrics' and the access log's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from servefleet.gateway.asgi import Headers
from servefleet.gateway.proxy import Usage

if TYPE_CHECKING:
    from servefleet.gateway.pd_pool import PrefillLease, PrefillOverflow
    from servefleet.gateway.pool_types import Placement
    from servefleet.gateway.route_table import TenantRoute
    from servefleet.gateway.stream_splice import StreamSplice


@dataclass(slots=True)
class Call:
    route: TenantRoute
    path: str
    raw: bytes
    parsed: dict[str, Any]
    stream: bool
    wants_usage: bool
    prompt_tokens: int
    tokens: int  # prompt + completion budget: what was reserved and what the pool carries
    affinity_key: int | None
    started: float
    rl_headers: Headers
    used: Usage | None = None
    events: int = 0
    first_byte: bool = False
    placement: Placement | None = None  # what pool.acquire answered (or a Shed in its place)
    replica: str | None = None  # the endpoint that answered (after a retry, the second)
    ttft_s: float | None = None
    completed: bool = False  # the whole answer reached the client
    client_left: bool = False  # the client went away mid-answer
    splice: StreamSplice | None = None  # a stream that may be continued on another replica
    request_id: str = ""  # the gateway's id, sent upstream and named in its log lines
    timed_out: bool = False  # the last replica's answer stopped for `upstream_timeout_seconds`
    prefill: PrefillLease | None = None  # disaggregated P/D: the prefill replica (`pd`)
    prefill_overflow: PrefillOverflow | None = None  # P/D: no prefill replica had room
    block_hashes: tuple[int, ...] = ()  # the prompt's exact KV block hashes (routing by contents)
    cache_salt: str | None = None  # whose prefixes it may share (`servefleet.api.cache_salt`)

    def used_tokens(self, reserved: int) -> int:
        """Tokens to settle the reservation with."""
        return sum(self.used_split(reserved))

    def used_split(self, reserved: int) -> tuple[int, int]:
        """(prompt, completion) tokens to settle with (a cost budget prices them apart)."""
        if self.used is not None:
            return self.used.prompt_tokens, self.used.completion_tokens
        if not self.first_byte:
            return 0, 0  # nothing was served: give everything back
        # A stream that broke before its usage chunk: prompt plus one token per event.
        return self.prompt_tokens, max(0, min(reserved - self.prompt_tokens, self.events))
