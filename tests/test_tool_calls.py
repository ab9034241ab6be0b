"""Tool calls with the real model over the official client: required, named, auto, none.

`required` and named choices are decoded under a grammar, so their arguments must validate
against the function's schema every time; `auto` is read back by the Hermes parser (the
model is steered into writing a call with `guided_regex`, so the test does not depend on a
135M model choosing to call). Streams must reassemble into the same calls as whole answers.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest

from servefleet.api.openai_requests import ChatCompletionRequest
from servefleet.engine.process import BuiltEngine
from tests.support.engine_harness import running_engine
from tests.support.http_server import openai_client, serve_in_thread

MODEL = "smollm2-135m-instruct"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 30}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": WEATHER,
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "Time in a timezone", "parameters": TIME},
    },
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def built(smollm2) -> Iterator[BuiltEngine]:  # type: ignore[no-untyped-def]
    with running_engine(smollm2, max_num_seqs=16) as engine:
        yield engine


@pytest.fixture(scope="module")
def client(built: BuiltEngine) -> Iterator[openai.OpenAI]:
    with serve_in_thread(built) as base:
        yield openai_client(base)


def _create(client: openai.OpenAI, **extra: Any) -> Any:
    settings = {"model": MODEL, "messages": ASK, "temperature": 0, "max_tokens": 120}
    return client.chat.completions.create(**{**settings, "tools": TOOLS, **extra})


def _calls_of(reply: Any) -> list[tuple[str, Any]]:
    """(name, arguments) of each call, the arguments checked against the function's schema."""
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    out = []
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        out.append((call.function.name, arguments))
    return out


def _streamed_calls(client: openai.OpenAI, **extra: Any) -> tuple[list[tuple[str, Any]], str]:
    """Tool calls rebuilt from OpenAI's delta format, and the finish reason."""
    calls: dict[int, dict[str, Any]] = {}
    finish = ""
    for chunk in _create(client, stream=True, **extra):
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"name": "", "arguments": "", "id": None})
                if delta.id:
                    assert call["id"] is None, "one id per call, in its first delta"
                    call["id"] = delta.id
                    call["name"] = delta.function.name
                call["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert all(c["id"] for c in calls.values())
    return [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())], finish


def test_named_choice_calls_that_function(client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    reply = _create(client, tool_choice=named)
    [(name, _)] = _calls_of(reply)
    assert name == "get_weather"
    assert reply.choices[0].message.content is None
    streamed, finish = _streamed_calls(client, tool_choice=named)
    assert finish == "tool_calls"
    assert streamed == _calls_of(reply)


def test_required_makes_valid_calls(client: openai.OpenAI) -> None:
    for ask in ("What is the weather in Paris?", "What time is it in Tokyo?"):
        messages = [{"role": "user", "content": ask}]
        # One call: with parallel calls a 135M model tends to repeat calls until max_tokens.
        one = {"tool_choice": "required", "parallel_tool_calls": False}
        reply = _create(client, messages=messages, **one)
        calls = _calls_of(reply)
        assert len(calls) == 1 and calls[0][0] in SCHEMAS
        streamed, finish = _streamed_calls(client, messages=messages, **one)
        assert (streamed, finish) == (calls, "tool_calls")


def test_required_with_parallel_calls_stays_valid_when_cut_short(client: openai.OpenAI) -> None:
    reply = _create(client, tool_choice="required", max_tokens=200)
    choice = reply.choices[0]
    if choice.finish_reason == "length":  # an unfinished array: handed back as text
        assert choice.message.tool_calls is None and choice.message.content.startswith("[{")
    else:
        assert len(_calls_of(reply)) >= 1


def test_auto_reads_the_models_hermes_calls(client: openai.OpenAI) -> None:
    # Steer the model into its own tool-call format; the parser must read it back.
    regex = (
        r'<tool_call>\n\{"name": "get_weather", "arguments": '
        r'\{"city": "[A-Za-z]{1,12}", "unit": "celsius"\}\}\n</tool_call>'
    )
    reply = _create(client, tool_choice="auto", extra_body={"guided_regex": regex})
    [(name, arguments)] = _calls_of(reply)
    assert name == "get_weather" and arguments["unit"] == "celsius"
    assert reply.choices[0].message.content is None
    streamed, finish = _streamed_calls(
        client, tool_choice="auto", extra_body={"guided_regex": regex}
    )
    assert (streamed, finish) == ([(name, arguments)], "tool_calls")


def test_auto_without_a_call_is_plain_text(client: openai.OpenAI) -> None:
    reply = _create(client, tool_choice="auto", extra_body={"guided_choice": ["It is sunny."]})
    assert reply.choices[0].message.content == "It is sunny."
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].finish_reason == "stop"


def test_none_never_calls(client: openai.OpenAI) -> None:
    reply = _create(client, tool_choice="none", max_tokens=16)
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_tool_results_go_back_through_the_template(
    client: openai.OpenAI, built: BuiltEngine
) -> None:
    first = _create(client, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    reply = _create(client, messages=history, tool_choice="none", max_tokens=24)
    assert reply.choices[0].message.content
    # What the model saw: the call and its result, in the Hermes format of our tool prompt.
    request = {"model": MODEL, "messages": history, "tools": TOOLS}
    prepared = built.state.structured.prepare_chat(ChatCompletionRequest.model_validate(request))
    prompt = built.state.chat_template.render(prepared.messages, tools=prepared.tools)
    assert call.function.name in prompt and '"temperature": 21' in prompt
    assert "<tool_response>" in prompt and "<tool_call>" in prompt


def test_forced_calls_batched_with_free_text(client: openai.OpenAI) -> None:
    free_prompts = [f"Name a colour, number {i}." for i in range(4)]

    def free(prompt: str) -> str | None:
        messages = [{"role": "user", "content": prompt}]
        reply = client.chat.completions.create(
            model=MODEL, messages=messages, temperature=0, max_tokens=16
        )
        return reply.choices[0].message.content

    alone = [free(p) for p in free_prompts]
    with ThreadPoolExecutor(8) as pool:
        forced = [
            pool.submit(_create, client, tool_choice="required", parallel_tool_calls=False)
            for _ in range(4)
        ]
        frees = [pool.submit(free, p) for p in free_prompts]
        for f in forced:
            assert _calls_of(f.result())
        assert [f.result() for f in frees] == alone


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ],
)
def test_bad_tool_requests_are_400(
    client: openai.OpenAI, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        _create(client, **extra)
    assert err.value.body["param"] == param  # type: ignore[index]
