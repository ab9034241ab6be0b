"""Mid-stream failover: a stream whose replica dies is continued on another one, invisibly.

The fake replicas number their tokens (id i, text " tok{i}") and resume after the ids they are
given, as our engine does, so a duplicated or missing token shows in the text.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import pytest

from servefleet.bench.fake_upstream import FakeBehaviour, FakeOpenAI
from servefleet.bench.processes import serve_in_thread
from servefleet.gateway.app import Gateway
from servefleet.gateway.stream_splice import StreamSplice, continuation_body, first_body
from tests.support.gateway_rig import served_gateway

TOKENS = 12
AUTH = {"authorization": "Bearer key-a"}
MESSAGES = [{"role": "user", "content": "hello there"}]


class Rig:
    def __init__(self, gateway: Gateway, base: str, fakes: list[FakeOpenAI]) -> None:
        self.gateway, self.base, self.fakes = gateway, base, fakes

    def counter(self, name: str) -> float:
        value = self.gateway.metrics.registry.get_sample_value(name, {"model": "m"})
        return value or 0.0


@pytest.fixture
def rig(request: pytest.FixtureRequest) -> Iterator[Rig]:
    opts: dict[str, Any] = getattr(request, "param", {})
    with ExitStack() as stack:
        fakes = [
            FakeOpenAI(FakeBehaviour(completion_tokens=TOKENS))
            for _ in range(opts.get("replicas", 3))
        ]
        urls = [stack.enter_context(serve_in_thread(f)) for f in fakes]
        gateway, base = served_gateway(
            stack, urls, max_continuations=opts.get("max_continuations", 2)
        )
        yield Rig(gateway, base, fakes)


def stream(rig: Rig, path: str, body: dict[str, Any]) -> tuple[httpx.Response, list[Any]]:
    events: list[Any] = []
    with httpx.stream("POST", rig.base + path, headers=AUTH, json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
    return r, events


def text_of(events: list[Any]) -> str:
    out = ""
    for e in events:
        for c in e.get("choices", []) if isinstance(e, dict) else []:
            out += (c.get("delta") or {}).get("content") or c.get("text") or ""
    return out


def whole() -> str:
    return "".join(f" tok{i}" for i in range(TOKENS))


def kill_all_but_last(rig: Rig, after: int) -> None:
    for fake in rig.fakes[:-1]:
        fake.behaviour.die_after_chunks = after


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_stream_survives_its_replicas_death(rig: Rig, path: str) -> None:
    kill_all_but_last(rig, after=3)
    rig.fakes[-1].behaviour.die_after_chunks = None
    body: dict[str, Any] = {"model": "m", "max_tokens": TOKENS, "stream": True}
    body |= {"messages": MESSAGES} if "chat" in path else {"prompt": "hello there"}
    body["stream_options"] = {"include_usage": True}
    r, events = stream(rig, path, body)
    assert r.headers["x-servefleet-continuation"] == "exact"
    assert text_of(events) == whole()  # nothing repeated, nothing missing, no error
    assert events[-1] == "[DONE]"
    chunks = [e for e in events if isinstance(e, dict)]
    assert not any("error" in e for e in chunks)
    assert {e["id"] for e in chunks} == {"fake-1"}
    assert not any("token_ids" in c for e in chunks for c in e["choices"])
    roles = [c for e in chunks for c in e["choices"] if "role" in (c.get("delta") or {})]
    assert len(roles) == (1 if "chat" in path else 0)
    assert chunks[-1]["usage"]["completion_tokens"] == TOKENS  # the whole answer, once
    # Three replicas, the first two die after three tokens each: two continuations.
    sent = [req for fake in rig.fakes for req in fake.stats.requests]
    resumed = [len(req.get("resume_token_ids") or []) for req in sent]
    assert sorted(resumed) == [0, 3, 6]
    assert len({req["seed"] for req in sent}) == 1  # the gateway's seed, kept
    assert rig.counter("servefleet_gateway_stream_continuations_total") == 2


def test_tokens_are_charged_once(rig: Rig) -> None:
    kill_all_but_last(rig, after=5)
    body = {"model": "m", "messages": MESSAGES, "max_tokens": TOKENS, "stream": True}
    _, events = stream(rig, "/v1/chat/completions", body)
    assert text_of(events) == whole()
    # The client did not ask for usage: it sees none, and is charged the whole answer once
    # (the counters and the settled reservation both come from the last replica's usage).
    assert not any(e.get("usage") for e in events if isinstance(e, dict))
    labels = {"tenant": "a", "model": "m"}
    sample = rig.gateway.metrics.registry.get_sample_value
    deadline = time.monotonic() + 5  # counted just after the last byte went out
    while not sample("servefleet_gateway_completion_tokens_total", labels):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert sample("servefleet_gateway_completion_tokens_total", labels) == TOKENS
    assert sample("servefleet_gateway_prompt_tokens_total", labels) == len("hello there") // 4


@pytest.mark.parametrize("rig", [{"max_continuations": 1}], indirect=True)
def test_an_exhausted_budget_ends_with_a_clean_error_event(rig: Rig) -> None:
    kill_all_but_last(rig, after=2)
    body = {"model": "m", "messages": MESSAGES, "max_tokens": TOKENS, "stream": True}
    _, events = stream(rig, "/v1/chat/completions", body)
    assert text_of(events) == "".join(f" tok{i}" for i in range(4))  # two replicas' worth
    assert events[-1]["error"]["type"] == "upstream_error"
    assert "[DONE]" not in events


@pytest.mark.parametrize("rig", [{"replicas": 1}], indirect=True)
def test_no_other_replica_ends_with_a_clean_error_event(rig: Rig) -> None:
    rig.fakes[0].behaviour.die_after_chunks = 4
    body = {"model": "m", "prompt": "hi", "max_tokens": TOKENS, "stream": True}
    _, events = stream(rig, "/v1/completions", body)
    assert text_of(events) == "".join(f" tok{i}" for i in range(4))
    assert events[-1]["error"]["type"] == "upstream_error"


@pytest.mark.parametrize(
    "field",
    [
        {"return_token_ids": True},
        {"resume_token_ids": [1, 2]},
        {"kv_transfer_params": {"kv_sources": ["http://127.0.0.1:1"]}},
    ],
    ids=lambda f: next(iter(f)),
)
def test_tenants_cannot_send_the_internal_fields(rig: Rig, field: dict[str, Any]) -> None:
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 4, **field}
    r = httpx.post(rig.base + "/v1/chat/completions", headers=AUTH, json=body)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == next(iter(field))
    assert not any(f.stats.requests for f in rig.fakes)


def test_a_whole_answer_is_asked_of_another_replica_once(rig: Rig) -> None:
    kill_all_but_last(rig, after=0)
    body = {"model": "m", "messages": MESSAGES, "max_tokens": TOKENS}
    r = httpx.post(rig.base + "/v1/chat/completions", headers=AUTH, json=body, timeout=30)
    # One retry: the first replica died mid-answer, the second did too, so no third try.
    assert r.status_code == 502
    assert r.json()["error"]["type"] == "upstream_error"
    assert sum(len(f.stats.requests) for f in rig.fakes) == 2


@pytest.mark.parametrize("rig", [{"replicas": 2}], indirect=True)
def test_a_whole_answer_survives_its_replicas_death(rig: Rig) -> None:
    rig.fakes[0].behaviour.die_after_chunks = 0
    for i in range(8):  # prompts until one lands on the dying replica first
        messages = [{"role": "user", "content": f"hello {i}"}]
        body = {"model": "m", "messages": messages, "max_tokens": TOKENS}
        r = httpx.post(rig.base + "/v1/chat/completions", headers=AUTH, json=body, timeout=30)
        assert r.status_code == 200
        assert r.json()["usage"]["completion_tokens"] == TOKENS
        if rig.fakes[0].stats.requests:
            break
    assert len(rig.fakes[0].stats.requests) == 1 and rig.fakes[1].stats.requests


def test_text_continuation_for_engines_that_cannot_resume_from_ids() -> None:
    """vLLM/SGLang get the delivered text as a prefix; their usage is moved back on the way."""
    splice = StreamSplice(chat=True, exact=False)
    first = first_body({"model": "m", "messages": MESSAGES, "max_tokens": 10}, exact=False)
    assert "return_token_ids" not in first and isinstance(first["seed"], int)
    for i in range(3):
        event = {"id": "x", "created": 1, "choices": [{"index": 0, "delta": {"content": f"w{i}"}}]}
        assert splice.rewrite(event) is not None
    body = continuation_body(first, splice)
    assert body["messages"][-1] == {"role": "assistant", "content": "w0w1w2"}
    assert body["continue_final_message"] and not body["add_generation_prompt"]
    assert body["max_tokens"] == 7 and body["seed"] == first["seed"]
    role = {"id": "y", "created": 2, "choices": [{"index": 0, "delta": {"role": "assistant"}}]}
    assert splice.rewrite(role) is None  # the client has had its opening chunk
    last = {"id": "y", "created": 2, "choices": [], "usage": {"prompt_tokens": 13}}
    last["usage"] |= {"completion_tokens": 7, "total_tokens": 20}
    out = splice.rewrite(last)
    assert out is not None and out["id"] == "x" and out["created"] == 1
    assert out["usage"] == {"prompt_tokens": 10, "completion_tokens": 10, "total_tokens": 20}
