"""What a request constrains its output to, before anything is compiled.

A `ConstraintSpec` is plain data: the grammar cache keys compiled grammars by it, so two
requests with the same schema share one compilation. It comes from `response_format`,
vLLM's `guided_*` extensions, or a forced tool choice (`tool_calls.tool_constraint`).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from servefleet.api.openai_requests import (
    ChatCompletionRequest,
    JsonObjectResponseFormat,
    JsonSchemaResponseFormat,
    SamplingRequest,
)

ConstraintKind = Literal["json_object", "json_schema", "regex", "choice", "grammar"]


class ConstraintSpec(BaseModel):
    """One output constraint; `value` is JSON schema text, a regex, JSON choices or EBNF."""

    model_config = ConfigDict(frozen=True)

    kind: ConstraintKind
    value: str = ""
    param: str = "response_format"  # the request field it came from, for error messages


class ConstraintError(ValueError):
    """The constraint cannot be compiled: a 400 naming `param`."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _schema_text(schema: dict[str, Any] | str) -> str:
    return schema if isinstance(schema, str) else json.dumps(schema, sort_keys=True)


def requested_constraint(body: SamplingRequest) -> ConstraintSpec | None:
    """The constraint from `response_format` or a `guided_*` field; None when free text."""
    if body.guided_json is not None:
        return ConstraintSpec(
            kind="json_schema", value=_schema_text(body.guided_json), param="guided_json"
        )
    if body.guided_regex is not None:
        return ConstraintSpec(kind="regex", value=body.guided_regex, param="guided_regex")
    if body.guided_choice is not None:
        return ConstraintSpec(
            kind="choice", value=json.dumps(body.guided_choice), param="guided_choice"
        )
    if body.guided_grammar is not None:
        return ConstraintSpec(kind="grammar", value=body.guided_grammar, param="guided_grammar")
    fmt = body.response_format if isinstance(body, ChatCompletionRequest) else None
    if isinstance(fmt, JsonObjectResponseFormat):
        return ConstraintSpec(kind="json_object")
    if isinstance(fmt, JsonSchemaResponseFormat):
        schema = fmt.json_schema.schema_
        if schema is None:
            return ConstraintSpec(kind="json_object")
        return ConstraintSpec(kind="json_schema", value=_schema_text(schema))
    return None
