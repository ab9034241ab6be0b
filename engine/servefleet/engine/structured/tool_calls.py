"""`tools` / `tool_choice` of a chat request -> what to constrain, and text -> tool calls.

`required` and a named function are enforced by constrained decoding, so the arguments are
valid JSON for the function's schema every time: a named choice generates the arguments
object itself, `required` an array of `{"name", "parameters"}` objects (at most one when
`parallel_tool_calls` is false). `auto` lets the model write its own format, which the
chosen parser (`tool_parsers`) reads back; `none` renders no tools and parses nothing.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from servefleet.api.openai_requests import ChatCompletionRequest, NamedToolChoice, Tool
from servefleet.engine.structured.constraint import ConstraintError, ConstraintSpec
from servefleet.engine.structured.tool_parsers import PARSERS, ParsedCall, ParsedOutput

_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class ToolPlan(BaseModel):
    """How one request uses its tools."""

    model_config = ConfigDict(frozen=True)

    mode: Literal["auto", "required", "named"]
    tools: tuple[Tool, ...]
    function: str | None = None  # the named function
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.mode != "auto"


def tool_plan(body: ChatCompletionRequest) -> ToolPlan | None:
    """None when the request offers no tools or says `tool_choice: "none"`."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise ConstraintError("tool_choice needs tools", "tool_choice")
        return None
    if choice == "none":
        return None
    parallel = body.parallel_tool_calls is not False
    tools = tuple(body.tools)
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in {t.function.name for t in tools}:
            raise ConstraintError(
                f"tool_choice names {name!r}, which is not in tools", "tool_choice"
            )
        return ToolPlan(mode="named", tools=tools, function=name, parallel=parallel)
    return ToolPlan(mode=choice or "auto", tools=tools, parallel=parallel)


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or _EMPTY_PARAMETERS


def tool_constraint(plan: ToolPlan) -> ConstraintSpec | None:
    """The grammar a forced choice decodes under; None for `auto`."""
    if plan.mode == "named":
        tool = next(t for t in plan.tools if t.function.name == plan.function)
        parameters = json.dumps(_parameters(tool), sort_keys=True)
        return ConstraintSpec(kind="json_schema", value=parameters, param="tools")
    if plan.mode == "required":
        item = {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "enum": [t.function.name]},
                        "parameters": _parameters(t),
                    },
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for t in plan.tools
            ]
        }
        schema: dict[str, Any] = {"type": "array", "items": item, "minItems": 1}
        if not plan.parallel:
            schema["maxItems"] = 1
        return ConstraintSpec(kind="json_schema", value=json.dumps(schema), param="tools")
    return None


def parse_tool_output(plan: ToolPlan, text: str, parser: str) -> ParsedOutput:
    """Content and calls of a finished answer under this plan."""
    if plan.mode == "named":  # the constrained text is the arguments object itself
        return ParsedOutput(
            content=None, calls=[ParsedCall(name=plan.function or "", arguments=text)]
        )
    if plan.mode == "required":
        try:
            items = json.loads(text)
        except ValueError:
            return ParsedOutput(content=text, calls=[])
        calls = [
            ParsedCall(name=i["name"], arguments=json.dumps(i["parameters"], ensure_ascii=False))
            for i in items
        ]
        return ParsedOutput(content=None, calls=calls)
    parsed = PARSERS[parser](text)
    if not plan.parallel and len(parsed.calls) > 1:
        parsed = ParsedOutput(content=parsed.content, calls=parsed.calls[:1])
    return parsed


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call_dicts(calls: list[ParsedCall]) -> list[dict[str, Any]]:
    """OpenAI's `message.tool_calls`."""
    return [
        {
            "id": new_call_id(),
            "type": "function",
            "function": {"name": c.name, "arguments": c.arguments},
        }
        for c in calls
    ]
