"""Size and complexity caps on request content, checked while the body is validated.

A request's cost on an engine is not its byte count: a `tools` list is rendered into the
prompt and, for a forced tool choice, compiled into one grammar over every function's schema;
a `guided_choice` becomes a grammar of that many alternatives; a schema, regex or EBNF text
is compiled against the whole vocabulary. Each of those is bounded here, before anything is
rendered, tokenized or compiled, so the gateway and the engine refuse the same requests with
a 400 that names the field. The numbers, and what the engines measured at them, are in the
engine README ("Bounded preparation"); what no size can bound (a small regex that compiles
for minutes) is cut by the engine's preparation time budget instead.
"""

from __future__ import annotations

import json
from typing import Any

MAX_TOOLS = 128  # OpenAI's own limit
MAX_TOOLS_BYTES = 256 * 1024  # the whole `tools` list as compact JSON
MAX_SCHEMA_PROPERTIES = 5000  # object properties in one schema (all tools together); OpenAI's
MAX_SCHEMA_BYTES = 128 * 1024  # `guided_json`, `response_format.json_schema.schema`
MAX_GUIDED_CHOICES = 1024
MAX_GUIDED_CHOICE_BYTES = 32 * 1024
MAX_REGEX_BYTES = 16 * 1024
MAX_GRAMMAR_BYTES = 64 * 1024
MAX_PROMPTS = 2048  # prompts of one completions request, inputs of one embeddings request
PRIORITY_BOUND = 1_000_000  # |priority|: a rank, not an arithmetic weapon
MAX_TOKEN_ID_DIGITS = 9  # logit_bias keys: Python refuses int() of 4,300+ digits


def utf8_len(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def json_size(value: Any) -> int:
    """Bytes of `value` as compact JSON (what a client sent, give or take whitespace)."""
    try:
        return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())
    except (TypeError, ValueError):
        return 0  # not JSON data: the field's own validation refuses it


def count_properties(schema: Any, limit: int = MAX_SCHEMA_PROPERTIES) -> int:
    """Object properties declared anywhere in a JSON schema; stops counting past `limit`.

    Iterative (no recursion however deep the schema) and linear in its size.
    """
    total = 0
    stack = [schema]
    while stack and total <= limit:
        node = stack.pop()
        if isinstance(node, dict):
            properties = node.get("properties")
            if isinstance(properties, dict):
                total += len(properties)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return total


def check_tools(tools: Any) -> None:
    """Raises ValueError (the field validator's error) for a tools list over the caps."""
    if not isinstance(tools, list):
        return
    if len(tools) > MAX_TOOLS:
        raise ValueError(f"at most {MAX_TOOLS} tools; got {len(tools)}")
    size = json_size(tools)
    if size > MAX_TOOLS_BYTES:
        raise ValueError(f"tools take at most {MAX_TOOLS_BYTES} bytes as JSON; got {size}")
    properties = count_properties(tools)
    if properties > MAX_SCHEMA_PROPERTIES:
        raise ValueError(
            f"tools declare more than {MAX_SCHEMA_PROPERTIES} object properties in all"
        )


def check_schema(schema: Any) -> None:
    size = utf8_len(schema) if isinstance(schema, str) else json_size(schema)
    if size > MAX_SCHEMA_BYTES:
        raise ValueError(f"a schema takes at most {MAX_SCHEMA_BYTES} bytes as JSON; got {size}")
    if isinstance(schema, str):
        return  # guided_json as text: counted by the engine's budget, not parsed twice here
    if count_properties(schema) > MAX_SCHEMA_PROPERTIES:
        raise ValueError(f"a schema declares more than {MAX_SCHEMA_PROPERTIES} properties")


def check_choices(choices: Any) -> None:
    if not isinstance(choices, list):
        return
    if len(choices) > MAX_GUIDED_CHOICES:
        raise ValueError(f"at most {MAX_GUIDED_CHOICES} choices; got {len(choices)}")
    size = json_size(choices)
    if size > MAX_GUIDED_CHOICE_BYTES:
        raise ValueError(
            f"choices take at most {MAX_GUIDED_CHOICE_BYTES} bytes as JSON; got {size}"
        )


def check_text(value: Any, limit: int, what: str) -> None:
    if isinstance(value, str) and (size := utf8_len(value)) > limit:
        raise ValueError(f"a {what} takes at most {limit} bytes; got {size}")
