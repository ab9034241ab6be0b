"""Chat messages of an OpenAI request, validated once for the engine and the gateway.

The models served here read text only, so a content part of any other type (`image_url`,
`input_audio`, `file`, ...) is refused with a 400 that names the part, never dropped or
counted. An assistant message may carry a `refusal` part (OpenAI accepts one in history);
its text is what the chat template sees. Tool calls and tool results are typed here so the
engine can render them with the model's chat template.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

ContentParts = list[dict[str, Any]]

# part type -> the keys that part carries (besides "type")
_PART_KEYS: dict[str, str] = {"text": "text", "refusal": "refusal"}
_WHY_REFUSED = {"function_call": "; send tool_calls instead", "audio": "; it reads text only"}


class StrictModel(BaseModel):
    """Every request body: unknown fields are errors and nothing is coerced ("1" is no int)."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


def _known_parts_only(content: str | ContentParts | None) -> str | ContentParts | None:
    if not isinstance(content, list):
        return content
    for index, part in enumerate(content):
        kind = part.get("type")
        key = _PART_KEYS.get(kind) if isinstance(kind, str) else None
        if key is None:
            raise PydanticCustomError(
                "unsupported_content_part",
                "content part {index} has type {kind}: this model reads text only, so "
                "only 'text' parts are accepted",
                {"index": index, "kind": repr(kind)},
            )
        if not isinstance(part.get(key), str):
            raise PydanticCustomError(
                "text_part_without_text",
                "content part {index} of type {kind} has no string {key}",
                {"index": index, "kind": repr(kind), "key": repr(key)},
            )
        extra = sorted(set(part) - {"type", key})
        if extra:
            raise PydanticCustomError(
                "unknown_part_field",
                "content part {index} has unrecognized field {field}",
                {"index": index, "field": repr(extra[0])},
            )
    return content


MessageContent = Annotated[str | ContentParts | None, AfterValidator(_known_parts_only)]


class FunctionCall(StrictModel):
    name: str = Field(min_length=1)
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(StrictModel):
    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: FunctionCall


def _part(kind: str) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"type": {"const": kind}, kind: {"type": "string"}},
        "required": ["type", kind],
        "additionalProperties": False,
    }


def _role_variants(schema: dict[str, Any]) -> None:
    """Document what the validators below enforce, one object per role group, so a client
    generator (or a fuzzer) builds valid messages: which fields each role carries, that a
    tool message needs `tool_call_id`, and that content parts are `text` (or `refusal` on an
    assistant). The model itself stays one class; only its published schema is split."""
    props = schema.pop("properties")
    schema.pop("required", None)
    schema.pop("additionalProperties", None)
    schema.pop("type", None)

    def variant(roles: list[str], parts: list[str], extra: dict[str, Any]) -> dict[str, Any]:
        array = {"type": "array", "items": {"anyOf": [_part(k) for k in parts]}}
        content = {"anyOf": [{"type": "string"}, array, {"type": "null"}]}
        fields: dict[str, Any] = {"role": {"type": "string", "enum": roles}, "content": content}
        fields |= {"name": props["name"], "function_call": props["function_call"]}
        fields |= {"audio": props["audio"], **extra}
        required = ["role", *(k for k in extra if k == "tool_call_id")]
        return {
            "type": "object",
            "properties": fields,
            "required": required,
            "additionalProperties": False,
        }

    assistant = {"tool_calls": props["tool_calls"], "refusal": props["refusal"]}
    schema["anyOf"] = [
        variant(["system", "user", "developer"], ["text"], {}),
        variant(["assistant"], ["text", "refusal"], assistant),
        variant(["tool"], ["text"], {"tool_call_id": {"type": "string"}}),
    ]


class ChatMessage(StrictModel):
    model_config = ConfigDict(json_schema_extra=_role_variants)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: MessageContent = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant
    tool_call_id: str | None = None  # tool
    refusal: str | None = None  # assistant
    function_call: Any = None  # legacy: refused below
    audio: Any = None  # refused below

    @field_validator("function_call", "audio")
    @classmethod
    def _refused(cls, value: Any, info: Any) -> Any:
        if value is not None:
            raise PydanticCustomError(
                "unsupported_field",
                "{field} is not supported by this server{why}",
                {"field": info.field_name, "why": _WHY_REFUSED.get(info.field_name, "")},
            )
        return value

    @model_validator(mode="after")
    def _fields_fit_the_role(self) -> ChatMessage:
        if self.role != "assistant":
            for name in ("tool_calls", "refusal"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} is only accepted on assistant messages")
            if isinstance(self.content, list) and any(
                p.get("type") == "refusal" for p in self.content
            ):
                raise ValueError("refusal content parts are only accepted on assistant messages")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs tool_call_id")
        if self.role != "tool" and self.tool_call_id is not None:
            raise ValueError("tool_call_id is only accepted on tool messages")
        return self


def content_text(content: str | list[dict[str, Any]] | None) -> str:
    """The text of validated content: the string itself, text parts joined, null as ''."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(str(part.get("text", part.get("refusal", ""))) for part in content)
