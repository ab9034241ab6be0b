"""The OpenAI endpoints a tenant may call through the gateway, and what each one costs.

Every forwarded path is validated with the engine's own request models
(`servefleet.api.openai_requests`), so both answer an unknown or refused field with the same
400, and the body then goes upstream unchanged. Per endpoint: whether the hosted API can serve
it on spill-over, and which tokens it is charged (generation: prompt + completion; embeddings:
prompt only; tokenize/detokenize: none, only the request).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from servefleet.api.openai_requests import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    SamplingRequest,
)
from servefleet.api.openai_wire import RequestRejected, parse_request
from servefleet.api.openapi_doc import OPERATIONS
from servefleet.api.stream_resume import internal_fields_in
from servefleet.gateway.errors import GatewayError, model_not_found
from servefleet.gateway.route_table import RouteTable, TenantRoute


@dataclass(frozen=True, slots=True)
class Endpoint:
    path: str
    spillable: bool  # the hosted API serves this path too
    counts_prompt: bool  # the prompt's tokens are charged

    @property
    def request_model(self) -> type[BaseModel]:
        """The body model the engine and the OpenAPI document use: one table says it."""
        body = OPERATIONS[self.path].body
        if body is None:
            raise LookupError(f"{self.path} takes no request body")
        return body


ENDPOINTS: dict[str, Endpoint] = {
    endpoint.path: endpoint
    for endpoint in (
        Endpoint("/v1/chat/completions", spillable=True, counts_prompt=True),
        Endpoint("/v1/completions", spillable=True, counts_prompt=True),
        Endpoint("/v1/embeddings", spillable=True, counts_prompt=True),
        Endpoint("/tokenize", spillable=False, counts_prompt=False),
        Endpoint("/detokenize", spillable=False, counts_prompt=False),
    )
}


@dataclass(frozen=True, slots=True)
class RequestShape:
    """What the gateway acts on, read from a validated request."""

    stream: bool = False
    wants_usage: bool = False
    max_completion_tokens: int | None = None  # per choice; None: the deployment's default
    generates: bool = False  # completion tokens are reserved
    n: int = 1


def parse(raw: bytes, endpoint: Endpoint) -> tuple[dict[str, Any], BaseModel]:
    try:
        parsed, request = parse_request(endpoint.request_model, raw)
    except RequestRejected as exc:
        raise GatewayError(exc.status, exc.message, code=exc.code, param=exc.param) from None
    internal = internal_fields_in(parsed)  # the gateway's own to send, never a tenant's
    if internal:
        raise GatewayError(
            400, f"{internal[0]} is not supported by this server.", param=internal[0]
        )
    return parsed, request


def shape_of(request: BaseModel) -> RequestShape:
    if isinstance(request, ChatCompletionRequest):
        asked = request.requested_max_tokens
    elif isinstance(request, SamplingRequest):
        asked = request.max_tokens
    else:
        return RequestShape()
    return RequestShape(request.stream, request.wants_usage_in_stream, asked, True, request.n)


def route_for(table: RouteTable, tenant: str, request: BaseModel) -> TenantRoute:
    """The tenant's route for the request's model; a request without one (vLLM's /tokenize
    allows that) goes to the tenant's only model, if it has exactly one."""
    model: str | None = getattr(request, "model", None)
    if model is None:
        mine = [route for (owner, _), route in table.routes.items() if owner == tenant]
        if len(mine) != 1:
            raise GatewayError(400, "model is required: you have access to several", param="model")
        return mine[0]
    route = table.routes.get((tenant, model))
    if route is None:
        raise model_not_found(model)
    return route


def count_prompt(
    route: TenantRoute, request: BaseModel, parsed: dict[str, Any]
) -> tuple[int, int | None]:
    """(prompt tokens, affinity key): exact with the model's tokenizer, else estimated."""
    counter = route.pool.token_counter
    exact: int | None = None
    if isinstance(request, ChatCompletionRequest):
        shape = route.reader.chat(parsed["messages"])
        if counter is not None:
            exact = counter.chat(parsed["messages"])
    elif isinstance(request, CompletionRequest | EmbeddingRequest):
        prompt = request.prompt if isinstance(request, CompletionRequest) else request.input
        shape = route.reader.completion(prompt)
        if counter is not None:
            exact = counter.completion(prompt)
    else:
        return 0, None
    return (shape.estimated_tokens if exact is None else exact), shape.affinity_key


def model_card_body(table: RouteTable, tenant: str, model: str) -> bytes:
    """`GET /v1/models/{id}`: the same 404 for a model that does not exist and one not yours."""
    if (tenant, model) not in table.routes:
        raise model_not_found(model)
    return json.dumps(
        {"id": model, "object": "model", "created": 0, "owned_by": "servefleet"}
    ).encode()
