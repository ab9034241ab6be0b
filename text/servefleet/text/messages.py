"""Chat messages -> what a chat template renders, for the engine and the gateway.

Messages are validated by the shared request models (`servefleet.api.openai_messages`: text
parts only for a text model, a `refusal` part accepted in an assistant's history); this module
turns validated messages into the role/content dicts a template is given.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from servefleet.api.openai_messages import MessageContent, content_text

__all__ = ["MessageContent", "content_text", "template_messages"]


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    """Role and text of each validated message: what a chat template is given."""
    return [
        {"role": str(message.get("role", "")), "content": content_text(message.get("content"))}
        for message in messages
    ]
