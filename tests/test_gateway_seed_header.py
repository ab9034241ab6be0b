"""A resumable stream tells its client the seed it is sampled with (`SEED_HEADER`): the seed the
gateway gave a request without one, kept across a continuation, is the one in the header, so the
client can ask for the same text again (the fault suite compares such streams with a rerun)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import pytest

from servefleet.api.stream_resume import SEED_HEADER
from servefleet.bench.fake_upstream import FakeBehaviour, FakeOpenAI
from servefleet.bench.processes import serve_in_thread
from tests.support.gateway_rig import served_gateway

AUTH = {"authorization": "Bearer key-a"}
BODY: dict[str, Any] = {
    "model": "m",
    "messages": [{"role": "user", "content": "hello"}],
    "max_tokens": 8,
    "temperature": 0.8,
}


@pytest.fixture
def rig() -> Iterator[tuple[str, list[FakeOpenAI]]]:
    """A gateway in front of two fake replicas of eight-token answers."""
    with ExitStack() as stack:
        fakes = [FakeOpenAI(FakeBehaviour(completion_tokens=8)) for _ in range(2)]
        urls = [stack.enter_context(serve_in_thread(f)) for f in fakes]
        _, base = served_gateway(stack, urls)
        yield base, fakes


def _stream(base: str, body: dict[str, Any]) -> httpx.Response:
    with httpx.stream(
        "POST", base + "/v1/chat/completions", headers=AUTH, json={**body, "stream": True}
    ) as response:
        response.read()
    return response


def test_the_seed_the_gateway_assigned_is_in_the_header(
    rig: tuple[str, list[FakeOpenAI]],
) -> None:
    base, fakes = rig
    fakes[0].behaviour.die_after_chunks = 3  # its streams are continued on the other one
    for i in range(8):  # prompts until one lands on the dying replica first
        before = [len(fake.stats.requests) for fake in fakes]
        messages = [{"role": "user", "content": f"hello {i}"}]
        response = _stream(base, {**BODY, "messages": messages})
        assert response.text.rstrip().endswith("data: [DONE]")
        sent = [r for fake, n in zip(fakes, before, strict=True) for r in fake.stats.requests[n:]]
        assert {r["seed"] for r in sent} == {int(response.headers[SEED_HEADER])}
        if len(sent) > 1:
            break
    assert len(sent) == 2, "no stream was continued"


def test_a_clients_own_seed_is_sent_back(rig: tuple[str, list[FakeOpenAI]]) -> None:
    base, fakes = rig
    response = _stream(base, {**BODY, "seed": 1234})
    assert response.headers[SEED_HEADER] == "1234"
    assert [r["seed"] for fake in fakes for r in fake.stats.requests] == [1234]


def test_a_whole_answer_gets_no_seed(rig: tuple[str, list[FakeOpenAI]]) -> None:
    """Only streams are continued, so only they are given a seed (and the header)."""
    base, fakes = rig
    response = httpx.post(base + "/v1/chat/completions", headers=AUTH, json=BODY)
    assert response.status_code == 200 and SEED_HEADER not in response.headers
    assert [r.get("seed") for fake in fakes for r in fake.stats.requests] == [None]
