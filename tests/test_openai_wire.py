"""The shared request models and body bounds on their own (no model, no server)."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from servefleet.api.openai_errors import OpenAIError
from servefleet.api.openai_requests import (
    REFUSED_FIELDS,
    VENDOR_EXTENSIONS,
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
)
from servefleet.api.openai_wire import (
    MAX_JSON_DEPTH,
    json_depth_exceeds,
    parse_request,
    validate,
)

CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize("depth", [1, 2, MAX_JSON_DEPTH - 1, MAX_JSON_DEPTH])
def test_depth_up_to_the_limit_is_accepted(depth: int) -> None:
    assert not json_depth_exceeds(nested(depth))
    assert not json_depth_exceeds(b"[" + b",".join([nested(depth)] * 100) + b"]", depth + 1)


def test_depth_over_the_limit_is_refused_and_strings_do_not_count() -> None:
    assert json_depth_exceeds(nested(MAX_JSON_DEPTH + 1))
    assert json_depth_exceeds(b"[" * 100_000)
    # Many shallow arrays side by side, then one deep one at the very end.
    assert json_depth_exceeds(b"[" + b"[]," * 200_000 + nested(4) + b"]", 4)
    brackets_in_strings = json.dumps({"a": "[[[[[[[[" * 50, "b": ['\\"[[[[', "]]"]}).encode()
    assert not json_depth_exceeds(brackets_in_strings, 3)


def test_bounding_is_linear_in_time() -> None:
    body = b"[" + b",".join([nested(MAX_JSON_DEPTH)] * 100_000) + b"]"  # 12.9 MB of brackets
    started = time.perf_counter()
    assert json_depth_exceeds(body)
    assert time.perf_counter() - started < 10


@pytest.mark.parametrize(
    ("raw", "status", "needle"),
    [
        (nested(100_000), 400, "deeper than"),
        (b"{not json", 400, "parse the JSON"),
        (b"[1]", 400, "JSON object"),
        (b'{"x": "' + b"a" * (17 << 20) + b'"}', 413, "larger than"),
    ],
)
def test_bad_bodies_are_refused_before_validation(raw: bytes, status: int, needle: str) -> None:
    with pytest.raises(OpenAIError) as caught:
        parse_request(ChatCompletionRequest, raw)
    assert caught.value.status == status and needle in caught.value.message
    assert set(caught.value.body()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"stream": "yes"}, "stream"),
        ({"n": "2"}, "n"),
        ({"max_tokens": 2.0}, "max_tokens"),
        ({"temperature": "0"}, "temperature"),
        ({"priority": "urgent"}, "priority"),
        ({"stop": [[["a"]]]}, "stop"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"suffix": "x"}, "suffix"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"5": "1"}}, "logit_bias.5"),
        ({"logit_bias": {str(i): 1 for i in range(2000)}}, "logit_bias"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, None),
    ],
)
def test_strict_types_unknown_and_refused_fields_name_the_param(
    extra: dict[str, Any], param: str | None
) -> None:
    with pytest.raises(OpenAIError) as caught:
        validate(CompletionRequest, {"model": "m", "prompt": "x", **extra})
    assert caught.value.status == 400 and caught.value.param == param
    if param is not None:
        assert param.split(".")[0] in caught.value.message


def test_unknown_fields_come_first_and_use_openais_words() -> None:
    with pytest.raises(OpenAIError) as caught:
        validate(ChatCompletionRequest, {**CHAT, "n": 0, "moderation": {}})
    assert caught.value.param == "moderation"
    assert caught.value.message.startswith("Unrecognized request argument supplied: moderation")


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "user", "content": [{"type": "image_url", "image_url": {}}]},
         "messages.0.content"),
        ({"role": "user", "content": [{"type": "text", "text": "a", "x": 1}]},
         "messages.0.content"),
        ({"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}, "messages.0"),
        ({"role": "user", "content": "a", "function_call": {"name": "f"}},
         "messages.0.function_call"),
        ({"role": "tool", "content": "a"}, "messages.0"),
        ({"role": "wizard", "content": "a"}, "messages.0.role"),
    ],
)  # fmt: skip
def test_messages_refuse_what_a_text_model_cannot_read(message: dict[str, Any], param: str) -> None:
    with pytest.raises(OpenAIError) as caught:
        validate(ChatCompletionRequest, {**CHAT, "messages": [message]})
    assert caught.value.param == param


def test_assistant_refusal_history_and_tool_messages_are_accepted() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    body = validate(
        ChatCompletionRequest,
        {
            **CHAT,
            "messages": [
                {"role": "user", "content": "x", "name": "ann"},
                {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "{}"},
            ],
        },
    )
    assert len(body.messages) == 4


def test_every_refused_field_is_declared_somewhere_and_extensions_are_fields() -> None:
    declared = (
        set(ChatCompletionRequest.model_fields)
        | set(CompletionRequest.model_fields)
        | set(EmbeddingRequest.model_fields)
    )
    assert set(REFUSED_FIELDS) <= declared
    assert set(VENDOR_EXTENSIONS) <= set(CompletionRequest.model_fields)


def test_prompt_and_input_lists() -> None:
    body = validate(CompletionRequest, {"model": "m", "prompt": ["a", "b"]})
    assert body.prompts() == ["a", "b"]
    assert validate(CompletionRequest, {"model": "m", "prompt": [1, 2]}).prompts() == [[1, 2]]
    empties: tuple[list[Any], ...] = ([], [[]])
    for empty in empties:
        with pytest.raises(OpenAIError):
            validate(EmbeddingRequest, {"model": "m", "input": empty})
    assert validate(EmbeddingRequest, {"model": "m", "input": [[1], [2, 3]]}).inputs() == [
        [1],
        [2, 3],
    ]


@pytest.mark.parametrize(
    "raw",
    [
        rb'{"model": "m", "prompt": "a\ud800b"}',
        rb'{"model": "m", "prompt": ["ok", "\uDFFF"]}',
        rb'{"model": "m", "prompt": "x", "logit_bias": {"\udc00": 1}}',
    ],
)
def test_a_lone_surrogate_is_a_400_not_a_tokenizer_crash(raw: bytes) -> None:
    # json.loads keeps an unpaired surrogate; tokenizers and str.encode() then raise (a 500).
    with pytest.raises(OpenAIError) as caught:
        parse_request(CompletionRequest, raw)
    assert caught.value.status == 400 and caught.value.code == "invalid_unicode"
    assert set(caught.value.body()["error"]) == {"message", "type", "param", "code"}


def test_paired_surrogates_and_escaped_backslashes_are_text() -> None:
    raw = rb'{"model": "m", "prompt": "smile \ud83d\ude00 and a literal \\ud800"}'
    _, request = parse_request(CompletionRequest, raw)
    assert request.prompt == "smile \U0001f600 and a literal \\ud800"
