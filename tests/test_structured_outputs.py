"""Structured outputs with the real model: every answer parses and validates against its schema.

Over the official client and real HTTP: `response_format` json_object / json_schema and
vLLM's `guided_*` fields, each alone and all at once in one batch with unconstrained
requests, whose answers must be exactly what they are without the constrained neighbours.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest

from servefleet.engine.process import BuiltEngine
from tests.support.engine_harness import running_engine
from tests.support.http_server import openai_client, serve_in_thread

MODEL = "smollm2-135m-instruct"

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "age": {"type": "integer", "minimum": 0, "maximum": 130},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "enum_and_bounds": {
        "type": "object",
        "properties": {
            "colour": {"enum": ["red", "green", "blue"]},
            "score": {"type": "number", "minimum": 0, "maximum": 10},
            "ok": {"type": "boolean"},
        },
        "required": ["colour", "score", "ok"],
        "additionalProperties": False,
    },
    "array_of_strings": {
        "type": "object",
        "properties": {
            "cities": {
                "type": "array",
                "items": {"type": "string", "maxLength": 20},
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "required": ["cities"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 9999},
                    "address": {
                        "type": "object",
                        "properties": {
                            "city": {"type": "string", "maxLength": 20},
                            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                        },
                        "required": ["city", "zip"],
                        "additionalProperties": False,
                    },
                },
                "required": ["id", "address"],
                "additionalProperties": False,
            },
            "tags": {
                "type": "array",
                "items": {"enum": ["new", "vip", "blocked"]},
                "maxItems": 2,
            },
        },
        "required": ["user", "tags"],
        "additionalProperties": False,
    },
    "array_of_objects": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 2,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 5},
                        "price": {"type": "number", "exclusiveMinimum": 0, "maximum": 100},
                    },
                    "required": ["sku", "qty", "price"],
                    "additionalProperties": False,
                },
            }
        },
        "required": ["items"],
        "additionalProperties": False,
    },
}
PROMPT = "Describe a customer order as JSON."
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def built(smollm2) -> Iterator[BuiltEngine]:  # type: ignore[no-untyped-def]
    with running_engine(smollm2, max_num_seqs=16) as engine:
        yield engine


@pytest.fixture(scope="module")
def client(built: BuiltEngine) -> Iterator[openai.OpenAI]:
    with serve_in_thread(built) as base:
        yield openai_client(base)


def _schema_format(name: str) -> dict[str, Any]:
    schema = SCHEMAS[name]
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def _chat(client: openai.OpenAI, content: str, **extra: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],
        **{"temperature": 0, "max_tokens": MAX_TOKENS, **extra},
    )


def _valid(reply: Any, schema: dict[str, Any]) -> Any:
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", choice
    value = json.loads(choice.message.content)
    jsonschema.validate(value, schema)
    return value


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_outputs_validate(client: openai.OpenAI, name: str) -> None:
    reply = _chat(client, f"{PROMPT} ({name})", response_format=_schema_format(name))
    _valid(reply, SCHEMAS[name])


def test_sampled_outputs_validate_too(client: openai.OpenAI) -> None:
    for seed in range(3):
        reply = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": PROMPT}],
            temperature=1.0,
            seed=seed,
            max_tokens=MAX_TOKENS,
            response_format=_schema_format("nested"),
        )
        _valid(reply, SCHEMAS["nested"])


def test_json_object_is_an_object(client: openai.OpenAI) -> None:
    prompt = "Describe Paris as a JSON object with keys name and country."
    reply = _chat(client, prompt, response_format={"type": "json_object"})
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_guided_fields(client: openai.OpenAI) -> None:
    choice = _chat(client, "Is the sky blue?", extra_body={"guided_choice": ["yes", "no"]})
    assert choice.choices[0].message.content in ("yes", "no")
    regex = r"[0-9]{3}-[0-9]{4}"
    phone = _chat(client, "A phone number:", extra_body={"guided_regex": regex})
    assert re.fullmatch(regex, phone.choices[0].message.content)
    grammar = 'root ::= "The answer is " [0-9]+ "."'
    ebnf = _chat(client, "What is 6 times 7?", extra_body={"guided_grammar": grammar})
    assert re.fullmatch(r"The answer is [0-9]+\.", ebnf.choices[0].message.content)
    guided = _chat(client, PROMPT, extra_body={"guided_json": SCHEMAS["person"]})
    _valid(guided, SCHEMAS["person"])
    text = client.completions.create(
        model=MODEL,
        prompt="The colour of the sky is",
        max_tokens=8,
        temperature=0,
        extra_body={"guided_choice": ["blue", "grey"]},
    )
    assert text.choices[0].text in ("blue", "grey")


def test_constrained_and_free_requests_in_one_batch(client: openai.OpenAI) -> None:
    free_prompts = [f"Tell me a fact about the number {i}." for i in range(6)]
    alone = [_chat(client, p, max_tokens=24).choices[0].message.content for p in free_prompts]

    def constrained(name: str) -> None:
        _valid(
            _chat(client, f"{PROMPT} ({name})", response_format=_schema_format(name)), SCHEMAS[name]
        )

    def free(index: int) -> str | None:
        return _chat(client, free_prompts[index], max_tokens=24).choices[0].message.content

    with ThreadPoolExecutor(len(SCHEMAS) + len(free_prompts)) as pool:
        checks = [pool.submit(constrained, name) for name in SCHEMAS]
        frees = [pool.submit(free, i) for i in range(len(free_prompts))]
        for check in checks:
            check.result()
        assert [f.result() for f in frees] == alone


def test_streamed_json_is_the_same_json(client: openai.OpenAI) -> None:
    whole = _chat(client, PROMPT, response_format=_schema_format("nested"))
    stream = _chat(client, PROMPT, response_format=_schema_format("nested"), stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == whole.choices[0].message.content


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_json": {"type": "no-such-type"}}, "guided_json"),
        ({"guided_grammar": "root ::= missing_rule"}, "guided_grammar"),
    ],
)
def test_bad_constraints_are_400_naming_the_field(
    client: openai.OpenAI, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        _chat(client, "hi", extra_body=extra)
    assert err.value.body["param"] == param  # type: ignore[index]
