"""FastAPI routes: the OpenAI API, health, readiness and metrics.

Every request is checked before it reaches the engine (model name, context
length, cache capacity, queue depth), so the engine only gets work it can
finish; anything else is answered at once with an OpenAI-style error.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from servefleet.engine.loop import Engine, EngineDeadError, EngineRequest, SequenceOutput
from servefleet.engine.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    _SamplingFields,
    new_id,
)
from servefleet.engine.responses import chat_response, completion_response, stream_response
from servefleet.text.chat_template import ChatTemplate
from servefleet.text.messages import template_messages
from servefleet.text.tokenizer import Tokenizer

log = logging.getLogger("servefleet.engine.server")
BodyT = TypeVar("BodyT", ChatCompletionRequest, CompletionRequest)


@dataclass
class ServingState:
    """What the routes need; owned by the process that runs the server."""

    engine: Engine
    tokenizer: Tokenizer
    chat_template: ChatTemplate
    served_model_name: str
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    max_queue_depth: int
    ready: bool = False
    draining: bool = False
    started_at: float = field(default_factory=time.time)

    def retry_after(self) -> int:
        """Seconds until the queue ahead has likely drained, from measured step times."""
        waiting = self.engine.num_waiting
        hist = self.engine.metrics.e2e
        count = _hist_value(hist, "_count")
        mean = _hist_value(hist, "_sum") / count if count else 5.0
        slots = max(1, len(self.engine.scheduler.running))
        return max(1, math.ceil(mean * (waiting + 1) / slots))


def _hist_value(hist: Any, suffix: str) -> float:
    for metric in hist.collect():
        for sample in metric.samples:
            if sample.name.endswith(suffix):
                return float(sample.value)
    return 0.0


def _error_response(err: OpenAIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def build_app(state: ServingState) -> FastAPI:
    app = FastAPI(title="servefleet engine", docs_url=None, redoc_url=None)
    app.state.serving = state

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        if exc.status in (400, 404, 503):
            state.engine.metrics.rejected(exc.status)
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        state.engine.metrics.rejected(400)
        return _error_response(OpenAIError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error_response(OpenAIError(exc.status_code, str(exc.detail), type="not_found"))

    @app.get("/health")
    async def health() -> JSONResponse:
        ok, reason = state.engine.is_healthy()
        return JSONResponse(
            {"status": "ok" if ok else "unhealthy", "detail": reason}, 200 if ok else 503
        )

    @app.get("/ready")
    async def ready() -> JSONResponse:
        ok, reason = state.engine.is_healthy()
        if state.draining:
            return JSONResponse({"ready": False, "detail": "draining"}, 503)
        if not state.ready or not ok:
            return JSONResponse({"ready": False, "detail": reason if not ok else "loading"}, 503)
        return JSONResponse({"ready": True})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.engine.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": state.served_model_name,
                    "object": "model",
                    "created": int(state.started_at),
                    "owned_by": "servefleet",
                    "max_model_len": state.max_model_len,
                }
            ],
        }

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(request: Request) -> Response:
        body = await _parse(request, ChatCompletionRequest)
        _admit(state, body)
        messages = template_messages([m.model_dump() for m in body.messages])
        try:
            prompt = state.chat_template.render(messages, add_generation_prompt=True)
        except Exception as exc:  # a template's raise_exception or a jinja error
            raise OpenAIError(400, f"chat template failed: {exc}", param="messages") from exc
        prompt_ids = state.tokenizer.encode(prompt, add_special_tokens=False)
        max_tokens = _check_lengths(state, prompt_ids, body.requested_max_tokens, "messages")
        engine_request = _engine_request(
            body, prompt_ids, max_tokens, body.num_logprobs, "chatcmpl"
        )
        if body.stream:
            return stream_response(state, engine_request, body, chat=True)
        outputs = await _collect(request, state, engine_request)
        return JSONResponse(chat_response(state, engine_request, outputs, body))

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        body = await _parse(request, CompletionRequest)
        _admit(state, body)
        prompts = body.prompts()
        if len(prompts) != 1:
            raise OpenAIError(400, "send one prompt per request", param="prompt")
        prompt = prompts[0]
        if isinstance(prompt, str):
            prompt_ids = state.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            vocab = state.tokenizer.vocab_size
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise OpenAIError(
                    400, f"token ids out of range [0, {vocab}): {bad[:5]}", param="prompt"
                )
            prompt_ids = list(prompt)
        if not prompt_ids:
            raise OpenAIError(400, "prompt is empty after tokenization", param="prompt")
        requested = body.max_tokens if body.max_tokens is not None else 16
        max_tokens = _check_lengths(state, prompt_ids, requested, "prompt")
        engine_request = _engine_request(body, prompt_ids, max_tokens, body.logprobs, "cmpl")
        if body.stream:
            return stream_response(state, engine_request, body, chat=False)
        outputs = await _collect(request, state, engine_request)
        return JSONResponse(completion_response(state, engine_request, outputs, body))

    return app


# ---- parsing and admission ----------------------------------------------------------------
def _validation_message(
    exc: ValidationError | RequestValidationError,
) -> tuple[str, str | None]:
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or None
    return f"{loc or 'body'}: {first.get('msg', 'invalid request')}", loc


async def _parse(request: Request, model: type[BodyT]) -> BodyT:
    """JSON body whatever the Content-Type says (curl -d sends a form type)."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise OpenAIError(400, f"request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise OpenAIError(400, "request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        message, param = _validation_message(exc)
        raise OpenAIError(400, message, param=param) from exc


def _admit(state: ServingState, body: _SamplingFields) -> None:
    if state.draining or not state.ready:
        raise OpenAIError(
            503,
            "the engine is draining" if state.draining else "the engine is still loading",
            type="service_unavailable",
            headers={"Retry-After": "5"},
        )
    if body.model != state.served_model_name:
        raise OpenAIError(
            404,
            f"The model `{body.model}` does not exist.",
            type="invalid_request_error",
            param="model",
            code="model_not_found",
        )
    ok, reason = state.engine.is_healthy()
    if not ok:
        raise OpenAIError(503, reason, type="service_unavailable", headers={"Retry-After": "5"})
    if state.engine.num_waiting >= state.max_queue_depth:
        raise OpenAIError(
            503,
            f"the engine's queue is full ({state.max_queue_depth} waiting); retry later",
            type="service_unavailable",
            code="queue_full",
            headers={"Retry-After": str(state.retry_after())},
        )


def _check_lengths(
    state: ServingState, prompt_ids: list[int], requested: int | None, param: str
) -> int:
    prompt_len = len(prompt_ids)
    max_tokens = requested if requested is not None else state.max_model_len - prompt_len
    if max_tokens < 1 or prompt_len + max_tokens > state.max_model_len:
        raise OpenAIError(
            400,
            f"This model's maximum context length is {state.max_model_len} tokens. However, you "
            f"requested {prompt_len + max(max_tokens, 0)} tokens ({prompt_len} in the {param}, "
            f"{max(max_tokens, 0)} in the completion). Please reduce the length of the {param} "
            "or completion.",
            param=param,
            code="context_length_exceeded",
        )
    blocks = -(-(prompt_len + max_tokens) // state.block_size)
    if blocks > state.num_kv_blocks:
        raise OpenAIError(
            400,
            f"prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) needs {blocks} KV-cache "
            f"blocks but the cache holds only {state.num_kv_blocks} "
            f"({state.num_kv_blocks * state.block_size} tokens); lower max_tokens",
            param="max_tokens",
            code="kv_cache_too_small",
        )
    return max_tokens


def _engine_request(
    body: _SamplingFields, prompt_ids: list[int], max_tokens: int, logprobs: int | None, kind: str
) -> EngineRequest:
    return EngineRequest(
        request_id=new_id(kind),
        prompt_token_ids=prompt_ids,
        params=body.sampling_params(max_tokens, logprobs),
        priority=body.priority_value,
        n=body.n,
    )


# ---- running a request ------------------------------------------------------------------------
async def _collect(
    request: Request, state: ServingState, engine_request: EngineRequest
) -> list[list[SequenceOutput]]:
    """All outputs of a non-streaming request; aborts it if the client goes away."""
    steps: list[list[SequenceOutput]] = []
    outputs = state.engine.generate(engine_request)

    async def consume() -> None:
        async for outs in outputs:
            steps.append(outs)

    async def disconnected() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    consumer = asyncio.ensure_future(consume())
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not consumer.done():
            consumer.cancel()
            state.engine.abort(engine_request.request_id)
    try:
        consumer.result()
    except EngineDeadError as exc:
        raise OpenAIError(500, str(exc), type="internal_error") from exc
    except asyncio.CancelledError as exc:
        raise OpenAIError(499, "client disconnected", type="client_closed") from exc
    return steps
