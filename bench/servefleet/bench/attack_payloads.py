"""The hostile request bodies of the attack suite, built before the victim's window opens so
that building them costs the stack nothing. Sizes are the ones the attacks were first found
with (issue: a hostile tenant cannot stall, hijack or escape)."""

from __future__ import annotations

import json
from typing import Any

from servefleet.bench.fault_stack import MODEL


def chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


def tools_flood(functions: int = 50, properties: int = 200) -> bytes:
    """A chat whose `tools` list is ~0.3 MB: 50 functions x 200 properties each."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": f"function_{f}",
                "description": "Looks something up.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        f"field_{f}_{p}": {"type": "string", "description": f"value {p}"}
                        for p in range(properties)
                    },
                    "required": [f"field_{f}_{p}" for p in range(properties)],
                },
            },
        }
        for f in range(functions)
    ]
    return json.dumps(chat("Call a tool.", tools=tools, tool_choice="required")).encode()


def guided_choice_flood(items: int = 100_000) -> bytes:
    choices = [f"choice number {i}" for i in range(items)]
    body = {"model": MODEL, "prompt": "Pick one:", "max_tokens": 4, "guided_choice": choices}
    return json.dumps(body).encode()


def tokenize_flood(megabytes: int = 15) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "word " * (megabytes * 2**20 // 5)}).encode()


def huge_message(megabytes: int = 15) -> bytes:
    return json.dumps(chat("word " * (megabytes * 2**20 // 5), max_tokens=4)).encode()


def many_sequences(prompts: int = 300, n: int = 16) -> bytes:
    body = {
        "model": MODEL,
        "prompt": [f"Story {i}:" for i in range(prompts)],
        "n": n,
        "max_tokens": 16,
        "temperature": 1.0,
    }
    return json.dumps(body).encode()


def prompts_times_n(prompts: int = 10, n: int = 16, max_tokens: int = 8) -> bytes:
    """Small on its face (8 tokens each), but 10 x 16 = 160 sequences: 1,280 completion
    tokens, which a reservation of n x max_tokens for one prompt misses."""
    body = {
        "model": MODEL,
        "prompt": [f"Tell me about the number {i} in one short sentence." for i in range(prompts)],
        "n": n,
        "max_tokens": max_tokens,
        "temperature": 1.0,
    }
    return json.dumps(body).encode()


def huge_priority() -> bytes:
    return json.dumps(chat("hi", max_tokens=2, priority=-(10**30))).encode()


def long_logit_bias_key(digits: int = 4400) -> bytes:
    return json.dumps(chat("hi", max_tokens=2, logit_bias={"9" * digits: 1})).encode()
