"""One tenant's huge prompts cannot starve the gateway: `/health` keeps answering.

Tokenizing a 15 MB message took 30 s on the event loop and 2.5 GB of memory. Now a prompt
whose length alone proves it longer than the model's context is refused before anything
tokenizes it, and exact counts run on a bounded worker off the event loop (`token_counter`).
The gateway here has the real SmolLM2 tokenizer (8192-token context, tokens of at most 81
bytes) and is probed every 50 ms while the prompts arrive.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
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
from servefleet.bench.fake_upstream import FakeOpenAI
from servefleet.bench.processes import serve_in_thread
from servefleet.gateway.app import Gateway
from servefleet.gateway.token_counter import (
    EXACT_COUNT_MAX_CHARS,
    CountingWorker,
    PromptTokenCounter,
    load_token_counter,
)

BUILTIN = "smollm2-135m-instruct"
AUTH = {"authorization": "Bearer key-a"}
HEALTH_BOUND_S = 2.0  # generous on a loaded 2-core box; the stall was 30 s


@pytest.fixture(scope="module")
def counter() -> PromptTokenCounter:
    return load_token_counter(BUILTIN)


def serve_gateway(stack: ExitStack, counter: PromptTokenCounter, **deployment: Any) -> str:
    upstream = stack.enter_context(serve_in_thread(FakeOpenAI()))
    config = GatewayConfig(
        tenants=[GatewayTenant(name="a", api_keys=[ApiKeyRef(sha256=hash_api_key("key-a"))])],
        deployments=[
            GatewayDeployment(name="d", model="m", tenants=[TenantAccess(name="a")], **deployment)
        ],
        internal_port=None,
    )
    gateway = Gateway(config)
    gateway.pools["d"].token_counter = counter  # loaded once for the module
    gateway.set_replicas("d", [upstream], ready=[upstream])
    return stack.enter_context(serve_in_thread(gateway))


@pytest.fixture
def base(counter: PromptTokenCounter) -> Iterator[str]:
    with ExitStack() as stack:
        yield serve_gateway(stack, counter)


class HealthProbe:
    """Asks /health every 50 ms on its own thread; remembers the slowest answer."""

    def __init__(self, base: str) -> None:
        self._base = base
        self._stop = threading.Event()
        self.slowest = 0.0
        self.answers = 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        with httpx.Client(timeout=60) as client:
            while not self._stop.is_set():
                started = time.monotonic()
                assert client.get(self._base + "/health").status_code == 200
                self.slowest = max(self.slowest, time.monotonic() - started)
                self.answers += 1
                self._stop.wait(0.05)


def post_all(base: str, bodies: list[dict[str, Any]]) -> list[httpx.Response]:
    async def send() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=base, headers=AUTH, timeout=120) as client:
            return await asyncio.gather(
                *(client.post("/v1/chat/completions", json=b) for b in bodies)
            )

    return asyncio.run(send())


def chat(content: str) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 4}


def test_health_answers_while_15_mb_messages_arrive(base: str) -> None:
    huge = "hello world this is a test. " * 540_000  # 15.1 M characters
    with HealthProbe(base) as probe:
        answers = post_all(base, [chat(huge) for _ in range(3)])
    for answer in answers:
        assert answer.status_code == 400, answer.text[:200]
        error = answer.json()["error"]
        assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
        assert "8192" in error["message"]
    assert probe.answers > 0
    assert probe.slowest < HEALTH_BOUND_S, probe.slowest


def test_health_answers_while_long_prompts_are_counted(
    base: str, counter: PromptTokenCounter
) -> None:
    # Within the length bound (8192 tokens x 81 characters), so each is really tokenized:
    # ~1 s apiece here, on the worker, while the loop goes on answering.
    long = "hello world this is a test. " * 23_000  # 644,000 characters
    assert counter.at_least(len(long)) <= 8192 < len(long)
    with HealthProbe(base) as probe:
        answers = post_all(base, [chat(long) for _ in range(4)])
    assert all(a.status_code == 200 for a in answers), [a.text[:200] for a in answers]
    assert probe.slowest < HEALTH_BOUND_S, probe.slowest


def test_a_deployments_own_context_bounds_each_prompt(counter: PromptTokenCounter) -> None:
    long = "x" * (1024 * counter.longest_token_chars + 1)  # more than 1,024 tokens, surely
    with ExitStack() as stack:
        base = serve_gateway(stack, counter, max_model_len=1024)
        chat_answer = post_all(base, [chat(long)])[0]
        assert chat_answer.status_code == 400 and "1024 tokens" in chat_answer.text
        prompts = {"model": "m", "prompt": ["short", long], "max_tokens": 2}
        listed = httpx.post(base + "/v1/completions", headers=AUTH, json=prompts, timeout=60)
        assert listed.status_code == 400
        assert listed.json()["error"]["param"] == "prompt"
        fits = {"model": "m", "prompt": ["short", long[:20_000]], "max_tokens": 2}
        assert httpx.post(base + "/v1/completions", headers=AUTH, json=fits).status_code == 200


def test_the_length_bound_holds_for_the_real_tokenizer(counter: PromptTokenCounter) -> None:
    # Never a false refusal: every text has at least `at_least` tokens, the worst case too.
    for text in ["#" * 80 * 50, " " * 5000, "\n" * 300 + "a", "héllo wörld " * 400]:
        assert counter.at_least(len(text)) <= len(counter.tokenizer.encode(text))


async def test_a_full_worker_answers_none_at_once_and_the_estimate_is_used() -> None:
    worker = CountingWorker(threads=1, max_pending=1)
    release = threading.Event()
    first = asyncio.ensure_future(worker.run(lambda: release.wait(30) and 7))
    while worker.pending == 0:
        await asyncio.sleep(0.01)
    assert await worker.run(lambda: 1) is None  # busy: no waiting in line
    release.set()
    assert await first == 7
    assert await worker.run(lambda: 3) == 3
    assert worker.pending == 0


async def test_texts_over_the_exact_limit_are_never_tokenized(
    counter: PromptTokenCounter,
) -> None:
    def must_not_run() -> int:
        raise AssertionError("tokenized")

    assert await counter.count(must_not_run, EXACT_COUNT_MAX_CHARS + 1) is None
