"""OpenAI response bodies from engine outputs: whole responses and SSE streams.

The routes (`server`) check and run a request; this module only renders what came out, so
the chat and completions shapes, logprobs and usage are defined in one place.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi.responses import StreamingResponse

from servefleet.api.openai_errors import OpenAIError
from servefleet.api.openai_requests import ChatCompletionRequest, CompletionRequest
from servefleet.engine.loop import EngineDeadError, EngineRequest, SequenceOutput
from servefleet.engine.protocol import now, usage
from servefleet.engine.sampler import TokenLogprobs
from servefleet.engine.structured.tool_calls import tool_plan
from servefleet.engine.structured.tool_output import ToolCallStream, assistant_message
from servefleet.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from servefleet.engine.serving_state import ServingState


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


def served_name(state: ServingState, req: EngineRequest) -> str:
    """The model a response names: the adapter it ran under, else the base model."""
    return req.lora.name if req.lora is not None else state.served_model_name


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
    plan = tool_plan(body)
    for c in choices:  # the assistant message: text, or tool calls and what is left of it
        c["message"] = {"role": "assistant", "content": c["text"]}
        if plan is not None:
            parser = state.structured.tool_call_parser
            c["message"], c["finish_reason"] = assistant_message(
                plan, parser, c["text"], c["finish_reason"]
            )
    return {
        "id": req.request_id,
        "object": "chat.completion",
        "created": now(),
        "model": served_name(state, req),
        "choices": [
            {
                "index": i,
                "message": c["message"],
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
    reqs: list[EngineRequest],
    steps: list[list[list[SequenceOutput]]],
    body: CompletionRequest,
) -> dict[str, Any]:
    """One response for every prompt: prompt p's choices are indexes p*n .. p*n+n-1."""
    choices: list[dict[str, Any]] = []
    prompt_tokens = completion_tokens = cached = 0
    for req, req_steps in zip(reqs, steps, strict=True):
        merged = _merge(req_steps, req.n)
        prefix = state.tokenizer.decode(req.prompt_token_ids) if body.echo else ""
        for c in merged:
            choices.append(
                {
                    "index": len(choices),
                    "text": prefix + c["text"],
                    "logprobs": (
                        _completion_logprobs(state.tokenizer, c["logprobs"])
                        if body.logprobs is not None
                        else None
                    ),
                    "finish_reason": c["finish_reason"],
                }
            )
        prompt_tokens += merged[0]["prompt_tokens"]
        cached += merged[0]["cached"]
        completion_tokens += sum(c["output"] for c in merged)
    return {
        "id": reqs[0].request_id,
        "object": "text_completion",
        "created": now(),
        "model": served_name(state, reqs[0]),
        "choices": choices,
        "usage": usage(prompt_tokens, completion_tokens, cached),
    }


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def _stream_choice(
    out: SequenceOutput,
    index: int,
    chat: bool,
    want_logprobs: bool,
    tokenizer: Tokenizer,
    want_token_ids: bool = False,
) -> dict[str, Any] | None:
    """One sequence's part of a stream chunk; None when this step gave it nothing to send.

    With `return_token_ids` every step's tokens are sent, held-back text or not, so the gateway
    knows exactly which tokens a client has (`servefleet.api.stream_resume`).
    """
    has_news = out.text or out.finished or (want_logprobs and out.logprobs)
    if not has_news and not (want_token_ids and out.token_ids):
        return None
    render = _chat_logprobs if chat else _completion_logprobs
    logprobs = render(tokenizer, out.logprobs) if want_logprobs and out.logprobs else None
    choice: dict[str, Any] = {
        "index": index,
        "logprobs": logprobs,
        "finish_reason": out.finish_reason,
    }
    if chat:
        choice["delta"] = {"content": out.text} if out.text else {}
    else:
        choice["text"] = out.text
    if want_token_ids:
        choice["token_ids"] = out.token_ids
    return choice


async def _merged(
    streams: list[AsyncIterator[list[SequenceOutput]]],
) -> AsyncGenerator[tuple[int, list[SequenceOutput]], None]:
    """(request position, one step's outputs) of every request's stream, as they come."""
    if len(streams) == 1:
        try:
            async for outs in streams[0]:
                yield 0, outs
        finally:
            await streams[0].aclose()  # type: ignore[attr-defined]  # aborts an early exit
        return
    inbox: asyncio.Queue[tuple[int, list[SequenceOutput] | BaseException | None]] = asyncio.Queue()

    async def pump(position: int) -> None:
        try:
            async for outs in streams[position]:
                await inbox.put((position, outs))
        except BaseException as exc:
            await inbox.put((position, exc))
        else:
            await inbox.put((position, None))

    tasks = [asyncio.ensure_future(pump(i)) for i in range(len(streams))]
    try:
        remaining = len(tasks)
        while remaining:
            position, item = await inbox.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield position, item
    finally:
        for task in tasks:
            task.cancel()


def stream_response(
    state: ServingState,
    reqs: list[EngineRequest],
    body: ChatCompletionRequest | CompletionRequest,
    *,
    chat: bool,
) -> StreamingResponse:
    """SSE stream of one request per prompt; prompt p's choices are indexes p*n .. p*n+n-1."""
    created = now()
    include_usage = body.wants_usage_in_stream
    obj = "chat.completion.chunk" if chat else "text_completion"
    want_logprobs = bool(body.logprobs) if chat else body.logprobs is not None
    first_index = [sum(r.n for r in reqs[:p]) for p in range(len(reqs))]
    request_id = reqs[0].request_id

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        payload = {
            "id": request_id,
            "object": obj,
            "created": created,
            "model": served_name(state, reqs[0]),
            "choices": choices,
        }
        payload.update(extra)
        return _sse(payload)

    outputs = _merged([state.engine.generate(r) for r in reqs])  # all queued now, in order

    plan = tool_plan(body) if isinstance(body, ChatCompletionRequest) else None
    tool_streams = {
        i: ToolCallStream(plan, state.structured.tool_call_parser)
        for i in range(reqs[0].n)
        if plan is not None
    }

    async def events() -> AsyncIterator[bytes]:
        prompt_tokens = [0] * len(reqs)
        cached = [0] * len(reqs)
        completion = [0] * sum(r.n for r in reqs)
        try:
            if chat:
                first = {"role": "assistant", "content": ""}
                yield chunk(
                    [{"index": i, "delta": first, "finish_reason": None} for i in range(reqs[0].n)]
                )
            async for position, outs in outputs:
                choices = []
                for o in outs:
                    index = first_index[position] + o.index
                    prompt_tokens[position] = o.num_prompt_tokens
                    cached[position] = o.num_cached_tokens
                    completion[index] = o.num_output_tokens
                    if index in tool_streams:  # tool calls: OpenAI's tool_calls deltas
                        stream = tool_streams[index]
                        for c in stream.choices(index, o.text, o.finished, o.finish_reason):
                            yield chunk([c])
                        continue
                    choice = _stream_choice(
                        o, index, chat, want_logprobs, state.tokenizer, body.return_token_ids
                    )
                    if choice is not None:
                        choices.append(choice)
                if choices:
                    yield chunk(choices)
            if include_usage:
                yield chunk([], usage=usage(sum(prompt_tokens), sum(completion), sum(cached)))
            yield b"data: [DONE]\n\n"
        except EngineDeadError as exc:
            yield _sse(OpenAIError(status=500, message=str(exc), type="internal_error").body())
        finally:
            await outputs.aclose()

    return StreamingResponse(
        events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )
