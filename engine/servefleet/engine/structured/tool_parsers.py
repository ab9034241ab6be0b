"""A model's own tool-call text -> calls, for `tool_choice: "auto"`.

Models announce tool calls in the format they were trained on; the parser is chosen from
the chat template (the format it renders is the one the model writes back) or named with
`--tool-call-parser`, as vLLM names them:

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call
  (Hermes, Qwen 2.5, SmolLM-style prompts); text outside the blocks is the content.
- `llama3_json`: the whole answer is `{"name": ..., "parameters": {...}}`, optionally after
  `<|python_tag|>`, several separated by `;` (Llama 3.1+ JSON tool calling).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, get_args

from pydantic import BaseModel

from servefleet.api.engine_flags import ToolCallParser

TOOL_CALL_PARSERS: tuple[str, ...] = get_args(ToolCallParser)


class ParsedCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI returns it


class ParsedOutput(BaseModel):
    content: str | None
    calls: list[ParsedCall]


_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_DECODER = json.JSONDecoder()


def _call_of(obj: Any) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(name=obj["name"], arguments=json.dumps(args, ensure_ascii=False))


def parse_hermes(text: str) -> ParsedOutput:
    if "<tool_call>" not in text:
        return ParsedOutput(content=text, calls=[])
    calls = []
    for block in _HERMES_BLOCK.findall(text):
        try:
            call = _call_of(json.loads(block))
        except ValueError:
            call = None
        if call is None:  # not a well-formed call: leave the text to the client
            return ParsedOutput(content=text, calls=[])
        calls.append(call)
    content = _HERMES_BLOCK.sub("", text).strip()
    return ParsedOutput(content=content or None, calls=calls)


def parse_llama3_json(text: str) -> ParsedOutput:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return ParsedOutput(content=text, calls=[])
    calls, pos = [], 0
    while pos < len(body):
        try:
            obj, end = _DECODER.raw_decode(body, pos)
        except ValueError:
            return ParsedOutput(content=text, calls=[])
        call = _call_of(obj)
        if call is None:
            return ParsedOutput(content=text, calls=[])
        calls.append(call)
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
    return ParsedOutput(content=None, calls=calls)


PARSERS: dict[str, Callable[[str], ParsedOutput]] = {
    "hermes": parse_hermes,
    "llama3_json": parse_llama3_json,
}


def parser_for_template(template_source: str) -> str:
    """The format a chat template teaches; Hermes when it shows none (our own tool prompt)."""
    if "<|python_tag|>" in template_source or "ipython" in template_source:
        return "llama3_json"
    return "hermes"
