"""The OpenAPI 3.1 document of the HTTP API, built once from the shared request models.

The engine and the gateway answer the same OpenAI paths with the same request models
(`servefleet.api.openai_requests`), so the document is written once here and each server
serves only the paths it routes (`openapi_document`). Request bodies are the models' own JSON
Schemas, so a field added to a model appears in the document without another edit; every 4xx
and 5xx is OpenAI's error shape (`servefleet.api.openai_errors.error_body`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from copy import deepcopy
from dataclasses import dataclass
from functools import cache
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from servefleet.api.kv_events import EVENTS_PATH
from servefleet.api.kv_transfer import (
    EXPORT_PATH,
    IMPORT_PATH,
    INFO_PATH,
    LOOKUP_PATH,
    MEDIA_TYPE,
    KVHashesRequest,
)
from servefleet.api.kv_warm import HOT_PATH, WARM_PATH, KVHotRequest, KVWarmRequest
from servefleet.api.lora import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from servefleet.api.openai_requests import (
    REFUSED_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    SamplingRequest,
    TokenizeRequest,
)
from servefleet.api.openai_version import version_body

OPENAPI_PATH = "/openapi.json"
SCHEMA_REF = "#/components/schemas/{model}"
ERROR_SCHEMA = "Error"
SECURITY_SCHEME = "bearerKey"
PROMETHEUS_TEXT = "text/plain; version=0.0.4"
EVENT_STREAM = "text/event-stream"

_ERROR: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
_JSON_OBJECT: dict[str, Any] = {"type": "object"}
# Before OpenAPI 3.2 an event stream's `schema` describes one event (3.2's `itemSchema`).
_SSE_EVENT: dict[str, Any] = {
    "type": "object",
    "required": ["data"],
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
}


@dataclass(frozen=True, slots=True)
class Operation:
    """One method on one path: its body model (if any), what it answers, and with what type."""

    method: str
    summary: str
    body: type[BaseModel] | None = None
    media_type: str = "application/json"
    parameters: tuple[dict[str, Any], ...] = ()
    probe: bool = False  # a 503 is the probe's own body ("not ready: why"), not an error


_MODEL_ID = {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}

OPERATIONS: dict[str, Operation] = {
    "/v1/chat/completions": Operation("post", "Create a chat completion", ChatCompletionRequest),
    "/v1/completions": Operation("post", "Create a text completion", CompletionRequest),
    "/v1/embeddings": Operation("post", "Embed text or token ids", EmbeddingRequest),
    "/tokenize": Operation("post", "Token ids of a prompt or messages", TokenizeRequest),
    "/detokenize": Operation("post", "Text of token ids", DetokenizeRequest),
    "/v1/models": Operation("get", "List the models served"),
    "/v1/models/{model}": Operation("get", "One model's card", parameters=(_MODEL_ID,)),
    "/version": Operation("get", "Server and API versions"),
    "/v1/load_lora_adapter": Operation(
        "post", "Load a LoRA adapter (vLLM's)", LoadLoraAdapterRequest
    ),
    "/v1/unload_lora_adapter": Operation(
        "post", "Unload a LoRA adapter (vLLM's)", UnloadLoraAdapterRequest
    ),
    INFO_PATH: Operation("get", "This engine's KV cache fingerprint and transfer limits"),
    LOOKUP_PATH: Operation("post", "How many leading KV blocks are cached", KVHashesRequest),
    EXPORT_PATH: Operation(
        "post", "Stream the cached leading KV blocks", KVHashesRequest, media_type=MEDIA_TYPE
    ),
    IMPORT_PATH: Operation("post", f"Import a pushed {MEDIA_TYPE} stream of KV blocks"),
    HOT_PATH: Operation("post", "This cache's hottest KV block chains", KVHotRequest),
    WARM_PATH: Operation("post", "Pull peers' hottest KV chains, then be ready", KVWarmRequest),
    EVENTS_PATH: Operation(
        "get", "This cache's KV block events (stored, removed, cleared)", media_type=EVENT_STREAM
    ),
    "/health": Operation("get", "Liveness", probe=True),
    "/ready": Operation("get", "Readiness", probe=True),
    "/metrics": Operation("get", "Prometheus metrics", media_type=PROMETHEUS_TEXT),
    OPENAPI_PATH: Operation("get", "This document"),
}


@cache
def _request_schemas() -> dict[str, Any]:
    """Every request model's JSON Schema (and the models they use), by component name."""
    models = [op.body for op in OPERATIONS.values() if op.body is not None]
    _, top = models_json_schema([(m, "validation") for m in models], ref_template=SCHEMA_REF)
    schemas: dict[str, Any] = top.get("$defs", {})
    for schema in schemas.values():
        for variant in [schema, *schema.get("anyOf", ())]:  # ChatMessage: one per role
            _document_refused(variant.get("properties", {}))
    return schemas


def _document_refused(properties: dict[str, Any]) -> None:
    """A refused field (`REFUSED_FIELDS`) is accepted only as null: say so, and why."""
    for name in properties.keys() & REFUSED_FIELDS.keys():
        why = REFUSED_FIELDS[name]
        properties[name] = {"type": "null", "description": f"Refused unless null: {why}."}


def _responses(operation: Operation) -> dict[str, Any]:
    error_ref = {"$ref": SCHEMA_REF.format(model=ERROR_SCHEMA)}
    error = {"content": {"application/json": {"schema": error_ref}}}
    if operation.media_type == EVENT_STREAM:
        ok_schema: dict[str, Any] = _SSE_EVENT
    elif operation.media_type in (PROMETHEUS_TEXT, MEDIA_TYPE):
        ok_schema = {"type": "string"}
    else:
        ok_schema = _JSON_OBJECT
    content = {operation.media_type: {"schema": ok_schema}}
    if operation.body is not None and issubclass(operation.body, SamplingRequest):
        content[EVENT_STREAM] = {"schema": _SSE_EVENT}  # "stream": true
    ok = {"description": "OK", "content": content}
    responses = {
        "200": ok,
        "4XX": {"description": "Refused: OpenAI's error body", **error},
        "5XX": {"description": "Unavailable or failed: OpenAI's error body", **error},
    }
    if operation.probe:
        not_ready = {"application/json": {"schema": _JSON_OBJECT}}
        responses["503"] = {"description": "Not live or not ready, and why", "content": not_ready}
    return responses


def _operation(path: str, operation: Operation, keyed: bool) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "operationId": operation.method + path.replace("/", "_").replace("{", "").replace("}", ""),
        "summary": operation.summary,
        "responses": _responses(operation),
    }
    if operation.parameters:
        spec["parameters"] = list(operation.parameters)
    if operation.body is not None:
        ref = {"$ref": SCHEMA_REF.format(model=operation.body.__name__)}
        spec["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref}}}
    spec["security"] = [{SECURITY_SCHEME: []}] if keyed else []
    return spec


def openapi_document(
    title: str, paths: Iterable[str], keyed_paths: Collection[str] = ()
) -> dict[str, Any]:
    """The document for a server that routes `paths` (each a key of `OPERATIONS`), where
    `keyed_paths` need `Authorization: Bearer KEY`."""
    served = list(paths)
    unknown = [p for p in served if p not in OPERATIONS]
    if unknown:
        raise ValueError(f"no operation is defined for {unknown}")
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version_body()["version"]},
        "paths": {
            path: {OPERATIONS[path].method: _operation(path, OPERATIONS[path], path in keyed_paths)}
            for path in served
        },
        "components": {
            "schemas": deepcopy({ERROR_SCHEMA: _ERROR, **_request_schemas()}),
            "securitySchemes": {SECURITY_SCHEME: {"type": "http", "scheme": "bearer"}},
        },
    }
