"""The OpenAPI document: valid 3.1, every request field in it, and served by engine and gateway."""

from __future__ import annotations

import asyncio
import re
from types import SimpleNamespace
from typing import Any, cast

import httpx
import pytest
from fastapi.routing import APIRoute
from openapi_spec_validator import validate
from pydantic import BaseModel

from servefleet.api.kv_events import EVENTS_PATH
from servefleet.api.kv_transfer import EXPORT_PATH, IMPORT_PATH, INFO_PATH, LOOKUP_PATH
from servefleet.api.kv_warm import HOT_PATH, WARM_PATH
from servefleet.api.openai_requests import REFUSED_FIELDS
from servefleet.api.openapi_batches import batch_paths
from servefleet.api.openapi_doc import OPENAPI_PATH, OPERATIONS, openapi_document
from servefleet.engine.server import build_app
from servefleet.engine.serving_state import ServingState
from servefleet.gateway.app import Gateway
from tests.test_fuzz_regressions import one_tenant_config


def _models_used(model: type[BaseModel], seen: set[type[BaseModel]]) -> set[type[BaseModel]]:
    """`model` and every model its fields hold (nested in lists, unions, dicts)."""
    seen.add(model)
    for field in model.model_fields.values():
        for found in re.findall(r"\w+", repr(field.annotation)):
            nested = _NESTED.get(found)
            if nested is not None and nested not in seen:
                _models_used(nested, seen)
    return seen


def _pydantic_models() -> dict[str, type[BaseModel]]:
    from servefleet.api import openai_messages, openai_requests

    found = {}
    for module in (openai_requests, openai_messages):
        for name, value in vars(module).items():
            if isinstance(value, type) and issubclass(value, BaseModel):
                found[name] = value
    return found


_NESTED = _pydantic_models()


def test_the_full_document_is_valid_openapi() -> None:
    document = openapi_document("t", OPERATIONS, [p for p in OPERATIONS if p.startswith("/v1/")])
    validate(cast(Any, document))
    assert document["openapi"].startswith("3.1")
    chat = document["paths"]["/v1/chat/completions"]["post"]
    assert chat["security"] == [{"bearerKey": []}]
    assert document["paths"]["/health"]["get"]["security"] == []
    event = chat["responses"]["200"]["content"]["text/event-stream"]["schema"]
    assert event["properties"]["data"] == {"type": "string"}  # one event, as before 3.2
    error = document["components"]["schemas"]["Error"]["properties"]["error"]
    assert error["required"] == ["message", "type", "param", "code"]
    for status in ("4XX", "5XX"):
        assert chat["responses"][status]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/Error"
        }
    ready = document["paths"]["/ready"]["get"]["responses"]["503"]["content"]["application/json"]
    assert ready["schema"] == {"type": "object"}  # the probe's own body, not an error
    metrics = document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain; version=0.0.4"]


def test_every_request_model_field_is_documented() -> None:
    schemas = openapi_document("t", OPERATIONS)["components"]["schemas"]
    bodies = [op.body for op in OPERATIONS.values() if op.body is not None]
    # five OpenAI-shaped requests, the two adapter control bodies, KV lookup and export,
    # KV hot and warm
    assert len(bodies) == 11
    models: set[type[BaseModel]] = set()
    for body in bodies:
        _models_used(body, models)
    assert len(models) > len(bodies)  # the nested ones (messages, tools, ...) too
    for model in models:
        schema = schemas[model.__name__]
        variants = [schema, *schema.get("anyOf", ())]  # ChatMessage: one object per role
        documented = {k for variant in variants for k in variant.get("properties", {})}
        for name, field in model.model_fields.items():
            assert (field.alias or name) in documented, f"{model.__name__}.{name}"
            for variant in variants:
                if name in REFUSED_FIELDS and name in variant.get("properties", {}):
                    assert variant["properties"][name]["type"] == "null", f"{model.__name__}"


_MESSAGES: list[dict[str, Any]] = [
    {"role": "user", "content": "hi"},
    {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}], "refusal": "no"},
    {"role": "tool", "content": "42", "tool_call_id": "c1"},
    {"role": "tool", "content": "42"},
    {"role": "user", "content": "hi", "tool_call_id": "c1"},
    {"role": "system", "content": "s", "refusal": "no"},
    {"role": "user", "content": [{"type": "refusal", "refusal": "no"}]},
    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
    {"role": "user", "content": [{"type": "text"}]},
    {"role": "user", "content": "hi", "audio": {"id": "a"}},
]


@pytest.mark.parametrize("message", _MESSAGES, ids=range(len(_MESSAGES)))
def test_the_published_message_schema_accepts_what_the_server_accepts(
    message: dict[str, Any],
) -> None:
    """A generator or fuzzer that follows the document builds messages the server takes."""
    from jsonschema import Draft202012Validator
    from pydantic import ValidationError

    from servefleet.api.openai_messages import ChatMessage

    document = openapi_document("t", OPERATIONS)
    schema = {"$ref": "#/components/schemas/ChatMessage", **document}
    published = Draft202012Validator(schema).is_valid(message)
    try:
        ChatMessage.model_validate(message)
        served = True
    except ValidationError:
        served = False
    assert published == served


def test_a_path_without_an_operation_is_an_error() -> None:
    with pytest.raises(ValueError, match="/nope"):
        openapi_document("t", ["/nope"])


def _engine_document(api_key: str | None) -> tuple[dict[str, Any], set[str]]:
    state = cast(ServingState, SimpleNamespace(api_key=api_key))
    app = build_app(state)
    routed = {
        re.sub(r"\{\w+(:path)?\}", "{model}", route.path)
        for route in app.routes
        if isinstance(route, APIRoute)
    }

    async def fetch() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://e") as client:
            keyed = {"Authorization": f"Bearer {api_key}"} if api_key else {}
            return await client.get(OPENAPI_PATH, headers=keyed)

    response = asyncio.run(fetch())
    assert response.status_code == 200
    return response.json(), routed


def test_the_engine_documents_exactly_the_paths_it_routes() -> None:
    document, routed = _engine_document(api_key="k")
    validate(document)
    assert set(document["paths"]) == routed
    assert document["info"]["title"] == "servefleet engine"
    assert document["paths"]["/v1/completions"]["post"]["security"] == [{"bearerKey": []}]
    # Every path but the probes needs the key, as enforced (`servefleet.engine.api_key`).
    assert document["paths"]["/tokenize"]["post"]["security"] == [{"bearerKey": []}]
    assert document["paths"]["/health"]["get"]["security"] == []


def test_an_engine_without_a_key_documents_no_security() -> None:
    document, _ = _engine_document(api_key=None)
    assert all(op["security"] == [] for item in document["paths"].values() for op in item.values())


def test_the_gateway_documents_its_tenant_port() -> None:
    config = one_tenant_config()
    gateway = Gateway(config)

    async def fetch() -> httpx.Response:
        transport = httpx.ASGITransport(app=cast(Any, gateway))
        async with httpx.AsyncClient(transport=transport, base_url="http://g") as client:
            return await client.get(OPENAPI_PATH)

    response = asyncio.run(fetch())
    assert response.status_code == 200
    document = response.json()
    validate(document)
    assert "/metrics" not in document["paths"]  # the internal port's
    # adapters are loaded on engines by the platform, never through the tenant port; KV
    # blocks move between engines only
    engine_only = {"/metrics", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"}
    engine_only |= {INFO_PATH, LOOKUP_PATH, EXPORT_PATH, IMPORT_PATH, HOT_PATH, WARM_PATH}
    engine_only.add(EVENTS_PATH)
    assert set(document["paths"]) == set(OPERATIONS) - engine_only | set(batch_paths())
    for path in ("/tokenize", "/v1/models", "/v1/chat/completions"):
        assert next(iter(document["paths"][path].values()))["security"] == [{"bearerKey": []}]
    assert document["paths"]["/health"]["get"]["security"] == []
