"""Resuming a request on the engine (`servefleet.api.stream_resume`): the continuation a gateway
sends after a replica died mid-stream must give exactly what an uninterrupted run gives."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.support.engine_harness import running_engine
from tests.support.http_server import serve_in_thread

MODEL = "smollm2-135m-instruct"
PROMPT = "Write a short story about a lighthouse keeper."


@pytest.fixture(scope="module")
def url(smollm2) -> Iterator[str]:  # type: ignore[no-untyped-def]
    with running_engine(smollm2) as built, serve_in_thread(built) as base:
        yield base


def stream(url: str, body: dict[str, Any]) -> tuple[str, list[int], dict[str, Any]]:
    """(text, token ids, usage) of a streamed completion that reports its token ids."""
    full = {**body, "stream": True, "return_token_ids": True}
    full["stream_options"] = {"include_usage": True}
    text, ids, usage = "", [], {}
    with httpx.stream("POST", f"{url}/v1/completions", json=full, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            usage = event.get("usage") or usage
            for choice in event["choices"]:
                text += choice["text"]
                ids += choice["token_ids"]
    return text, ids, usage


def text_of(url: str, ids: list[int]) -> str:
    r = httpx.post(f"{url}/detokenize", json={"model": MODEL, "tokens": ids}, timeout=30)
    return str(r.json()["prompt"])


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 0},
        # Penalties see the delivered tokens as this replica's own output.
        {"temperature": 0, "frequency_penalty": 1.5, "presence_penalty": 0.5},
        {"temperature": 0.9, "seed": 1234},
    ],
    ids=["greedy", "greedy-penalties", "seeded"],
)
def test_resumed_stream_continues_exactly(url: str, sampling: dict[str, Any]) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 40, "ignore_eos": True, **sampling}
    whole_text, whole_ids, whole_usage = stream(url, body)
    assert len(whole_ids) == 40
    for cut in (1, 17):
        rest_text, rest_ids, usage = stream(url, {**body, "resume_token_ids": whole_ids[:cut]})
        assert whole_ids[:cut] + rest_ids == whole_ids  # nothing repeated, nothing missing
        delivered = len(text_of(url, whole_ids[:cut]))
        assert whole_text[: len(whole_text) - len(rest_text)] + rest_text == whole_text
        assert len(whole_text) - len(rest_text) >= delivered - 1  # at most one char held back
        assert usage["completion_tokens"] == whole_usage["completion_tokens"] == 40
        assert usage["prompt_tokens"] == whole_usage["prompt_tokens"]


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"n": 2}, "n=1"),
        ({"max_tokens": 2}, "max_tokens is 2"),
        ({"resume_token_ids": [10**7]}, "out of range"),
    ],
)
def test_bad_resume_is_refused_naming_the_field(
    url: str, extra: dict[str, Any], needle: str
) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "resume_token_ids": [1, 2]}
    r = httpx.post(f"{url}/v1/completions", json={**body, **extra}, timeout=30)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "resume_token_ids"
    assert needle in error["message"]
