"""Everything a request must pass before it reaches the engine loop.

Bounded body → shared request model (`servefleet.api.openai_requests`) → admission (ready,
model name, health, room in the queue for every sequence the request adds) → prompt token ids
within the vocabulary → context length and KV-cache capacity. Each failure is an
`OpenAIError` naming the parameter, so the engine only gets work it can finish.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

from fastapi import Request
from pydantic import BaseModel
from starlette.requests import ClientDisconnect

from servefleet.api.max_tokens import completion_budget
from servefleet.api.openai_errors import OpenAIError
from servefleet.api.openai_requests import SamplingRequest
from servefleet.api.openai_wire import MAX_BODY_BYTES, parse_request
from servefleet.api.stream_resume import RESUME_TOKEN_IDS

if TYPE_CHECKING:
    from servefleet.engine.lora.adapter import LoraAdapter
    from servefleet.engine.serving_state import ServingState

BodyT = TypeVar("BodyT", bound=BaseModel)


async def read_body(request: Request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The body, refused with a 413 as soon as it grows past the limit (never buffered whole)."""
    declared = request.headers.get("content-length")
    too_large = OpenAIError(
        status=413,
        message=f"The request body is larger than {limit} bytes.",
        code="request_too_large",
    )
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    parts: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            parts.append(chunk)
    except ClientDisconnect:  # gone, or cut for a body too slow (`api.http_protocol`)
        raise OpenAIError(
            status=499,
            message="the client left before its request body arrived",
            type="client_closed",
        ) from None
    return b"".join(parts)


async def parse(request: Request, model: type[BodyT], limit: int = MAX_BODY_BYTES) -> BodyT:
    """JSON body whatever the Content-Type says (curl -d sends a form type)."""
    raw = await read_body(request, limit)
    _, body = parse_request(model, raw)
    return body


def admit(
    state: ServingState, model: str | None, sequences: int = 1, param: str = "n"
) -> LoraAdapter | None:
    """Ready, a model it serves, healthy and room in the queue for `sequences` more (n per
    prompt); else 503/404 at once, and a 400 naming `param` for a request bigger than the
    whole queue (300 prompts x n=16 once queued 4,788 sequences past a depth of 256).
    Returns the adapter the request runs under (None: the base model)."""
    if state.draining or not state.ready:
        raise OpenAIError(
            status=503,
            message="the engine is draining" if state.draining else "the engine is still loading",
            type="service_unavailable",
            headers={"Retry-After": "5"},
        )
    adapter = resolve_model(state, model)
    ok, reason = state.engine.is_healthy()
    if not ok:
        raise OpenAIError(
            status=503, message=reason, type="service_unavailable", headers={"Retry-After": "5"}
        )
    bound = max(1, state.max_queue_depth)
    if sequences > bound:
        raise OpenAIError(
            status=400,
            message=f"this request adds {sequences} sequences (n per prompt); the engine queues at "
            f"most {bound}: send fewer prompts or a lower n",
            param=param,
            code="too_many_sequences",
        )
    check_room(state, sequences)
    if adapter is not None:
        state.engine.metrics.lora.request(adapter.name)
    return adapter


def resolve_model(state: ServingState, model: str | None) -> LoraAdapter | None:
    """The adapter `model` names, None for the base model; 404 for anything else, the same
    answer whether a name was never loaded or was evicted (vLLM's)."""
    if model is None or model == state.served_model_name:
        return None
    adapter = state.loras.resolve(model) if state.loras is not None else None
    if adapter is None:
        raise model_not_found(model)
    return adapter


def check_room(state: ServingState, sequences: int = 1) -> None:
    """503 + Retry-After when the queue has no room for `sequences` more."""
    if state.engine.num_waiting + sequences > state.max_queue_depth:
        raise OpenAIError(
            status=503,
            message=f"the engine's queue is full ({state.max_queue_depth} waiting); retry later",
            type="service_unavailable",
            code="queue_full",
            headers={"Retry-After": str(state.retry_after())},
        )


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(
        status=404,
        message=f"The model `{model}` does not exist.",
        type="invalid_request_error",
        param="model",
        code="model_not_found",
    )


def prompt_ids(
    state: ServingState, prompt: str | list[int], param: str, add_special_tokens: bool = True
) -> list[int]:
    """Token ids of one prompt (text is tokenized, ids range-checked); never empty."""
    if isinstance(prompt, str):
        ids = state.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
    else:
        vocab = state.tokenizer.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(
                status=400,
                message=f"{param}: token ids out of range [0, {vocab}): {bad[:5]}",
                param=param,
            )
        ids = list(prompt)
    if not ids:
        raise OpenAIError(status=400, message=f"{param} is empty after tokenization", param=param)
    return ids


def check_lengths(
    state: ServingState, prompt_ids: list[int], requested: int | None, param: str, *, chat: bool
) -> int:
    """max_tokens for one prompt: what was asked, else the endpoint's default (the one the
    gateway reserves too: `servefleet.api.max_tokens`); refused when it cannot fit."""
    prompt_len = len(prompt_ids)
    max_tokens = completion_budget(
        requested, chat=chat, prompt_tokens=prompt_len, context_length=state.max_model_len
    )
    if max_tokens < 1 or prompt_len + max_tokens > state.max_model_len:
        raise OpenAIError(
            status=400,
            message=f"This model's maximum context length is {state.max_model_len} tokens. "
            f"However, you requested {prompt_len + max(max_tokens, 0)} tokens ({prompt_len} in "
            f"the {param}, {max(max_tokens, 0)} in the completion). Please reduce the length of "
            f"the {param} or completion.",
            param=param,
            code="context_length_exceeded",
        )
    blocks = -(-(prompt_len + max_tokens) // state.block_size)
    if blocks > state.num_kv_blocks:
        raise OpenAIError(
            status=400,
            message=f"prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) needs {blocks} "
            f"KV-cache blocks but the cache holds only {state.num_kv_blocks} "
            f"({state.num_kv_blocks * state.block_size} tokens); lower max_tokens",
            param="max_tokens",
            code="kv_cache_too_small",
        )
    return max_tokens


def resume_ids(state: ServingState, body: SamplingRequest, max_tokens: int) -> list[int]:
    """The delivered token ids a resumed request continues after (`servefleet.api.stream_resume`).

    Only the gateway sends them, and only to an engine it holds the key of (the key middleware
    has already refused a caller without it). They must leave room for one more token.
    """
    ids = body.resume_token_ids or []
    if not ids:
        return []
    param = RESUME_TOKEN_IDS
    if body.n != 1:
        raise OpenAIError(
            status=400, message=f"{param} needs n=1 (one choice to continue)", param=param
        )
    vocab = state.tokenizer.vocab_size
    bad = [t for t in ids if t >= vocab]
    if bad:
        raise OpenAIError(
            status=400,
            message=f"{param}: token ids out of range [0, {vocab}): {bad[:5]}",
            param=param,
        )
    if len(ids) >= max_tokens:
        raise OpenAIError(
            status=400,
            message=f"{param} holds {len(ids)} tokens, max_tokens is {max_tokens}",
            param=param,
        )
    return list(ids)
