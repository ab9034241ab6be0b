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
from functools import partial
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from servefleet.api.cache_salt import CACHE_SALT, effective_salt
from servefleet.api.kv_blocks import root_hash
from servefleet.api.max_tokens import completion_budget
from servefleet.api.openai_errors import OpenAIError
from servefleet.api.openai_requests import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    SamplingRequest,
)
from servefleet.api.openai_wire import parse_request
from servefleet.api.openapi_doc import OPERATIONS
from servefleet.api.stream_resume import INTERNAL_FIELDS, internal_fields_in
from servefleet.gateway.errors import model_not_found
from servefleet.gateway.prompt import PromptShape
from servefleet.gateway.route_table import RouteTable, TenantRoute

if TYPE_CHECKING:  # the tokenizer is optional and loaded lazily
    from servefleet.gateway.token_counter import PromptTokenCounter


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


# Fields the gateway decides and sends itself: a tenant sending one gets a 400 naming it.
# `priority` orders the engine's scheduler and its preemption: it follows the tenant's traffic
# class (`forward`), never the tenant's say.
GATEWAY_FIELDS: tuple[str, ...] = ("priority",)


@dataclass(frozen=True, slots=True)
class RequestShape:
    """What the gateway acts on, read from a validated request."""

    stream: bool = False
    wants_usage: bool = False
    max_completion_tokens: int | None = None  # per choice; None: the endpoint's default
    generates: bool = False  # completion tokens are reserved
    n: int = 1
    prompts: int = 1  # a completions request may send several, each answered n times
    chat: bool = False  # a chat's default max_tokens is the rest of the context

    @property
    def choices(self) -> int:
        """Answers the engine generates: every prompt n times."""
        return self.n * self.prompts


def parse(raw: bytes, endpoint: Endpoint) -> tuple[dict[str, Any], BaseModel]:
    parsed, request = parse_request(endpoint.request_model, raw)
    internal = internal_fields_in(parsed)  # the gateway's own to send, never a tenant's
    if internal:
        raise OpenAIError(
            status=400, message=f"{internal[0]} is not supported by this server.", param=internal[0]
        )
    for name in GATEWAY_FIELDS:
        if name in parsed:
            raise OpenAIError(
                status=400,
                message=f"{name} is set by the gateway from your traffic class; do not send it.",
                param=name,
            )
    return parsed, request


def tenant_document(document: dict[str, Any]) -> dict[str, Any]:
    """The OpenAPI document as a tenant may use it: without the fields the gateway sets
    itself (`GATEWAY_FIELDS`, `INTERNAL_FIELDS`; the schemas forbid unknown fields)."""
    own = {*GATEWAY_FIELDS, *INTERNAL_FIELDS}
    for schema in document["components"]["schemas"].values():
        properties = schema.get("properties", {})
        for name in properties.keys() & own:
            del properties[name]
        if "required" in schema:
            schema["required"] = [r for r in schema["required"] if r not in own]
    return document


def shape_of(request: BaseModel) -> RequestShape:
    prompts = 1
    if isinstance(request, ChatCompletionRequest):
        asked = request.requested_max_tokens
    elif isinstance(request, CompletionRequest):
        asked, prompts = request.max_tokens, len(request.prompts())
    elif isinstance(request, SamplingRequest):
        asked = request.max_tokens
    else:
        return RequestShape()
    chat = isinstance(request, ChatCompletionRequest)
    return RequestShape(
        request.stream, request.wants_usage_in_stream, asked, True, request.n, prompts, chat
    )


def reserved_tokens(route: TenantRoute, shape: RequestShape, prompt_tokens: int) -> int:
    """The prompt plus what every choice of every prompt may generate: what the engine will
    allow (`servefleet.api.max_tokens`). A chat without max_tokens may run to the end of the
    context; where the gateway does not know the context (no tokenizer, no maxModelLen), it
    reserves the deployment's `default_max_tokens` per choice instead."""
    if not shape.generates:
        return prompt_tokens
    config, counter = route.pool.config, route.pool.token_counter
    context = config.max_model_len or (counter.context_length if counter else None)
    asked = shape.max_completion_tokens
    if shape.chat and asked is None and context is None:
        per_choice = config.default_max_tokens
    else:  # a chat's prompt is one; a completion's default does not depend on its prompts
        per_choice = completion_budget(
            asked, chat=shape.chat, prompt_tokens=prompt_tokens, context_length=context or 0
        )
    return prompt_tokens + per_choice * shape.choices


def route_for(table: RouteTable, tenant: str, request: BaseModel) -> TenantRoute:
    """The tenant's route for the request's model; a request without one (vLLM's /tokenize
    allows that) goes to the tenant's only model, if it has exactly one."""
    model: str | None = getattr(request, "model", None)
    if model is None:
        mine = [route for (owner, _), route in table.routes.items() if owner == tenant]
        if len(mine) != 1:
            raise OpenAIError(
                status=400, message="model is required: you have access to several", param="model"
            )
        return mine[0]
    route = table.routes.get((tenant, model))
    if route is None:
        raise model_not_found(model)
    return route


@dataclass(frozen=True, slots=True)
class PromptCount:
    """What admission and routing learn from the prompt before it is placed."""

    tokens: int
    affinity_key: int | None
    block_hashes: tuple[int, ...] = ()  # exact KV block hashes (engine's chain), if known


def hash_block_size(route: TenantRoute, parsed: dict[str, Any], chat: bool) -> int | None:
    """The block size to hash the prompt's KV blocks with, or None not to: only for our
    engines (`kv_pull_min_tokens` set), and not for a chat with tools (the gateway renders
    the template without them, so the blocks would differ)."""
    config = route.pool.config
    if config.kv_pull_min_tokens is None:
        return None
    if chat and parsed.get("tools"):
        return None
    return config.block_size


def chain_root(route: TenantRoute, salt: str | None) -> int | None:
    """The root of the prompt's KV chain as the engines compute it: the base model's, or a
    LoRA adapter's from the identity its replicas report (`KVIndex.adapter_identity`); None
    (do not hash: route by affinity) while no replica reports one, or they disagree."""
    if route.adapter is None:
        return root_hash(None, salt)
    identity = route.pool.kv_index.adapter_identity(route.adapter.name)
    return None if identity is None else root_hash(identity, salt)


def cache_salt_for(route: TenantRoute, parsed: dict[str, Any]) -> str | None:
    """The salt a request is sent to the engines with (`servefleet.api.cache_salt`)."""
    own = parsed.get(CACHE_SALT)
    own = own if isinstance(own, str) else None
    return effective_salt(route.pool.config.prefix_cache_sharing, route.tenant, own)


async def count_prompt(
    route: TenantRoute, request: BaseModel, parsed: dict[str, Any], salt: str | None = None
) -> PromptCount:
    """Prompt tokens, affinity key and block hashes: exact with the model's tokenizer (the
    hashes only then), else estimated.

    Exact counts run off the event loop (`token_counter`); a prompt whose length alone proves
    it longer than the model's context is a 400 before anything tokenizes it."""
    counter = route.pool.token_counter
    text: Any
    if isinstance(request, ChatCompletionRequest):
        text, param, chat = parsed["messages"], "messages", True
        shape = route.reader.chat(text)
    elif isinstance(request, CompletionRequest | EmbeddingRequest):
        completion = isinstance(request, CompletionRequest)
        text = request.prompt if isinstance(request, CompletionRequest) else request.input
        param, chat = ("prompt" if completion else "input"), False
        shape = route.reader.completion(text)
    else:
        return PromptCount(0, None)
    if counter is None:
        return PromptCount(shape.estimated_tokens, shape.affinity_key)
    _check_context(route.pool.config.max_model_len or counter.context_length, counter, shape, param)
    if isinstance(request, EmbeddingRequest):
        exact = await counter.count(partial(counter.completion, text), shape.total_chars)
        tokens = shape.estimated_tokens if exact is None else exact
        return PromptCount(tokens, shape.affinity_key)
    root = chain_root(route, salt)
    block_size = hash_block_size(route, parsed, chat) if root is not None else None
    counted_with = counter.chat_counted if chat else counter.completion_counted
    work = partial(counted_with, text, block_size, root_hash(None, salt) if root is None else root)
    counted = await counter.count(work, shape.total_chars)
    if counted is None:
        return PromptCount(shape.estimated_tokens, shape.affinity_key)
    return PromptCount(counted.tokens, shape.affinity_key, counted.block_hashes)


def _check_context(
    context: int | None, counter: PromptTokenCounter, shape: PromptShape, param: str
) -> None:
    """400 when the longest prompt's characters alone prove it cannot fit the context."""
    if context is None:
        return
    least = counter.at_least(shape.chars)
    if least > context:
        raise OpenAIError(
            status=400,
            message=f"This model's maximum context length is {context} tokens; your {param} has at "
            f"least {least} tokens (from its length alone).",
            code="context_length_exceeded",
            param=param,
        )


def model_card_body(table: RouteTable, tenant: str, model: str) -> bytes:
    """`GET /v1/models/{id}`: the same 404 for a model that does not exist and one not yours."""
    if (tenant, model) not in table.routes:
        raise model_not_found(model)
    return json.dumps(
        {"id": model, "object": "model", "created": 0, "owned_by": "servefleet"}
    ).encode()
