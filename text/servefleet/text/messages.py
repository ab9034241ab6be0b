"""Chat message content -> the text a chat template renders, for the engine and the gateway.

A message's `content` is a string, null, or a list of typed parts. The models served here
read text only, so a part of any other type (`image_url`, `input_audio`, `file`, ...) is
refused when the request is validated, with a 400 that names the part, never dropped or
counted: every request field is honoured or refused. `MessageContent` is that validated type;
both the engine's and the gateway's request models use it, so both answer the same.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, Any

from pydantic import AfterValidator
from pydantic_core import PydanticCustomError

ContentParts = list[dict[str, Any]]


def _text_parts_only(content: str | ContentParts | None) -> str | ContentParts | None:
    if not isinstance(content, list):
        return content
    for index, part in enumerate(content):
        kind = part.get("type")
        if kind != "text":
            raise PydanticCustomError(
                "unsupported_content_part",
                "content part {index} has type {kind}: this model reads text only, so "
                "only 'text' parts are accepted",
                {"index": index, "kind": repr(kind)},
            )
        if not isinstance(part.get("text"), str):
            raise PydanticCustomError(
                "text_part_without_text",
                "content part {index} of type 'text' has no string 'text'",
                {"index": index},
            )
    return content


MessageContent = Annotated[str | ContentParts | None, AfterValidator(_text_parts_only)]


def content_text(content: str | Sequence[Mapping[str, Any]] | None) -> str:
    """The text of validated content: the string itself, text parts joined, null as ''."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(str(part["text"]) for part in content)


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    """Role and text of each validated message: what a chat template is given."""
    return [
        {"role": str(message.get("role", "")), "content": content_text(message.get("content"))}
        for message in messages
    ]
