"""The gateway's Files and Batch API in its OpenAPI document (`servefleet.api.batches`).

Kept beside `openapi_doc` rather than in its table: these paths take several methods each,
a multipart upload and path ids, which the engine's one-operation-per-path table does not.
"""

from __future__ import annotations

from typing import Any

from pydantic.json_schema import models_json_schema

from servefleet.api.batches import BatchCreateRequest
from servefleet.api.openapi_doc import ERROR_SCHEMA, SCHEMA_REF, SECURITY_SCHEME

_ERROR_REF = {"$ref": SCHEMA_REF.format(model=ERROR_SCHEMA)}
_OBJECT = {"type": "object"}


def _id(name: str) -> dict[str, Any]:
    return {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}


def _query(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "schema": schema}


_LIMIT = _query("limit", {"type": "integer", "minimum": 1, "maximum": 100})
_AFTER = _query("after", {"type": "string"})
_UPLOAD = {
    "type": "object",
    "required": ["purpose", "file"],
    "additionalProperties": False,
    "properties": {
        "purpose": {"type": "string", "enum": ["batch"]},
        "file": {"type": "string", "contentMediaType": "application/octet-stream"},
    },
}


def _op(
    operation_id: str,
    summary: str,
    *,
    parameters: list[dict[str, Any]] | None = None,
    body: dict[str, Any] | None = None,
    body_type: str = "application/json",
    answer_type: str = "application/json",
) -> dict[str, Any]:
    error = {"content": {"application/json": {"schema": _ERROR_REF}}}
    answer = {"type": "string"} if answer_type != "application/json" else _OBJECT
    spec: dict[str, Any] = {
        "operationId": operation_id,
        "summary": summary,
        "responses": {
            "200": {"description": "OK", "content": {answer_type: {"schema": answer}}},
            "4XX": {"description": "Refused: OpenAI's error body", **error},
            "5XX": {"description": "Unavailable or failed: OpenAI's error body", **error},
        },
        "security": [{SECURITY_SCHEME: []}],
    }
    if parameters:
        spec["parameters"] = parameters
    if body is not None:
        spec["requestBody"] = {"required": True, "content": {body_type: {"schema": body}}}
    return spec


def batch_paths() -> dict[str, dict[str, Any]]:
    """path -> method -> operation, for the gateway's document."""
    create = {"$ref": SCHEMA_REF.format(model=BatchCreateRequest.__name__)}
    file_id, batch_id = _id("file_id"), _id("batch_id")
    purpose = _query("purpose", {"type": "string"})
    order = _query("order", {"type": "string", "enum": ["asc", "desc"]})
    return {
        "/v1/files": {
            "get": _op("listFiles", "List your files", parameters=[purpose, _LIMIT, _AFTER, order]),
            "post": _op(
                "createFile",
                "Upload a batch input file (JSONL)",
                body=_UPLOAD,
                body_type="multipart/form-data",
            ),
        },
        "/v1/files/{file_id}": {
            "get": _op("retrieveFile", "A file of yours", parameters=[file_id]),
            "delete": _op("deleteFile", "Delete a file of yours", parameters=[file_id]),
        },
        "/v1/files/{file_id}/content": {
            "get": _op(
                "downloadFile",
                "A file's bytes",
                parameters=[file_id],
                answer_type="application/octet-stream",
            ),
        },
        "/v1/batches": {
            "get": _op("listBatches", "List your batches", parameters=[_LIMIT, _AFTER]),
            "post": _op("createBatch", "Create a batch from an uploaded file", body=create),
        },
        "/v1/batches/{batch_id}": {
            "get": _op("retrieveBatch", "A batch of yours", parameters=[batch_id]),
        },
        "/v1/batches/{batch_id}/cancel": {
            "post": _op("cancelBatch", "Cancel an open batch", parameters=[batch_id]),
        },
    }


def batch_schemas() -> dict[str, Any]:
    """The request bodies' JSON Schemas, by component name."""
    _, top = models_json_schema([(BatchCreateRequest, "validation")], ref_template=SCHEMA_REF)
    schemas: dict[str, Any] = top.get("$defs", {})
    return schemas


def with_batches(document: dict[str, Any]) -> dict[str, Any]:
    """`document` (the gateway's) with the Files and Batch API added."""
    document["paths"].update(batch_paths())
    document["components"]["schemas"].update(batch_schemas())
    return document
