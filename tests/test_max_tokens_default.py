"""A request without max_tokens: the gateway reserves exactly what the engine will allow.

One decision (`servefleet.api.max_tokens.completion_budget`): a chat may run to the end of the
context, a completion stops after 16 tokens. Before, the gateway reserved 512 for both while
the engine allowed the rest of the context (chat) or 16 (completion).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from types import SimpleNamespace
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
from servefleet.api.max_tokens import COMPLETIONS_DEFAULT_MAX_TOKENS, completion_budget
from servefleet.bench.fake_upstream import FakeOpenAI
from servefleet.bench.processes import serve_in_thread
from servefleet.engine.request_checks import check_lengths
from servefleet.gateway.app import Gateway
from servefleet.gateway.token_counter import PromptTokenCounter, load_token_counter

BUILTIN = "smollm2-135m-instruct"
LIMIT = 100_000
CONTEXT = 1024
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
PROMPTS = ["Once upon a time", "The gateway and the engine agree"]


@pytest.fixture(scope="module")
def counter() -> PromptTokenCounter:
    return load_token_counter(BUILTIN)


def _engine_allows(ids: list[int], requested: int | None, *, chat: bool) -> int:
    """max_tokens the engine gives one prompt (its own check, with a cache of ample room)."""
    state: Any = SimpleNamespace(max_model_len=CONTEXT, block_size=16, num_kv_blocks=1 << 20)
    return check_lengths(state, ids, requested, "prompt", chat=chat)


@pytest.fixture
def base() -> Iterator[str]:
    with serve_in_thread(FakeOpenAI()) as upstream:
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
                    endpoints=[upstream],
                    tokenizer=BUILTIN,
                    max_model_len=CONTEXT,
                    tenants=[TenantAccess(name="a")],
                )
            ],
        )
        gateway = Gateway(config)
        gateway.set_replicas("d", [upstream], ready=[upstream])
        with serve_in_thread(gateway) as url:
            deadline = time.monotonic() + 120
            while gateway.deployment_stats()[0].prompt_token_count != "tokenizer":
                assert time.monotonic() < deadline, "the tokenizer never loaded"
                time.sleep(0.1)
            yield url


def _reserved(base: str, path: str, body: dict[str, Any]) -> int:
    """Tokens a request reserved in a fresh window (the fake upstream answers 0 tokens, so
    what is left after it settles says nothing: read the reservation from its 200)."""
    r = httpx.post(base + path, json=body, headers={"authorization": "Bearer key-a"})
    assert r.status_code == 200, r.text
    return LIMIT - int(r.headers["x-ratelimit-remaining-tokens"])


def test_a_chat_without_max_tokens_reserves_the_rest_of_the_context(
    base: str, counter: PromptTokenCounter
) -> None:
    prompt = counter.chat(MESSAGES)
    assert prompt is not None
    ids = list(range(prompt))  # the engine counts the same template and vocabulary
    allowed = _engine_allows(ids, None, chat=True)
    assert allowed == CONTEXT - prompt
    body = {"model": "m", "messages": MESSAGES, "n": 2}
    assert _reserved(base, "/v1/chat/completions", body) == prompt + 2 * allowed


def test_a_completion_without_max_tokens_reserves_the_engines_16_per_choice(
    base: str, counter: PromptTokenCounter
) -> None:
    lengths = [len(counter.tokenizer.encode(p)) for p in PROMPTS]
    allowed = [_engine_allows(list(range(n)), None, chat=False) for n in lengths]
    assert allowed == [COMPLETIONS_DEFAULT_MAX_TOKENS] * len(PROMPTS)
    body = {"model": "m", "prompt": PROMPTS, "n": 3}
    assert _reserved(base, "/v1/completions", body) == sum(lengths) + 3 * sum(allowed)


def test_an_asked_max_tokens_is_what_both_use(base: str, counter: PromptTokenCounter) -> None:
    prompt = counter.chat(MESSAGES)
    assert prompt is not None
    assert _engine_allows(list(range(prompt)), 7, chat=True) == 7
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 7}
    assert _reserved(base, "/v1/chat/completions", body) == prompt + 7


def test_the_budget_per_endpoint() -> None:
    assert completion_budget(5, chat=True, prompt_tokens=10, context_length=100) == 5
    assert completion_budget(None, chat=True, prompt_tokens=10, context_length=100) == 90
    assert completion_budget(None, chat=True, prompt_tokens=120, context_length=100) == 0
    assert completion_budget(None, chat=False, prompt_tokens=10, context_length=100) == 16
