"""FastAPI routes: generation (chat, completions), health, readiness and metrics.

Every request passes `request_checks` before it reaches the engine (bounded body, the shared
request models, model name, context length, cache capacity, queue depth), so the engine only
gets work it can finish; anything else is answered at once with an OpenAI-style error. The
other endpoints (one model, /version, /tokenize, /detokenize, embeddings) are `extra_routes`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from servefleet.api.openai_requests import ChatCompletionRequest, CompletionRequest, SamplingRequest
from servefleet.api.openai_wire import HeaderLimit
from servefleet.engine.api_key import ApiKeyMiddleware
from servefleet.engine.extra_routes import add_extra_routes, model_card
from servefleet.engine.loop import Engine, EngineDeadError, EngineRequest, SequenceOutput
from servefleet.engine.protocol import OpenAIError, new_id, priority_value, sampling_params
from servefleet.engine.request_checks import (
    admit,
    check_lengths,
    parse,
    prompt_ids,
    resume_ids,
)
from servefleet.engine.responses import chat_response, completion_response, stream_response
from servefleet.engine.structured.service import StructuredOutputs
from servefleet.text.chat_template import ChatTemplate, ChatTemplateError
from servefleet.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar

log = logging.getLogger("servefleet.engine.server")


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
    api_key: str | None = field(default=None, repr=False)  # --api-key: /v1 needs a bearer
    tool_call_parser: str | None = None  # --tool-call-parser; None: from the chat template

    def __post_init__(self) -> None:
        self.structured = StructuredOutputs(
            self.tokenizer, self.chat_template, self.tool_call_parser
        )

    def render_prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """The chat template's prompt; a template that fails (its `raise_exception`, a jinja
        error) fails on what the client sent, so it is a 400 on `messages`."""
        try:
            return self.chat_template.render(
                messages, add_generation_prompt=add_generation_prompt, tools=tools
            )
        except Exception as exc:
            message = str(exc) if isinstance(exc, ChatTemplateError) else f"chat template: {exc}"
            raise OpenAIError(400, message, param="messages") from exc

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
    # openapi_url=None: FastAPI's own document would miss the bodies (handlers read raw
    # requests); extra_routes serves the one built from the request models.
    app = FastAPI(title="servefleet engine", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serving = state
    if state.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=state.api_key)
    _add_error_handlers(app, state)
    _add_probe_routes(app, state)
    _add_generation_routes(app, state)
    add_extra_routes(app, state)
    app.add_middleware(HeaderLimit)
    return app


def _add_error_handlers(app: FastAPI, state: ServingState) -> None:
    """Every refusal in OpenAI's error shape; refusals a client caused are counted."""

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

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        """A bug answers in OpenAI's shape too, not the plain-text 500 page (still logged)."""
        log.error("internal_error %s %s: %r", request.method, request.url.path, exc)
        return _error_response(
            OpenAIError(
                500,
                "Internal error in the engine (logged there).",
                type="server_error",
                code="internal_error",
            )
        )


def _add_probe_routes(app: FastAPI, state: ServingState) -> None:
    """What kubelet, Prometheus and routers read: liveness, readiness, metrics, the model."""

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
        return {"object": "list", "data": [model_card(state)]}


def _add_generation_routes(app: FastAPI, state: ServingState) -> None:
    @app.post("/v1/chat/completions", response_model=None)
    async def chat(request: Request) -> Response:
        body = await parse(request, ChatCompletionRequest)
        admit(state, body.model)
        prepared = state.structured.prepare_chat(body)  # tools, response_format, guided_*
        prompt = state.render_prompt(
            prepared.messages, add_generation_prompt=True, tools=prepared.tools
        )
        ids = state.tokenizer.encode(prompt, add_special_tokens=False)
        max_tokens = check_lengths(state, ids, body.requested_max_tokens, "messages")
        engine_request = _engine_request(
            state, body, ids, max_tokens, body.num_logprobs, "chatcmpl", prepared.compiled_grammar
        )
        if body.stream:
            return stream_response(state, [engine_request], body, chat=True)
        outputs = await _collect(request, state, [engine_request])
        return JSONResponse(chat_response(state, engine_request, outputs[0], body))

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        body = await parse(request, CompletionRequest)
        admit(state, body.model)
        requested = body.max_tokens if body.max_tokens is not None else 16
        grammar = state.structured.prepare_completion(body)  # guided_*
        engine_requests = []
        for prompt in body.prompts():
            ids = prompt_ids(state, prompt, "prompt")
            max_tokens = check_lengths(state, ids, requested, "prompt")
            engine_requests.append(
                _engine_request(state, body, ids, max_tokens, body.logprobs, "cmpl", grammar)
            )
        if body.stream:
            return stream_response(state, engine_requests, body, chat=False)
        outputs = await _collect(request, state, engine_requests)
        return JSONResponse(completion_response(state, engine_requests, outputs, body))


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or None
    return f"{loc or 'body'}: {first.get('msg', 'invalid request')}", loc


def _engine_request(
    state: ServingState,
    body: SamplingRequest,
    ids: list[int],
    max_tokens: int,
    logprobs: int | None,
    kind: str,
    compiled_grammar: CompiledGrammar | None = None,
) -> EngineRequest:
    params = sampling_params(body, max_tokens, logprobs, state.tokenizer.vocab_size)
    return EngineRequest(
        request_id=new_id(kind),
        prompt_token_ids=ids,
        params=replace(params, compiled_grammar=compiled_grammar),
        priority=priority_value(body),
        n=body.n,
        resume_token_ids=resume_ids(state, body, max_tokens),
    )


# ---- running a request ------------------------------------------------------------------------
async def _collect(
    request: Request, state: ServingState, engine_requests: list[EngineRequest]
) -> list[list[list[SequenceOutput]]]:
    """All outputs of non-streaming requests (one per prompt); aborts them all if the client
    goes away."""
    steps: list[list[list[SequenceOutput]]] = [[] for _ in engine_requests]
    outputs = [state.engine.generate(r) for r in engine_requests]

    async def consume() -> None:
        async def one(index: int) -> None:
            async for outs in outputs[index]:
                steps[index].append(outs)

        await asyncio.gather(*(one(i) for i in range(len(outputs))))

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
            for engine_request in engine_requests:
                state.engine.abort(engine_request.request_id)
    try:
        consumer.result()
    except EngineDeadError as exc:
        raise OpenAIError(500, str(exc), type="internal_error") from exc
    except asyncio.CancelledError as exc:
        raise OpenAIError(499, "client disconnected", type="client_closed") from exc
    return steps
