"""Chat history with tools -> what the model's chat template is given.

A template that knows tools (it reads `tools`; Qwen 2.5, Llama 3.1, Hermes) gets them as
`tools`, assistant `tool_calls` with their arguments as objects and `role: tool` results
with their `tool_call_id`, as transformers' `apply_chat_template` passes them. A template
that does not (SmolLM2's) would drop all of that silently, so the same content is written
into the messages instead, in the Hermes format the `hermes` parser reads back: the tool
list in the system message, calls as `<tool_call>` blocks, results as `<tool_response>`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from servefleet.api.openai_messages import ChatMessage, ToolCall, content_text
from servefleet.api.openai_requests import Tool

_TOOLS_PROMPT = (
    "You may call one or more functions to assist with the user query. The functions are "
    "listed within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\nFor each "
    "function call, return a json object with the function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def template_knows_tools(template_source: str) -> bool:
    return "tools" in template_source or "tool_calls" in template_source


def _arguments(call: ToolCall) -> Any:
    try:
        return json.loads(call.function.arguments)
    except ValueError:
        return call.function.arguments


def _native(message: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role, "content": content_text(message.content)}
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.function.name, "arguments": _arguments(c)},
            }
            for c in message.tool_calls
        ]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        out["name"] = message.name
    return out


def _folded(message: ChatMessage) -> dict[str, Any]:
    text = content_text(message.content)
    for call in message.tool_calls or []:
        block = json.dumps({"name": call.function.name, "arguments": _arguments(call)})
        text += f"{chr(10) if text else ''}<tool_call>\n{block}\n</tool_call>"
    if message.role == "tool":
        text = f"<tool_response>\n{text}\n</tool_response>"
    return {"role": message.role, "content": text}


def template_inputs(
    messages: Sequence[ChatMessage], tools: Sequence[Tool] | None, template_source: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for `ChatTemplate.render`; tools None when none are offered."""
    tool_dicts = [t.model_dump(exclude_none=True) for t in tools] if tools else None
    if template_knows_tools(template_source):
        return [_native(m) for m in messages], tool_dicts
    folded = [_folded(m) for m in messages]
    if tool_dicts:
        listing = "\n".join(json.dumps(t) for t in tool_dicts)
        prompt = _TOOLS_PROMPT.format(tools=listing)
        if folded and folded[0]["role"] == "system":
            folded[0]["content"] = f"{folded[0]['content']}\n\n{prompt}"
        else:
            folded.insert(0, {"role": "system", "content": prompt})
    return folded, None
