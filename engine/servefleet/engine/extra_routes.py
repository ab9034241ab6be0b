"""The API beyond generation: one model's card, /version, /tokenize, /detokenize, embeddings,
and the OpenAPI document of them all (`servefleet.api.openapi_doc`).

Shapes follow OpenAI (`GET /v1/models/{id}`, `POST /v1/embeddings`) and vLLM (`/version`,
`/tokenize`, `/detokenize`), so clients written for either work unchanged. Bodies are the
shared request models, checked like every other request (`request_checks`), and bounded the
same way (`preparation`): a text that cannot fit the context is refused before it is
tokenized, at most `max_model_len` ids are detokenized, and big inputs are tokenized on the
preparation workers, not on the event loop.
"""

from __future__ import annotations

import base64
import struct
from functools import partial
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request

from servefleet.api.openai_errors import OpenAIError
from servefleet.api.openai_messages import content_text
from servefleet.api.openai_requests import DetokenizeRequest, EmbeddingRequest, TokenizeRequest
from servefleet.api.openai_version import version_body
from servefleet.api.openapi_doc import OPENAPI_PATH, OPERATIONS, openapi_document
from servefleet.api.request_caps import utf8_len
from servefleet.engine.api_key import is_protected
from servefleet.engine.embedder import embed
from servefleet.engine.lora_routes import model_cards
from servefleet.engine.preparation import (
    INLINE_PREPARE_BYTES,
    check_fits,
    check_ids_fit,
    check_inputs_fit,
)
from servefleet.engine.prepare_pool import Budget
from servefleet.engine.protocol import new_id, usage
from servefleet.engine.request_checks import (
    admit,
    model_not_found,
    parse,
    prompt_ids,
    resolve_model,
)
from servefleet.text.messages import template_messages

if TYPE_CHECKING:
    from servefleet.engine.serving_state import ServingState


def add_extra_routes(app: FastAPI, state: ServingState) -> None:
    @app.get("/v1/models/{model_id:path}")
    async def one_model(model_id: str) -> dict[str, Any]:
        for card in model_cards(state):
            if card["id"] == model_id:
                return card
        raise model_not_found(model_id)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return version_body()

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await parse(request, TokenizeRequest)
        _check_model(state, body.model)
        size = _tokenize_bytes(state, body)
        tokens = await state.preparer.run(
            lambda budget: _tokenize(state, body, budget),
            request_id=new_id("tokenize"),
            param="prompt" if body.prompt is not None else "messages",
            inline=size <= INLINE_PREPARE_BYTES,
        )
        strs = [state.tokenizer.id_to_token(t) or "" for t in tokens]
        return {
            "count": len(tokens),
            "max_model_len": state.max_model_len,
            "tokens": tokens,
            "token_strs": strs if body.return_token_strs else None,
        }

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        body = await parse(request, DetokenizeRequest)
        _check_model(state, body.model)
        check_ids_fit(state, len(body.tokens), "tokens")
        vocab = state.tokenizer.vocab_size
        bad = [t for t in body.tokens if t >= vocab]
        if bad:
            raise OpenAIError(
                status=400,
                message=f"tokens: ids out of range [0, {vocab}): {bad[:5]}",
                param="tokens",
            )
        return {"prompt": state.tokenizer.decode(body.tokens)}

    _add_embeddings_route(app, state)
    _add_openapi_route(app, state)


def _add_openapi_route(app: FastAPI, state: ServingState) -> None:
    """The engine routes every documented path; with --api-key all but the probes need it."""
    keyed = [p for p in OPERATIONS if is_protected(p)] if state.api_key else []
    document = openapi_document("servefleet engine", OPERATIONS, keyed)

    @app.get(OPENAPI_PATH)
    async def openapi() -> dict[str, Any]:
        return document


def _add_embeddings_route(app: FastAPI, state: ServingState) -> None:
    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> dict[str, Any]:
        body = await parse(request, EmbeddingRequest)
        if state.engine.runner.world_size > 1:  # one rank's hidden states are not the model's
            raise OpenAIError(
                status=400, message="embeddings are not served by a tensor-parallel engine",
                param="input",
            )  # fmt: skip
        if admit(state, body.model) is not None:
            raise OpenAIError(
                status=400, message="model: embeddings come from the base model, not an adapter",
                param="model",
            )  # fmt: skip
        inputs = body.inputs()
        size = check_inputs_fit(state, inputs, "input")
        prompts = await state.preparer.run(
            lambda budget: _embedding_ids(state, inputs, budget),
            request_id=new_id("embd"),
            param="input",
            inline=size <= INLINE_PREPARE_BYTES,
        )
        runner = state.engine.runner
        data = []
        for index, ids in enumerate(prompts):
            vector = await state.engine.call(partial(embed, runner, ids))
            data.append({"object": "embedding", "index": index,
                         "embedding": _encode(vector, body.encoding_format)})  # fmt: skip
        prompt_tokens = sum(len(ids) for ids in prompts)
        used = usage(prompt_tokens, 0)
        return {
            "object": "list",
            "data": data,
            "model": state.served_model_name,
            "usage": {"prompt_tokens": used["prompt_tokens"], "total_tokens": used["total_tokens"]},
        }


def _embedding_ids(
    state: ServingState, inputs: list[str | list[int]], budget: Budget
) -> list[list[int]]:
    """Token ids of every input; each is embedded whole, so it must fit the context."""
    prompts = []
    for item in inputs:
        ids = prompt_ids(state, item, "input")
        budget.check("input", "tokenization")
        check_ids_fit(state, len(ids), "input")
        prompts.append(ids)
    return prompts


def _check_model(state: ServingState, model: str | None) -> None:
    """The base model or an adapter: both tokenize alike."""
    resolve_model(state, model)


def _tokenize_bytes(state: ServingState, body: TokenizeRequest) -> int:
    """The text's size, refused when it cannot fit the context (nothing tokenizes it then)."""
    if body.prompt is not None:
        size = utf8_len(body.prompt)
        check_fits(state, size, "prompt")
        return size
    assert body.messages is not None
    size = sum(utf8_len(content_text(m.content)) for m in body.messages)
    check_fits(state, size, "messages")
    return size


def _tokenize(state: ServingState, body: TokenizeRequest, budget: Budget) -> list[int]:
    if body.prompt is not None:
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        return state.tokenizer.encode(body.prompt, add_special_tokens=add_special)
    assert body.messages is not None
    messages = template_messages([m.model_dump() for m in body.messages])
    text = state.render_prompt(messages, add_generation_prompt=body.add_generation_prompt)
    budget.check("messages", "chat template")
    check_fits(state, utf8_len(text), "messages")
    return state.tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    """float: the list; base64: little-endian float32 bytes, as OpenAI sends them."""
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
