"""`POST /v1/chat/completions` and `/v1/completions`: one request's path, in order.

Auth (key → tenant) → parse and validate → count prompt tokens → reserve them against the
tenant's limits (429 with `x-ratelimit-*` when over) → `pool.acquire` → forward what it
answered (a lease on a replica, the hosted API, or a 503) → settle the reservation with what
was used. Each step's decision is made by its own module; this handler only calls them in turn.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from servefleet.gateway.asgi import Receive, Scope, Send, header, read_body, respond
from servefleet.gateway.call import Call
from servefleet.gateway.errors import (
    GatewayError,
    error_body,
    model_not_found,
    validation_error,
)
from servefleet.gateway.forward import Forwarder
from servefleet.gateway.limit_headers import ratelimit_headers, retry_headers
from servefleet.gateway.limits import Limiter, RequestTooLarge, Reservation
from servefleet.gateway.metrics import GatewayMetrics
from servefleet.gateway.pool import Lease, PoolRequest, Shed, Spill
from servefleet.gateway.protocol import ChatCompletionRequest, CompletionRequest
from servefleet.gateway.route_table import RouteTable, TenantRoute

OpenAIRequest = ChatCompletionRequest | CompletionRequest


class CompletionHandler:
    def __init__(
        self,
        limiter: Limiter,
        forwarder: Forwarder,
        metrics: GatewayMetrics,
        clock: Callable[[], float],
    ) -> None:
        self._limiter = limiter
        self._forwarder = forwarder
        self._metrics = metrics
        self._clock = clock

    async def handle(
        self, table: RouteTable, scope: Scope, receive: Receive, send: Send, *, chat: bool
    ) -> None:
        started = self._clock()
        tenant = table.keys.require_tenant(header(scope, b"authorization"))
        raw = await read_body(receive)
        parsed, request = _parse(raw, chat=chat)
        route = table.routes.get((tenant, request.model))
        if route is None:
            raise model_not_found(request.model)
        prompt_tokens, affinity_key = _count_prompt(route, request, parsed)
        max_tokens = (
            request.max_completion_tokens or request.max_tokens
            if isinstance(request, ChatCompletionRequest)
            else request.max_tokens
        )
        completion = max_tokens or route.pool.config.default_max_tokens
        call = Call(
            route,
            scope["path"],
            raw,
            parsed,
            request.stream,
            bool(request.stream_options and request.stream_options.include_usage),
            prompt_tokens,
            prompt_tokens + completion * request.n,
            affinity_key,
            started,
            [],
        )
        reservation: Reservation | None = None
        if route.scopes:
            admitted, reservation = await self._reserve(call, send)
            if not admitted:
                return
        try:
            await self._serve(call, send, receive)
        finally:
            if reservation is not None:
                await self._limiter.settle(reservation, call.used_tokens(reservation.tokens))

    async def _reserve(self, call: Call, send: Send) -> tuple[bool, Reservation | None]:
        """Reserve the call's tokens and a request; False when a 429 was sent instead."""
        route = call.route
        try:
            decision = await self._limiter.reserve(route.scopes, call.tokens)
        except RequestTooLarge as exc:
            route.metrics.outcome["4xx"].inc()
            raise GatewayError(
                400,
                str(exc),
                code="request_too_large",
                param="max_tokens",
                headers={"x-should-retry": "false"},
            ) from None
        call.rl_headers = ratelimit_headers(decision.snapshot)
        if decision.admitted:
            return True, decision.reservation
        route.metrics.outcome["429"].inc()
        kind = "requests" if decision.exceeded == "requests_per_minute" else "tokens"
        await respond(
            send,
            429,
            error_body(
                f"Rate limit reached for tenant {route.tenant} on {decision.exceeded}; "
                f"try again in {decision.retry_after_s:.1f}s.",
                kind,
                "rate_limit_exceeded",
            ),
            headers=call.rl_headers + retry_headers(decision.retry_after_s),
        )
        return False, None

    async def _serve(self, call: Call, send: Send, receive: Receive) -> None:
        route = call.route
        pool = route.pool
        placed = await pool.acquire(
            PoolRequest(
                route.tenant, route.traffic_class, route.weight, call.tokens, call.affinity_key
            )
        )
        if isinstance(placed, Lease):
            route.metrics.queue_wait.observe(placed.queue_wait_s)
            await self._forwarder.to_pool(call, placed, send, receive)
        elif isinstance(placed, Spill):
            self._metrics.spillovers.labels(pool.model, placed.reason).inc()
            await self._forwarder.to_spill(call, send, receive)
        else:
            route.metrics.outcome["503"].inc()
            await _shed(call, placed, send)


def _parse(raw: bytes, *, chat: bool) -> tuple[dict[str, Any], OpenAIRequest]:
    try:
        parsed = json.loads(raw)
    except ValueError:
        raise GatewayError(400, "We could not parse the JSON body of your request.") from None
    if not isinstance(parsed, dict):
        raise GatewayError(400, "The request body must be a JSON object.")
    try:
        if chat:
            return parsed, ChatCompletionRequest.model_validate(parsed)
        return parsed, CompletionRequest.model_validate(parsed)
    except ValidationError as exc:
        raise validation_error(exc) from None


def _count_prompt(
    route: TenantRoute, request: OpenAIRequest, parsed: dict[str, Any]
) -> tuple[int, int | None]:
    """(prompt tokens, affinity key): exact with the model's tokenizer, else estimated."""
    counter = route.pool.token_counter
    exact: int | None = None
    if isinstance(request, ChatCompletionRequest):
        shape = route.reader.chat(parsed["messages"])
        if counter is not None:
            exact = counter.chat(parsed["messages"])
    else:
        shape = route.reader.completion(request.prompt)
        if counter is not None:
            exact = counter.completion(request.prompt)
    return (shape.estimated_tokens if exact is None else exact), shape.affinity_key


async def _shed(call: Call, shed: Shed, send: Send) -> None:
    await respond(
        send,
        503,
        error_body(
            f"The model `{call.route.pool.model}` is overloaded ({shed.reason}); "
            f"retry in {shed.retry_after_s:.1f}s.",
            "server_overloaded",
            "overloaded",
        ),
        headers=call.rl_headers + retry_headers(shed.retry_after_s),
    )
