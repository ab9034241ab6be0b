"""FastAPI routes: generation (chat, completions), health, readiness and metrics.

Every request passes `request_checks` before it reaches the engine (bounded body, the shared
request models, model name, queue room for its sequences) and `preparation` (context length,
template, tokens, grammar: bounded, and off the event loop when big), so the engine only gets
work it can finish; anything else is answered at once with an OpenAI-style error. The other
endpoints (one model, /version, /tokenize, /detokenize, embeddings) are `extra_routes`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from servefleet.api.chargeback import TENANT_HEADER, tenant_label
from servefleet.api.kv_warm import WARMING_DETAIL
from servefleet.api.openai_errors import OpenAIError
from servefleet.api.openai_requests import ChatCompletionRequest, CompletionRequest, SamplingRequest
from servefleet.api.openai_wire import HeaderLimit
from servefleet.engine.api_key import ApiKeyMiddleware
from servefleet.engine.extra_routes import add_extra_routes
from servefleet.engine.kv_event_routes import add_kv_event_routes
from servefleet.engine.kv_puller import check_kv_transfer, pull_prefix
from servefleet.engine.kv_routes import add_kv_routes
from servefleet.engine.kv_warm import add_kv_warm_routes
from servefleet.engine.loop import EngineDeadError, EngineRequest, SequenceOutput
from servefleet.engine.lora.adapter import LoraAdapter
from servefleet.engine.lora_routes import add_lora_routes, model_cards
from servefleet.engine.preparation import (
    Prepared,
    check_chat,
    check_completion,
    prepare_chat,
    prepare_completion,
)
from servefleet.engine.protocol import new_id, priority_value, sampling_params
from servefleet.engine.request_checks import admit, check_room, parse, resume_ids
from servefleet.engine.responses import chat_response, completion_response, stream_response
from servefleet.engine.serving_state import ServingState

log = logging.getLogger("servefleet.engine.server")


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
    add_lora_routes(app, state)
    add_kv_routes(app, state)
    add_kv_warm_routes(app, state)
    add_kv_event_routes(app, state)
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
        return _error_response(OpenAIError(status=400, message=message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """The router's own refusals: an unknown path (404), a known one asked with another
        method (405, with the methods it takes in `Allow`)."""
        if exc.status_code == 405:
            allow = (exc.headers or {}).get("Allow", "")
            message = f"{request.method} is not allowed on {request.url.path}; use {allow}"
            return _error_response(
                OpenAIError(
                    status=405, message=message, code="method_not_allowed", headers={"Allow": allow}
                )
            )
        code = "not_found" if exc.status_code == 404 else None
        return _error_response(
            OpenAIError(
                status=exc.status_code, message=str(exc.detail), type="not_found", code=code
            )
        )

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        """A bug answers in OpenAI's shape too, not the plain-text 500 page (still logged)."""
        log.error("internal_error %s %s: %r", request.method, request.url.path, exc)
        return _error_response(
            OpenAIError(
                status=500,
                message="Internal error in the engine (logged there).",
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
        if state.kv_warm is not None and state.kv_warm.warming():
            return JSONResponse({"ready": False, "detail": WARMING_DETAIL}, 503)
        return JSONResponse({"ready": True})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.engine.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": model_cards(state)}


def _add_generation_routes(app: FastAPI, state: ServingState) -> None:
    @app.post("/v1/chat/completions", response_model=None)
    async def chat(request: Request) -> Response:
        body = await parse(request, ChatCompletionRequest)
        request_id = new_id("chatcmpl")
        adapter = admit(state, body.model, body.n)
        check_kv_transfer(state, body.kv_transfer_params)
        inline = check_chat(state, body)  # messages that cannot fit: refused before the template
        prepared = await state.preparer.run(
            lambda budget: prepare_chat(state, body, budget),
            request_id=request_id,
            param="messages",
            inline=inline,
        )
        check_room(state, body.n)  # the queue may have filled while this was prepared
        (engine_request,) = _engine_requests(
            state, body, prepared, body.num_logprobs, request_id, adapter, billed(request, state)
        )
        await pull_prefix(state, body.kv_transfer_params, engine_request)
        if body.stream:
            return stream_response(state, [engine_request], body, chat=True)
        outputs = await _collect(request, state, [engine_request])
        return JSONResponse(chat_response(state, engine_request, outputs[0], body))

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        body = await parse(request, CompletionRequest)
        request_id = new_id("cmpl")
        sequences = body.n * len(body.prompts())
        adapter = admit(state, body.model, sequences, "n" if len(body.prompts()) == 1 else "prompt")
        check_kv_transfer(state, body.kv_transfer_params)
        inline = check_completion(state, body)  # prompts that cannot fit: refused untokenized
        prepared = await state.preparer.run(
            lambda budget: prepare_completion(state, body, budget),
            request_id=request_id,
            param="prompt",
            inline=inline,
        )
        check_room(state, sequences)
        engine_requests = _engine_requests(
            state, body, prepared, body.logprobs, request_id, adapter, billed(request, state)
        )
        for engine_request in engine_requests:
            await pull_prefix(state, body.kv_transfer_params, engine_request)
        if body.stream:
            return stream_response(state, engine_requests, body, chat=False)
        outputs = await _collect(request, state, engine_requests)
        return JSONResponse(completion_response(state, engine_requests, outputs, body))


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or None
    return f"{loc or 'body'}: {first.get('msg', 'invalid request')}", loc


def billed(request: Request, state: ServingState) -> str:
    """The tenant the gateway stamped, honoured only where the engine requires its key (so
    only a key holder can have sent it); else `UNATTRIBUTED` (`servefleet.api.chargeback`)."""
    return tenant_label(request.headers.get(TENANT_HEADER), trusted=bool(state.api_key))


def _engine_requests(
    state: ServingState,
    body: SamplingRequest,
    prepared: Prepared,
    logprobs: int | None,
    request_id: str,
    adapter: LoraAdapter | None,
    tenant: str,
) -> list[EngineRequest]:
    """One engine request per prompt: the first keeps the request's id (its logs name it)."""
    requests = []
    for index, prompt in enumerate(prepared.prompts):
        params = sampling_params(body, prompt.max_tokens, logprobs, state.tokenizer.vocab_size)
        requests.append(
            EngineRequest(
                request_id=request_id if index == 0 else f"{request_id}-{index}",
                prompt_token_ids=prompt.ids,
                params=replace(params, compiled_grammar=prepared.grammar),
                priority=priority_value(body),
                n=body.n,
                resume_token_ids=resume_ids(state, body, prompt.max_tokens),
                lora=adapter,
                tenant=tenant,
                cache_salt=body.cache_salt,
            )
        )
    return requests


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
        left = not consumer.done()
        if left:
            consumer.cancel()
            for engine_request in engine_requests:
                state.engine.abort(engine_request.request_id)
    if left:
        # cancel() only asks: the task is done once it has run its cancellation (reading its
        # result before that raised InvalidStateError, a traceback per disconnect).
        with contextlib.suppress(asyncio.CancelledError):
            await consumer
        raise OpenAIError(status=499, message="client disconnected", type="client_closed")
    try:
        consumer.result()
    except EngineDeadError as exc:
        raise OpenAIError(status=500, message=str(exc), type="internal_error") from exc
    return steps
