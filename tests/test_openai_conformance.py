"""The feature table of `engine/README.md`, checked row by row with the official `openai` SDK,
against the engine and through the gateway in front of it.

The table is parsed from the README, so a row cannot claim what the server does not do: every
row needs a check here, every check a row, and the table must name every parameter the SDK's
create methods take. A `refused` row is checked for a 400 whose `param` names the field.
"""

from __future__ import annotations

import base64
import inspect
import json
import math
import re
import struct
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from servefleet.api.gateway_config import (
    ApiKeyRef,
    GatewayConfig,
    GatewayDeployment,
    GatewayTenant,
    TenantAccess,
    hash_api_key,
)
from servefleet.api.llmdeployment import TenantLimits
from servefleet.api.openai_wire import MAX_JSON_DEPTH
from servefleet.bench.processes import serve_in_thread as serve_app
from servefleet.engine.process import BuiltEngine
from servefleet.gateway.app import Gateway
from tests.support.engine_harness import running_engine
from tests.support.http_server import serve_in_thread

MODEL = "smollm2-135m-instruct"
README = Path(__file__).resolve().parents[1] / "engine" / "README.md"
KEY = "key-conformance"
SMALL_KEY = "key-small"  # a tenant whose bucket refills slowly enough to read a charge
SMALL_TOKENS_PER_MINUTE = 60
HI = [{"role": "user", "content": "Say hi."}]


# ---- the table ---------------------------------------------------------------------------------
STATUS = re.compile(r"^(supported|refused)(?: \(`(tests/\w+\.py)`\))?$")


def feature_table() -> dict[str, str]:
    """Row name -> status, from the README's `| field or endpoint | applies to | status |`.

    A status is `supported` or `refused`, optionally naming the test file that checks the row
    in depth: supported (`tests/test_tool_calls.py`)."""
    rows: dict[str, str] = {}
    in_table = False
    for line in README.read_text().splitlines():
        if line.startswith("| field or endpoint |"):
            in_table = True
            continue
        if in_table and not line.startswith("|"):
            break
        if in_table and not line.startswith("| ---"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            assert len(cells) == 3, line
            rows[cells[0]] = cells[2]
    assert rows, "no feature table in engine/README.md"
    return rows


@dataclass
class Target:
    kind: str  # engine | gateway
    client: openai.OpenAI  # base URL .../v1
    root: openai.OpenAI  # base URL without /v1 (vLLM's extra endpoints)
    base: str

    def raw(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        headers = {"authorization": f"Bearer {KEY}", **kwargs.pop("headers", {})}
        return httpx.request(method, self.base + path, headers=headers, timeout=60, **kwargs)


Check = Callable[[Target], None]
CHECKS: dict[str, Check] = {}


def check(*names: str) -> Callable[[Check], Check]:
    def register(fn: Check) -> Check:
        for name in names:
            CHECKS[name] = fn
        return fn

    return register


def chat(t: Target, **kwargs: Any) -> Any:
    kwargs.setdefault("messages", HI)
    kwargs.setdefault("max_tokens", 4)
    return t.client.chat.completions.create(model=MODEL, **kwargs)


def complete(t: Target, **kwargs: Any) -> Any:
    kwargs.setdefault("prompt", "The capital of France is")
    kwargs.setdefault("max_tokens", 4)
    return t.client.completions.create(model=MODEL, **kwargs)


def refused(call: Callable[[], Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        call()
    assert caught.value.status_code == 400
    assert caught.value.param == param, caught.value.body
    assert param.split(".")[0] in caught.value.message


# ---- endpoints -------------------------------------------------------------------------------
@check("`POST /v1/chat/completions`", "`messages`", "`model`")
def _chat(t: Target) -> None:
    reply = chat(t, temperature=0)
    assert isinstance(reply.choices[0].message.content, str)
    assert reply.usage is not None and reply.usage.prompt_tokens > 0
    with pytest.raises(openai.NotFoundError):
        t.client.chat.completions.create(model="nope", messages=HI, max_tokens=1)
    refused(lambda: chat(t, messages=[]), "messages")


@check("`POST /v1/completions`", "`prompt`")
def _completions(t: Target) -> None:
    ids = t.root.post(
        "/tokenize", body={"model": MODEL, "prompt": "Once upon a time"}, cast_to=object
    )["tokens"]  # type: ignore[index]
    by_text = complete(t, prompt="Once upon a time", temperature=0)
    by_ids = complete(t, prompt=ids, temperature=0)
    assert by_text.choices[0].text == by_ids.choices[0].text


@check("`POST /v1/embeddings`", "`input`", "`encoding_format`")
def _embeddings(t: Target) -> None:
    packed = t.client.embeddings.create(model=MODEL, input="hello world")  # SDK sends base64
    plain = t.client.embeddings.create(model=MODEL, input="hello world", encoding_format="float")
    a, b = packed.data[0].embedding, plain.data[0].embedding
    assert len(a) == len(b) == 576 and max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-6
    assert math.isclose(math.fsum(x * x for x in b), 1.0, rel_tol=1e-4)
    assert plain.usage.prompt_tokens == plain.usage.total_tokens > 0
    raw = t.raw("POST", "/v1/embeddings", json={"model": MODEL, "input": "hello world",
                                               "encoding_format": "base64"})  # fmt: skip
    decoded = struct.unpack("<576f", base64.b64decode(raw.json()["data"][0]["embedding"]))
    assert max(abs(x - y) for x, y in zip(decoded, b, strict=True)) < 1e-6
    ids = t.root.post("/tokenize", body={"model": MODEL, "prompt": "hello world"}, cast_to=object)[
        "tokens"
    ]  # type: ignore[index]
    many = t.client.embeddings.create(
        model=MODEL, input=[ids, ids], encoding_format="float"
    )  # token ids, two inputs: the same vector twice, at indexes 0 and 1
    assert [d.index for d in many.data] == [0, 1]
    assert max(abs(x - y) for x, y in zip(many.data[1].embedding, b, strict=True)) < 1e-5
    other = t.client.embeddings.create(model=MODEL, input=["a cat"], encoding_format="float")
    assert max(abs(x - y) for x, y in zip(other.data[0].embedding, b, strict=True)) > 1e-3


@check("`GET /v1/models`")
def _models(t: Target) -> None:
    assert [m.id for m in t.client.models.list()] == [MODEL]


@check("`GET /v1/models/{id}`")
def _model(t: Target) -> None:
    assert t.client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        t.client.models.retrieve("nope")


@check("`POST /tokenize`")
def _tokenize(t: Target) -> None:
    out: Any = t.root.post(
        "/tokenize", body={"model": MODEL, "prompt": "Hello world", "return_token_strs": True},
        cast_to=object,
    )  # fmt: skip
    assert out["count"] == len(out["tokens"]) == len(out["token_strs"]) > 0
    assert out["max_model_len"] > 0
    chat_out: Any = t.root.post("/tokenize", body={"model": MODEL, "messages": HI}, cast_to=object)
    assert chat_out["count"] > out["count"] and chat_out["token_strs"] is None
    neither = t.raw("POST", "/tokenize", json={"model": MODEL})
    assert (
        neither.status_code == 400 and "prompt and messages" in neither.json()["error"]["message"]
    )


@check("`POST /detokenize`")
def _detokenize(t: Target) -> None:
    ids: Any = t.root.post(
        "/tokenize",
        body={"model": MODEL, "prompt": "Hello world", "add_special_tokens": False},
        cast_to=object,
    )
    out: Any = t.root.post(
        "/detokenize", body={"model": MODEL, "tokens": ids["tokens"]}, cast_to=object
    )
    assert out == {"prompt": "Hello world"}
    refused(
        lambda: t.root.post(
            "/detokenize", body={"model": MODEL, "tokens": [10**9]}, cast_to=object
        ),
        "tokens",
    )


@check("`GET /version`")
def _version(t: Target) -> None:
    out: Any = t.root.get("/version", cast_to=object)
    assert isinstance(out["version"], str) and out["version"]


# ---- messages ----------------------------------------------------------------------------------
@check("`messages[].content` text parts")
def _text_parts(t: Target) -> None:
    parts = [{"type": "text", "text": "Say "}, {"type": "text", "text": "hi."}]
    a = chat(t, messages=[{"role": "user", "content": parts}], max_tokens=1)
    b = chat(t, max_tokens=1)
    assert a.usage.prompt_tokens == b.usage.prompt_tokens


@check("`messages[].content` refusal part (assistant)")
def _refusal_part(t: Target) -> None:
    history = [
        {"role": "user", "content": "Tell me a secret."},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."}]},
        {"role": "user", "content": "Then say hi."},
    ]
    assert chat(t, messages=history).choices[0].finish_reason in ("stop", "length")
    bad = [{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}]
    refused(lambda: chat(t, messages=bad), "messages.0")


PARTS = {
    "image_url": {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
    "input_audio": {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    "file": {"type": "file", "file": {"file_id": "file-1"}},
}


def _part_check(kind: str) -> Check:
    def run(t: Target) -> None:
        content = [{"type": "text", "text": "What is this?"}, PARTS[kind]]
        refused(lambda: chat(t, messages=[{"role": "user", "content": content}]),
                "messages.0.content")  # fmt: skip

    return run


for _kind in PARTS:
    CHECKS[f"`messages[].content` {_kind} part"] = _part_check(_kind)


@check("`messages[].name`")
def _name(t: Target) -> None:
    assert chat(t, messages=[{"role": "user", "content": "Hi", "name": "ann"}]).choices


# ---- sampling and output -------------------------------------------------------------------
@check("`prompt` list of prompts")
def _prompt_list(t: Target) -> None:
    prompts = ["The capital of France is", "One, two, three,"]
    reply = complete(t, prompt=prompts, n=2, max_tokens=3, temperature=0)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    singles = [complete(t, prompt=p, max_tokens=3, temperature=0) for p in prompts]
    texts = [c.text for c in reply.choices]
    assert texts == [singles[0].choices[0].text] * 2 + [singles[1].choices[0].text] * 2
    assert reply.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert reply.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles) * 2
    streamed = complete(t, prompt=prompts, n=2, max_tokens=3, temperature=0, stream=True)
    by_index: dict[int, str] = {}
    for part in streamed:
        for c in part.choices:
            by_index[c.index] = by_index.get(c.index, "") + c.text
    assert [by_index[i] for i in range(4)] == texts


@check("`max_tokens`", "`ignore_eos`")
def _max_tokens(t: Target) -> None:
    reply = complete(t, max_tokens=5, extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 5
    refused(lambda: complete(t, max_tokens=0), "max_tokens")


@check("`max_completion_tokens`")
def _max_completion_tokens(t: Target) -> None:
    reply = chat(t, max_tokens=None, max_completion_tokens=3, extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 3


@check("`temperature`")
def _temperature(t: Target) -> None:
    assert (
        chat(t, temperature=0).choices[0].message.content
        == chat(t, temperature=0).choices[0].message.content
    )
    refused(lambda: chat(t, temperature=5), "temperature")


def tokenize(t: Target, text: str) -> list[int]:
    out: Any = t.root.post(
        "/tokenize",
        body={"model": MODEL, "prompt": text, "add_special_tokens": False},
        cast_to=object,
    )
    return list(out["tokens"])


def greedy_text(t: Target) -> str:
    return str(complete(t, temperature=0, max_tokens=6).choices[0].text)


@check("`top_p`")
def _top_p(t: Target) -> None:
    assert complete(t, temperature=1, top_p=1e-6, max_tokens=6).choices[0].text == greedy_text(t)
    refused(lambda: complete(t, top_p=0), "top_p")


@check("`top_k`")
def _top_k(t: Target) -> None:
    same = complete(t, temperature=1, max_tokens=6, extra_body={"top_k": 1})
    assert same.choices[0].text == greedy_text(t)
    refused(lambda: complete(t, extra_body={"top_k": -2}), "top_k")


@check("`n`")
def _n(t: Target) -> None:
    assert len(chat(t, n=3, temperature=0).choices) == 3
    refused(lambda: chat(t, n=0), "n")


@check("`stream`", "`stream_options`")
def _stream(t: Target) -> None:
    whole = chat(t, temperature=0, max_tokens=6)
    chunks = list(chat(t, temperature=0, max_tokens=6, stream=True,
                       stream_options={"include_usage": True}))  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == (
        whole.usage.completion_tokens
    )
    refused(lambda: chat(t, extra_body={"stream": "yes"}), "stream")


@check("`stop`", "`include_stop_str_in_output`")
def _stop(t: Target) -> None:
    text = greedy_text(t)
    word = text.split()[1] if len(text.split()) > 1 else text.strip()
    cut = complete(t, temperature=0, max_tokens=6, stop=[word])
    assert word not in cut.choices[0].text and cut.choices[0].finish_reason == "stop"
    kept = complete(t, temperature=0, max_tokens=6, stop=[word],
                    extra_body={"include_stop_str_in_output": True})  # fmt: skip
    assert kept.choices[0].text.endswith(word)


@check("`stop_token_ids`")
def _stop_token_ids(t: Target) -> None:
    first = complete(t, temperature=0, max_tokens=1, logprobs=0)
    token = first.choices[0].logprobs.tokens[0]
    stop_ids = tokenize(t, token)[:1]
    stopped = complete(t, temperature=0, max_tokens=5, extra_body={"stop_token_ids": stop_ids})
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 1


@check("`seed`")
def _seed(t: Target) -> None:
    a = complete(t, temperature=1, seed=11, max_tokens=8)
    b = complete(t, temperature=1, seed=11, max_tokens=8)
    assert a.choices[0].text == b.choices[0].text


@check("`presence_penalty`", "`frequency_penalty`")
def _penalties(t: Target) -> None:
    assert complete(t, presence_penalty=1.5, frequency_penalty=1.5).choices
    refused(lambda: complete(t, presence_penalty=3), "presence_penalty")
    refused(lambda: complete(t, frequency_penalty=-3), "frequency_penalty")


@check("`logit_bias`")
def _logit_bias(t: Target) -> None:
    forced = tokenize(t, " banana")[0]
    piece: Any = t.root.post(
        "/detokenize", body={"model": MODEL, "tokens": [forced]}, cast_to=object
    )
    reply = complete(t, temperature=0, max_tokens=3, logit_bias={str(forced): 100})
    assert reply.choices[0].text == piece["prompt"] * 3
    first = complete(t, temperature=0, max_tokens=1, logprobs=0).choices[0].logprobs.tokens[0]
    banned = tokenize(t, first)[0]
    other = complete(t, temperature=0, max_tokens=1, logit_bias={str(banned): -100})
    assert other.choices[0].text != first
    for garbage in ({"abc": 1}, {"5": 500}, {"-1": 1}, {str(10**9): 1}):
        refused(lambda g=garbage: complete(t, logit_bias=g), "logit_bias")  # type: ignore[misc]
    refused(lambda: complete(t, extra_body={"logit_bias": {"5": "x"}}), "logit_bias.5")


@check("`logprobs`", "`top_logprobs`")
def _logprobs(t: Target) -> None:
    reply = chat(t, logprobs=True, top_logprobs=2, max_tokens=3, extra_body={"ignore_eos": True})
    content = reply.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)
    text = complete(t, logprobs=2, max_tokens=3, extra_body={"ignore_eos": True})
    assert len(text.choices[0].logprobs.token_logprobs) == 3
    refused(lambda: chat(t, logprobs=True, top_logprobs=50), "top_logprobs")


@check("`echo`")
def _echo(t: Target) -> None:
    reply = complete(t, echo=True, max_tokens=2)
    assert reply.choices[0].text.startswith("The capital of France is")


@check("`user`")
def _user(t: Target) -> None:
    assert chat(t, user="end-user-1").choices
    assert t.client.embeddings.create(model=MODEL, input="x", user="end-user-1").data


@check("`response_format` text")
def _response_format_text(t: Target) -> None:
    assert chat(t, response_format={"type": "text"}).choices


@check("`priority`")
def _priority(t: Target) -> None:
    """The engine's scheduling rank (bounded); the gateway sets it from the tenant's traffic
    class, so a tenant's own is refused there."""
    if t.kind == "gateway":
        refused(lambda: complete(t, extra_body={"priority": "batch"}), "priority")
        return
    assert complete(t, extra_body={"priority": "batch"}).choices
    assert complete(t, extra_body={"priority": -1_000_000}).choices
    refused(lambda: complete(t, extra_body={"priority": "urgent"}), "priority")
    refused(lambda: complete(t, extra_body={"priority": -(10**30)}), "priority")


@check("`return_token_ids`", "`resume_token_ids`")
def _stream_resume(t: Target) -> None:
    """The gateway's own fields for continuing a broken stream: refused from tenants."""
    fields = {"return_token_ids": True, "resume_token_ids": [1, 2]}
    if t.kind == "gateway":
        for name, value in fields.items():
            refused(lambda: complete(t, extra_body={name: value}), name)  # noqa: B023
        return
    assert complete(t, extra_body=fields).usage.completion_tokens == 4


# ---- structured outputs and tools (in depth: the test files their rows name) --------------
CHOICE_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


@check("`response_format` json_object")
def _json_object(t: Target) -> None:
    ask = [{"role": "user", "content": "Reply in JSON: is the sky blue?"}]
    reply = chat(t, response_format={"type": "json_object"}, max_tokens=60, messages=ask)
    content = reply.choices[0].message.content or ""
    assert content.lstrip().startswith("{")
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)


@check("`response_format` json_schema", "`guided_json`")
def _json_schema(t: Target) -> None:
    schema_format = {"type": "json_schema", "json_schema": {"name": "a", "schema": CHOICE_SCHEMA}}
    for kwargs in (
        {"response_format": schema_format},
        {"extra_body": {"guided_json": CHOICE_SCHEMA}},
    ):
        reply = chat(t, max_tokens=40, temperature=0, **kwargs)
        assert json.loads(reply.choices[0].message.content or "")["answer"] in ("yes", "no")


@check("`guided_choice`", "`guided_regex`", "`guided_grammar`")
def _guided(t: Target) -> None:
    choice = complete(t, max_tokens=5, extra_body={"guided_choice": ["yes", "no"]})
    assert choice.choices[0].text in ("yes", "no")
    regex = complete(t, max_tokens=8, extra_body={"guided_regex": "[a-z]{4}"})
    assert re.fullmatch("[a-z]{4}", regex.choices[0].text)
    grammar = complete(t, max_tokens=5, extra_body={"guided_grammar": 'root ::= "up" | "down"'})
    assert grammar.choices[0].text in ("up", "down")
    both = {"model": MODEL, "prompt": "x", "guided_choice": ["a"], "guided_regex": "a"}
    two = t.raw("POST", "/v1/completions", json=both)
    assert two.status_code == 400 and "at most one" in two.json()["error"]["message"]


@check("`tools`", "`tool_choice`", "`parallel_tool_calls`")
def _tools(t: Target) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    reply = chat(t, tools=[WEATHER], tool_choice=named, parallel_tool_calls=False, max_tokens=40)
    calls = reply.choices[0].message.tool_calls or []
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments)["city"] in ("Paris", "Rome")
    none = chat(t, tools=[WEATHER], tool_choice="none", max_tokens=4)
    assert not none.choices[0].message.tool_calls


@check("`messages[].tool_calls` (assistant)", "`messages[].tool_call_id` (tool)")
def _tool_history(t: Target) -> None:
    arguments = '{"city": "Paris"}'
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": arguments}}  # fmt: skip
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    assert chat(t, messages=history, tools=[WEATHER]).choices
    refused(lambda: chat(t, messages=[{"role": "tool", "content": "x"}]), "messages.0")


# ---- refused fields ----------------------------------------------------------------------------
REFUSED: dict[str, tuple[str, dict[str, Any]]] = {
    # row -> (which create call, the field and a value the SDK would send)
    "`dimensions`": ("embeddings", {"dimensions": 8}),
    "`suffix`": ("completions", {"suffix": "end"}),
    "`best_of`": ("completions", {"best_of": 2}),
    "`audio`": ("chat", {"audio": {"voice": "alloy", "format": "wav"}}),
    "`modalities`": ("chat", {"modalities": ["text", "audio"]}),
    "`functions`": ("chat", {"functions": [{"name": "f", "parameters": {}}]}),
    "`function_call`": ("chat", {"function_call": "auto"}),
    "`prediction`": ("chat", {"prediction": {"type": "content", "content": "x"}}),
    "`web_search_options`": ("chat", {"web_search_options": {}}),
    "`store`": ("chat", {"store": True}),
    "`metadata`": ("completions", {"extra_body": {"metadata": {"a": "b"}}}),
    "`service_tier`": ("chat", {"service_tier": "auto"}),
    "`reasoning_effort`": ("chat", {"reasoning_effort": "low"}),
    "`verbosity`": ("chat", {"verbosity": "low"}),
    "`moderation`": ("chat", {"moderation": {"type": "x"}}),
    "`prompt_cache_key`": ("chat", {"prompt_cache_key": "k"}),
    "`prompt_cache_options`": ("chat", {"prompt_cache_options": {"a": 1}}),
    "`prompt_cache_retention`": ("chat", {"prompt_cache_retention": "24h"}),
    "`safety_identifier`": ("chat", {"safety_identifier": "s"}),
    "any other field": ("completions", {"extra_body": {"frobnicate": 1}}),
}


def _refused_check(call: str, kwargs: dict[str, Any]) -> Check:
    extra = kwargs.get("extra_body", {})
    param = next(iter(extra)) if extra else next(iter(kwargs))

    def run(t: Target) -> None:
        if call == "chat":
            refused(lambda: chat(t, **kwargs), param)
        elif call == "completions":
            refused(lambda: complete(t, **kwargs), param)
        else:
            refused(lambda: t.client.embeddings.create(model=MODEL, input="x", **kwargs), param)

    return run


for _row, (_call, _kwargs) in REFUSED.items():
    CHECKS[_row] = _refused_check(_call, _kwargs)


# ---- fixtures ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def built(smollm2) -> Iterator[BuiltEngine]:  # type: ignore[no-untyped-def]
    with running_engine(smollm2, max_queue_depth=64) as engine:
        yield engine


@pytest.fixture(scope="module")
def targets(built: BuiltEngine) -> Iterator[dict[str, Target]]:
    with ExitStack() as stack:
        engine_url = stack.enter_context(serve_in_thread(built))
        config = GatewayConfig(
            tenants=[
                GatewayTenant(
                    name="a",
                    api_keys=[ApiKeyRef(sha256=hash_api_key(KEY))],
                    limits=TenantLimits(tokens_per_minute=1_000_000),
                ),
                GatewayTenant(
                    name="small",
                    api_keys=[ApiKeyRef(sha256=hash_api_key(SMALL_KEY))],
                    limits=TenantLimits(tokens_per_minute=SMALL_TOKENS_PER_MINUTE),
                ),
            ],
            deployments=[
                GatewayDeployment(
                    name="d",
                    model=MODEL,
                    tenants=[TenantAccess(name="a"), TenantAccess(name="small")],
                )
            ],
        )
        gateway = Gateway(config)
        gateway.set_replicas("d", [engine_url], ready=[engine_url])
        gateway_url = stack.enter_context(serve_app(gateway))

        def target(kind: str, base: str) -> Target:
            return Target(
                kind,
                openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=120),
                openai.OpenAI(base_url=base, api_key=KEY, max_retries=0, timeout=120),
                base,
            )

        yield {"engine": target("engine", engine_url), "gateway": target("gateway", gateway_url)}


# ---- tests -------------------------------------------------------------------------------------
def test_every_row_has_a_check_and_every_check_a_row() -> None:
    rows = feature_table()
    assert set(rows) == set(CHECKS), set(rows) ^ set(CHECKS)
    root = README.parents[1]
    for row, status in rows.items():
        match = STATUS.match(status)
        assert match, f"{row}: status {status!r}"
        if match.group(1) == "refused":
            assert row in REFUSED or CHECKS[row].__qualname__.startswith("_part_check"), row
        else:
            assert row not in REFUSED, row
        if match.group(2):  # the file named checks the row in depth: it exists and names it
            text = (root / match.group(2)).read_text()
            field = re.findall(r"\w+", re.findall(r"`([^`]*)`", row)[-1])[-1]
            qualifier = re.findall(r"`[^`]*`\W*(\w+)", row)
            assert field in text and all(q in text for q in qualifier), (row, match.group(2))


def test_the_table_names_every_parameter_of_the_sdk() -> None:
    """A new SDK parameter fails here until the table says what we do with it."""
    named = {m.group(1) for row in feature_table() for m in re.finditer(r"`(\w+)", row)}
    sdk = openai.OpenAI(api_key="x", base_url="http://unused/v1")
    transport = {"extra_headers", "extra_query", "extra_body", "timeout"}
    for create in (sdk.chat.completions.create, sdk.completions.create, sdk.embeddings.create):
        params = set(inspect.signature(create).parameters) - transport
        assert params <= named, params - named


@pytest.mark.parametrize("kind", ["engine", "gateway"])
@pytest.mark.parametrize("row", sorted(feature_table()))
def test_row(targets: dict[str, Target], kind: str, row: str) -> None:
    CHECKS[row](targets[kind])


@pytest.mark.parametrize("kind", ["engine", "gateway"])
def test_hostile_bodies_and_headers_get_openai_errors(
    targets: dict[str, Target], kind: str
) -> None:
    t = targets[kind]
    deep = MAX_JSON_DEPTH + 1
    too_deep = b'{"model": "m", "prompt": ' + b"[" * deep + b"]" * deep + b"}"
    for body, code in (
        (b"[" * 100_000, "json_too_deep"),
        (too_deep, "json_too_deep"),
        (json.dumps({"model": MODEL, "prompt": "x", "stop": [[["a"]]]}).encode(), None),
        (b"{not json", None),
        (b"[1, 2]", None),
    ):
        r = t.raw("POST", "/v1/completions", content=body)
        assert r.status_code == 400, r.text
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert r.json()["error"]["code"] == code
    big = t.raw("POST", "/v1/completions", content=b'{"prompt": "' + b"x" * (17 << 20) + b'"}')
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    r = t.raw("GET", "/v1/models", headers={"x-padding": "x" * (1 << 20)})
    assert r.status_code == 431 and "headers" in r.json()["error"]["message"]


def test_gateway_charges_embeddings_their_prompt_and_tokenize_nothing(
    targets: dict[str, Target],
) -> None:
    t = targets["gateway"]
    small = {"authorization": f"Bearer {SMALL_KEY}"}
    # vLLM's /tokenize may leave out the model: the tenant's only one is meant.
    before = t.raw("POST", "/tokenize", json={"prompt": "x"}, headers=small)
    assert before.status_code == 200
    start = int(before.headers["x-ratelimit-remaining-tokens"])
    began = time.monotonic()
    embedded = t.raw(
        "POST", "/v1/embeddings", json={"model": MODEL, "input": ["a b c", "d e"]}, headers=small
    )
    used = embedded.json()["usage"]["prompt_tokens"]
    assert used == embedded.json()["usage"]["total_tokens"] > 0
    after = t.raw("POST", "/detokenize", json={"model": MODEL, "tokens": [1, 2]}, headers=small)
    assert after.status_code == 200
    refilled = (time.monotonic() - began) * SMALL_TOKENS_PER_MINUTE / 60
    remaining = int(after.headers["x-ratelimit-remaining-tokens"])
    assert start - used <= remaining <= start - used + math.ceil(refilled) + 1
