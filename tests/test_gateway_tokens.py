"""Prompt tokens at admission: the model's tokenizer when it is available, else the estimate."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
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
from servefleet.bench.fake_upstream import FakeOpenAI
from servefleet.bench.processes import serve_in_thread
from servefleet.gateway.app import Gateway
from servefleet.gateway.prompt import PromptReader
from servefleet.gateway.token_counter import PromptTokenCounter, load_token_counter

BUILTIN = "smollm2-135m-instruct"
LIMIT = 100_000
MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "You answer in one word. " * 20},
    {"role": "user", "content": "What is the capital of France?"},
]


@pytest.fixture(scope="module")
def counter() -> PromptTokenCounter:
    return load_token_counter(BUILTIN)


def test_counts_follow_the_chat_template_and_the_vocabulary(counter: PromptTokenCounter) -> None:
    chat = counter.chat(MESSAGES)
    assert chat is not None
    # The template frames each message with role markers the text alone does not have.
    bare = sum(
        len(counter.tokenizer.encode(m["content"], add_special_tokens=False)) for m in MESSAGES
    )
    assert bare < chat < bare + 20
    text = "Once upon a time there was a gateway."
    assert counter.completion(text) == len(counter.tokenizer.encode(text))
    assert counter.completion([text, text]) == 2 * len(counter.tokenizer.encode(text))
    assert counter.completion([1, 2, 3]) is None  # ids: the reader counts those exactly
    estimate = PromptReader().chat(MESSAGES).estimated_tokens
    assert estimate != chat  # the estimate really is only an estimate


def test_text_parts_count_as_their_text(counter: PromptTokenCounter) -> None:
    parts = [
        {"type": "text", "text": "What is the capital "},
        {"type": "text", "text": "of France?"},
    ]
    as_parts = [MESSAGES[0], {"role": "user", "content": parts}]
    assert counter.chat(as_parts) == counter.chat(MESSAGES)


def test_a_source_that_is_not_here_is_a_clear_error(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match="not a built-in, a file or a folder"):
        load_token_counter(str(tmp_path / "missing.gguf"))


def gateway_for(endpoint: str, tokenizer: str) -> Gateway:
    config = GatewayConfig(
        tenants=[
            GatewayTenant(
                name="a",
                api_keys=[ApiKeyRef(sha256=hash_api_key("key-a"))],
                limits=TenantLimits(tokens_per_minute=LIMIT),
            )
        ],
        deployments=[
            GatewayDeployment(
                name="d",
                model="m",
                endpoints=[endpoint],
                tokenizer=tokenizer,
                tenants=[TenantAccess(name="a")],
            )
        ],
    )
    gateway = Gateway(config)
    gateway.set_replicas("d", [endpoint], ready=[endpoint])
    return gateway


@pytest.fixture
def upstream() -> Iterator[str]:
    with serve_in_thread(FakeOpenAI()) as url:
        yield url


def reserved(base: str) -> int:
    """Tokens the first request of a fresh window reserved: prompt + max_tokens (10)."""
    r = httpx.post(
        base + "/v1/chat/completions",
        json={"model": "m", "messages": MESSAGES, "max_tokens": 10},
        headers={"authorization": "Bearer key-a"},
    )
    assert r.status_code == 200
    return LIMIT - int(r.headers["x-ratelimit-remaining-tokens"]) - 10


def test_the_gateway_reserves_the_tokenizers_count_once_loaded(
    upstream: str, counter: PromptTokenCounter
) -> None:
    gateway = gateway_for(upstream, BUILTIN)
    with serve_in_thread(gateway) as base:
        deadline = time.monotonic() + 120
        while gateway.deployment_stats()[0].prompt_token_count != "tokenizer":
            assert time.monotonic() < deadline, "the tokenizer never loaded"
            time.sleep(0.1)
        assert reserved(base) == counter.chat(MESSAGES)


def test_without_the_model_here_the_estimate_is_reserved(
    upstream: str, tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    gateway = gateway_for(upstream, str(tmp_path / "not-here.gguf"))
    with serve_in_thread(gateway) as base:
        deadline = time.monotonic() + 10
        while "not loaded" not in caplog.text:
            assert time.monotonic() < deadline, "no log line about the missing tokenizer"
            time.sleep(0.05)
        assert gateway.deployment_stats()[0].prompt_token_count == "estimate"
        assert reserved(base) == PromptReader().chat(MESSAGES).estimated_tokens


def test_an_image_part_is_refused_with_a_400_naming_it(upstream: str) -> None:
    """A text model cannot read an image: the gateway refuses it before reserving anything,
    with the same message the engine gives, instead of counting only the text around it."""
    gateway = gateway_for(upstream, BUILTIN)
    image = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    content = [{"type": "text", "text": "What is this?"}, image]
    with serve_in_thread(gateway) as base:
        r = httpx.post(
            base + "/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": content}]},
            headers={"authorization": "Bearer key-a"},
        )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "messages.0.content"
    assert "content part 1 has type 'image_url'" in error["message"]
    assert "x-ratelimit-remaining-tokens" not in r.headers
