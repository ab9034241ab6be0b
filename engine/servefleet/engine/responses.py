"""OpenAI response bodies from engine outputs: whole responses and SSE streams.

The routes (`server`) check and run a request; this module only renders what came out, so
the chat and completions shapes, logprobs and usage are defined in one place.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi.responses import StreamingResponse

from servefleet.engine.loop import EngineDeadError, EngineRequest, SequenceOutput
from servefleet.engine.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    now,
    usage,
)
from servefleet.engine.sampler import TokenLogprobs
from servefleet.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from servefleet.engine.server import ServingState


def _merge(steps: list[list[SequenceOutput]], n: int) -> list[dict[str, Any]]:
    choices: list[dict[str, Any]] = [
        {"text": [], "token_ids": [], "logprobs": [], "finish_reason": None, "output": 0}
        for _ in range(n)
    ]
    prompt_tokens = cached = 0
    for outs in steps:
        for o in outs:
            c = choices[o.index]
            c["text"].append(o.text)
            c["token_ids"].extend(o.token_ids)
            c["logprobs"].extend(o.logprobs)
            c["output"] = o.num_output_tokens
            if o.finished:
                c["finish_reason"] = o.finish_reason
            prompt_tokens, cached = o.num_prompt_tokens, o.num_cached_tokens
    for c in choices:
        c["text"] = "".join(c["text"])
        c["prompt_tokens"], c["cached"] = prompt_tokens, cached
    return choices


def _chat_logprobs(tokenizer: Tokenizer, items: list[TokenLogprobs]) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            {**entry(i.token_id, i.logprob), "top_logprobs": [entry(t, lp) for t, lp in i.top]}
            for i in items
        ]
    }


def _completion_logprobs(tokenizer: Tokenizer, items: list[TokenLogprobs]) -> dict[str, Any]:
    tokens = [tokenizer.decode([i.token_id], skip_special_tokens=False) for i in items]
    return {
        "tokens": tokens,
        "token_logprobs": [i.logprob for i in items],
        "top_logprobs": [
            {tokenizer.decode([t], skip_special_tokens=False): lp for t, lp in i.top} for i in items
        ],
        "text_offset": [],
    }


def _usage_of(choices: list[dict[str, Any]]) -> dict[str, Any]:
    completion = sum(c["output"] for c in choices)
    return usage(choices[0]["prompt_tokens"], completion, choices[0]["cached"])


def chat_response(
    state: ServingState,
    req: EngineRequest,
    steps: list[list[SequenceOutput]],
    body: ChatCompletionRequest,
) -> dict[str, Any]:
    choices = _merge(steps, req.n)
    return {
        "id": req.request_id,
        "object": "chat.completion",
        "created": now(),
        "model": state.served_model_name,
        "choices": [
            {
                "index": i,
                "message": {"role": "assistant", "content": c["text"]},
                "logprobs": _chat_logprobs(state.tokenizer, c["logprobs"])
                if body.logprobs
                else None,
                "finish_reason": c["finish_reason"],
            }
            for i, c in enumerate(choices)
        ],
        "usage": _usage_of(choices),
    }


def completion_response(
    state: ServingState,
    req: EngineRequest,
    steps: list[list[SequenceOutput]],
    body: CompletionRequest,
) -> dict[str, Any]:
    choices = _merge(steps, req.n)
    prefix = state.tokenizer.decode(req.prompt_token_ids) if body.echo else ""
    return {
        "id": req.request_id,
        "object": "text_completion",
        "created": now(),
        "model": state.served_model_name,
        "choices": [
            {
                "index": i,
                "text": prefix + c["text"],
                "logprobs": (
                    _completion_logprobs(state.tokenizer, c["logprobs"])
                    if body.logprobs is not None
                    else None
                ),
                "finish_reason": c["finish_reason"],
            }
            for i, c in enumerate(choices)
        ],
        "usage": _usage_of(choices),
    }


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def _stream_choice(
    out: SequenceOutput, chat: bool, want_logprobs: bool, tokenizer: Tokenizer
) -> dict[str, Any] | None:
    """One sequence's part of a stream chunk; None when this step gave it nothing to send."""
    if not out.text and not out.finished and not (want_logprobs and out.logprobs):
        return None
    render = _chat_logprobs if chat else _completion_logprobs
    logprobs = render(tokenizer, out.logprobs) if want_logprobs and out.logprobs else None
    choice: dict[str, Any] = {
        "index": out.index,
        "logprobs": logprobs,
        "finish_reason": out.finish_reason,
    }
    if chat:
        choice["delta"] = {"content": out.text} if out.text else {}
    else:
        choice["text"] = out.text
    return choice


def stream_response(
    state: ServingState,
    req: EngineRequest,
    body: ChatCompletionRequest | CompletionRequest,
    *,
    chat: bool,
) -> StreamingResponse:
    created = now()
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    obj = "chat.completion.chunk" if chat else "text_completion"
    want_logprobs = bool(body.logprobs) if chat else body.logprobs is not None

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        payload = {
            "id": req.request_id,
            "object": obj,
            "created": created,
            "model": state.served_model_name,
            "choices": choices,
        }
        payload.update(extra)
        return _sse(payload)

    outputs = state.engine.generate(req)

    async def events() -> AsyncIterator[bytes]:
        prompt_tokens = cached = 0
        completion = [0] * req.n
        try:
            if chat:
                first = {"role": "assistant", "content": ""}
                yield chunk(
                    [{"index": i, "delta": first, "finish_reason": None} for i in range(req.n)]
                )
            async for outs in outputs:
                choices = []
                for o in outs:
                    prompt_tokens, cached = o.num_prompt_tokens, o.num_cached_tokens
                    completion[o.index] = o.num_output_tokens
                    choice = _stream_choice(o, chat, want_logprobs, state.tokenizer)
                    if choice is not None:
                        choices.append(choice)
                if choices:
                    yield chunk(choices)
            if include_usage:
                yield chunk([], usage=usage(prompt_tokens, sum(completion), cached))
            yield b"data: [DONE]\n\n"
        except EngineDeadError as exc:
            yield _sse(OpenAIError(500, str(exc), type="internal_error").body())

    return StreamingResponse(
        events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )
