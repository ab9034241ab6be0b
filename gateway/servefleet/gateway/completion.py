"""The forwarded OpenAI endpoints (`endpoints.ENDPOINTS`: completions, chat, embeddings,
tokenize, detokenize): one request's path, in order.

Auth (key → tenant) → parse and validate (the engine's own request models) → count prompt
tokens → reserve them against the tenant's limits (429 with `x-ratelimit-*` when over) →
`pool.acquire` → forward what it answered (a lease on a replica, the hosted API, or a 503) →
settle the reservation with what was used. Each step's decision is made by its own module;
this handler only calls them in turn, and `call_outcome` counts and logs what became of the
request when it ends.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import replace

from servefleet.api.openai_errors import OpenAIError, error_bytes
from servefleet.gateway.access_log import AccessLog
from servefleet.gateway.asgi import Receive, Scope, Send, header, read_body, respond
from servefleet.gateway.batch_calls import TRAFFIC_CLASS, TRUSTED_TENANT
from servefleet.gateway.budget_replies import (
    budget_headers,
    exhausted_body,
    record_budgets,
    unavailable_body,
)
from servefleet.gateway.budgets import Spend
from servefleet.gateway.call import Call
from servefleet.gateway.call_outcome import recorded
from servefleet.gateway.client_watch import ClientGone, unless_client_leaves
from servefleet.gateway.endpoints import (
    ENDPOINTS,
    Endpoint,
    cache_salt_for,
    count_prompt,
    parse,
    reserved_tokens,
    route_for,
    shape_of,
)
from servefleet.gateway.forward import Forwarder
from servefleet.gateway.limit_headers import ratelimit_headers, retry_headers
from servefleet.gateway.limits import Limiter, RequestTooLarge, Reservation
from servefleet.gateway.metrics import GatewayMetrics
from servefleet.gateway.pool import Lease, PoolRequest, Shed, Spill
from servefleet.gateway.queueing import TrafficClass
from servefleet.gateway.retry_promises import retry_key
from servefleet.gateway.route_table import RouteTable


class CompletionHandler:
    def __init__(
        self,
        limiter: Limiter,
        forwarder: Forwarder,
        metrics: GatewayMetrics,
        clock: Callable[[], float],
        access_log: AccessLog | None = None,
    ) -> None:
        self._limiter = limiter
        self._forwarder = forwarder
        self._metrics = metrics
        self._clock = clock
        self._access_log = access_log

    async def handle(
        self, table: RouteTable, scope: Scope, receive: Receive, send: Send, endpoint: Endpoint
    ) -> None:
        started = self._clock()
        request_id = "req-" + secrets.token_hex(8)
        trusted = scope.get(TRUSTED_TENANT)  # a batch line (`batch_calls`): set in-process only
        if isinstance(trusted, str):
            tenant = trusted
        else:
            tenant = table.keys.require_tenant(header(scope, b"authorization"))
        raw = await read_body(receive)
        parsed, request = parse(raw, endpoint)
        route = route_for(table, tenant, request)
        if scope.get(TRAFFIC_CLASS) == "batch":
            route = replace(route, traffic_class=TrafficClass.BATCH)
        salt = cache_salt_for(route, parsed)
        counted = await count_prompt(route, request, parsed, salt)
        prompt_tokens, affinity_key = counted.tokens, counted.affinity_key
        shape = shape_of(request)
        call = Call(
            route,
            scope["path"],
            raw,
            parsed,
            shape.stream,
            shape.wants_usage,
            prompt_tokens,
            reserved_tokens(route, shape, prompt_tokens),
            affinity_key,
            started,
            [],
            request_id=request_id,
            block_hashes=counted.block_hashes,
            cache_salt=salt,
        )
        reservation: Reservation | None = None
        try:
            with recorded(call, send, self._access_log) as send:
                if route.scopes:
                    admitted, reservation = await self._reserve(call, send)
                    if not admitted:
                        return
                await self._serve(call, send, receive)
        finally:  # after the outcome is counted: settling may wait for Redis
            if reservation is not None:
                used = Spend.priced(call.route.prices, *call.used_split(reservation.tokens))
                await self._limiter.settle(reservation, used.tokens, used.micro_usd)

    async def _reserve(self, call: Call, send: Send) -> tuple[bool, Reservation | None]:
        """Reserve the call's tokens and a request; False when a 429 or 503 was sent."""
        route = call.route
        asked = Spend.priced(route.prices, call.prompt_tokens, call.tokens - call.prompt_tokens)
        try:
            decision = await self._limiter.reserve(route.scopes, call.tokens, asked.micro_usd)
        except RequestTooLarge as exc:
            raise OpenAIError(
                status=400,
                message=str(exc),
                code="request_too_large",
                param="max_tokens",
                headers={"x-should-retry": "false"},
            ) from None
        call.rl_headers = ratelimit_headers(decision.snapshot) + budget_headers(decision)
        record_budgets(self._metrics, route.tenant, decision)
        if decision.admitted:
            return True, decision.reservation
        exhausted = decision.exhausted
        if exhausted is not None or decision.exceeded == "budget_unavailable":
            status, body = (
                (429, exhausted_body(route.tenant, exhausted))
                if exhausted is not None
                else (503, unavailable_body(route.tenant, decision.retry_after_s))
            )
            headers = call.rl_headers + retry_headers(decision.retry_after_s)
            await respond(send, status, body, headers=headers)
            return False, None
        kind = "requests" if decision.exceeded == "requests_per_minute" else "tokens"
        await respond(
            send,
            429,
            error_bytes(
                message=f"Rate limit reached for tenant {route.tenant} on {decision.exceeded}; "
                f"try again in {decision.retry_after_s:.1f}s.",
                type=kind,
                code="rate_limit_exceeded",
            ),
            headers=call.rl_headers + retry_headers(decision.retry_after_s),
        )
        return False, None

    async def _serve(self, call: Call, send: Send, receive: Receive) -> None:
        route = call.route
        pool = route.pool
        request = PoolRequest(
            route.tenant,
            route.traffic_class,
            route.weight,
            call.tokens,
            call.affinity_key,
            retry_key(route.tenant, call.raw),
            route.adapter.name if route.adapter is not None else None,
            call.block_hashes,
        )
        try:  # a client that leaves while queued gives its place back
            placed = await unless_client_leaves(pool.acquire(request), receive)
        except ClientGone:
            return
        call.placement = placed
        if isinstance(placed, Lease):
            route.metrics.queue_wait.observe(placed.queue_wait_s)
            await self._forwarder.to_pool(call, placed, send, receive)
        elif isinstance(placed, Spill) and not ENDPOINTS[call.path].spillable:
            shed = call.placement = Shed(pool.cold_start.value, placed.reason)
            await _shed(call, shed, send)
        elif isinstance(placed, Spill):
            self._metrics.spillovers.labels(pool.model, placed.reason).inc()
            await self._forwarder.to_spill(call, send, receive)
        else:
            await _shed(call, placed, send)


async def _shed(call: Call, shed: Shed, send: Send) -> None:
    await respond(
        send,
        503,
        error_bytes(
            message=f"The model `{call.route.pool.model}` is overloaded ({shed.reason}); "
            f"retry in {shed.retry_after_s:.1f}s.",
            type="server_overloaded",
            code="overloaded",
        ),
        headers=call.rl_headers + retry_headers(shed.retry_after_s),
    )
