"""The engine's boundary without a model: which paths need its key, method errors, request caps,
and the preparation pool's queue and time budget (issue 23)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any
from unittest.mock import MagicMock

import httpx
import pytest

from servefleet.api import request_caps as caps
from servefleet.api.openai_errors import OpenAIError
from servefleet.api.openai_requests import ChatCompletionRequest, CompletionRequest
from servefleet.api.openai_wire import validate
from servefleet.engine.prepare_pool import Budget, Preparer
from servefleet.engine.server import build_app
from servefleet.engine.serving_state import ServingState

KEY = "sekret-ключ"  # a key that is not ASCII compares as bytes too


def _state(**overrides: Any) -> ServingState:
    engine = MagicMock()
    engine.is_healthy.return_value = (True, "ok")
    engine.metrics.render.return_value = b""
    settings: dict[str, Any] = {
        "engine": engine, "tokenizer": MagicMock(), "chat_template": MagicMock(),
        "served_model_name": "m", "max_model_len": 64, "block_size": 16, "num_kv_blocks": 4,
        "max_queue_depth": 4, "ready": True, "api_key": KEY,
    }  # fmt: skip
    return ServingState(**(settings | overrides))


def _client(state: ServingState) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=build_app(state))
    return httpx.AsyncClient(transport=transport, base_url="http://engine")


async def test_every_path_but_the_probes_needs_the_engine_key() -> None:
    async with _client(_state()) as client:
        for path in ("/tokenize", "/detokenize"):
            response = await client.post(path, json={"prompt": "hi", "tokens": [1]})
            assert response.status_code == 401, path
            assert response.json()["error"]["code"] == "invalid_api_key"
        for path in ("/openapi.json", "/v1/models", "/no/such/path"):
            assert (await client.get(path)).status_code == 401, path
        for path in ("/health", "/ready", "/metrics", "/version"):
            assert (await client.get(path)).status_code == 200, path
        keyed = [(b"authorization", f"Bearer {KEY}".encode())]
        assert (await client.get("/openapi.json", headers=keyed)).status_code == 200


async def test_a_bearer_that_is_not_ascii_is_a_401_never_a_500() -> None:
    async with _client(_state()) as client:
        for token in ("Bearer ключ".encode(), b"Bearer \xff\xfe", "Bearer sekret-ключX".encode()):
            response = await client.post(
                "/tokenize", json={"prompt": "hi"}, headers=[(b"authorization", token)]
            )
            assert response.status_code == 401
            assert response.json()["error"]["code"] == "invalid_api_key"


async def test_a_wrong_method_is_405_with_allow_and_an_unknown_path_404() -> None:
    async with _client(_state(api_key=None)) as client:
        wrong = await client.get("/v1/chat/completions")
        assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
        assert wrong.json()["error"]["code"] == "method_not_allowed"
        assert (await client.delete("/health")).status_code == 405
        unknown = await client.get("/v1/nothing-here")
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "not_found"


async def test_detokenize_refuses_more_ids_than_the_context_before_decoding() -> None:
    state = _state(api_key=None)
    async with _client(state) as client:
        response = await client.post("/detokenize", json={"tokens": [1] * 65})
    assert response.status_code == 400 and response.json()["error"]["param"] == "tokens"
    decode = state.tokenizer.decode
    assert isinstance(decode, MagicMock) and not decode.called


# ---- caps at validation, shared with the gateway -------------------------------------------
def _refusal(model: type, body: dict[str, Any]) -> OpenAIError:
    with pytest.raises(OpenAIError) as err:
        validate(model, body)
    assert err.value.status == 400
    return err.value


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def _tools(functions: int, properties: int) -> list[dict[str, Any]]:
    schema = {"type": "object", "properties": {f"p{j}": {"type": "string"}
                                               for j in range(properties)}}  # fmt: skip
    return [{"type": "function", "function": {"name": f"f{i}", "parameters": schema}}
            for i in range(functions)]  # fmt: skip


def test_the_issues_tools_list_is_refused_naming_tools() -> None:
    started = time.monotonic()
    refused = _refusal(ChatCompletionRequest, {**CHAT, "tools": _tools(50, 200)})  # ~0.3 MB
    assert refused.param == "tools"
    assert time.monotonic() - started < 5  # no template, no tokenizer, no compiler
    assert _refusal(ChatCompletionRequest, {**CHAT, "tools": _tools(129, 1)}).param == "tools"
    # 128 functions with small schemas, as OpenAI allows, pass.
    validate(ChatCompletionRequest, {**CHAT, "tools": _tools(128, 8)})


def test_guides_and_schemas_are_bounded() -> None:
    many = [f"choice {i}" for i in range(100_000)]
    assert _refusal(
        CompletionRequest, {"model": "m", "prompt": "x", "guided_choice": many}
    ).param == ("guided_choice")
    fine = {"model": "m", "prompt": "x", "guided_choice": many[: caps.MAX_GUIDED_CHOICES]}
    validate(CompletionRequest, fine)
    regex = "a" * (caps.MAX_REGEX_BYTES + 1)
    assert _refusal(CompletionRequest, {"model": "m", "prompt": "x", "guided_regex": regex}).param
    big = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(5001)}}
    body = {**CHAT, "response_format": {"type": "json_schema",
                                        "json_schema": {"name": "n", "schema": big}}}  # fmt: skip
    assert "response_format" in (_refusal(ChatCompletionRequest, body).param or "")
    assert _refusal(CompletionRequest, {"model": "m", "prompt": "x", "guided_json": big}).param == (
        "guided_json"
    )


def test_priority_logit_bias_and_prompt_counts_are_bounded() -> None:
    assert _refusal(
        CompletionRequest, {"model": "m", "prompt": "x", "priority": -(10**30)}
    ).param == ("priority")
    validate(CompletionRequest, {"model": "m", "prompt": "x", "priority": -caps.PRIORITY_BOUND})
    huge_key = {"9" * 4400: 1.0}
    refused = _refusal(CompletionRequest, {"model": "m", "prompt": "x", "logit_bias": huge_key})
    assert refused.param == "logit_bias" and len(refused.message) < 500
    prompts = ["x"] * (caps.MAX_PROMPTS + 1)
    assert _refusal(CompletionRequest, {"model": "m", "prompt": prompts}).param == "prompt"


# ---- the preparation pool ------------------------------------------------------------------
async def test_a_full_preparation_queue_is_a_503_with_retry_after() -> None:
    preparer = Preparer(budget_s=30, workers=1, queue=0)
    release = threading.Event()
    try:
        first = asyncio.ensure_future(
            preparer.run(lambda _: release.wait(10), request_id="r1", param="messages")
        )
        await asyncio.sleep(0.2)
        with pytest.raises(OpenAIError) as err:
            await preparer.run(lambda _: None, request_id="r2", param="messages")
        assert err.value.status == 503 and err.value.code == "prepare_queue_full"
        assert int(err.value.headers["Retry-After"]) >= 1
        # Small requests are prepared inline and never wait behind a big one.
        assert await preparer.run(lambda _: 7, request_id="r3", param="x", inline=True) == 7
        release.set()
        assert await first is True
        assert preparer.pending == 0
    finally:
        release.set()
        preparer.shutdown()


async def test_a_preparation_past_its_budget_is_refused_once_naming_the_field(
    caplog: pytest.LogCaptureFixture,
) -> None:
    preparer = Preparer(budget_s=0.3, workers=1, queue=1)

    def slow_stage(budget: Budget) -> None:
        time.sleep(0.5)
        budget.check("tools", "chat template")

    try:
        loop = asyncio.get_running_loop()
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.02)
                ticks += 1

        ticker = loop.create_task(tick())
        with pytest.raises(OpenAIError) as err:
            await preparer.run(slow_stage, request_id="chatcmpl-x1", param="messages")
        ticker.cancel()
        assert err.value.status == 400 and err.value.code == "request_too_complex"
        assert err.value.param == "tools"
        assert ticks >= 5  # the event loop kept running while the stage ran on a worker
        lines = [r for r in caplog.records if "request_too_complex" in r.getMessage()]
        assert len(lines) == 1 and "chatcmpl-x1" in lines[0].getMessage()
    finally:
        preparer.shutdown()


async def test_a_stage_that_cannot_be_cut_is_answered_at_budget_and_grace() -> None:
    preparer = Preparer(budget_s=0.2, workers=1, queue=1)
    release = threading.Event()
    try:
        started = time.monotonic()
        with pytest.raises(OpenAIError) as err:
            await preparer.run(lambda _: release.wait(30), request_id="r", param="prompt")
        assert err.value.code == "request_too_complex" and err.value.param == "prompt"
        assert time.monotonic() - started < 15  # not the 30 s the stage would have taken
        assert preparer.pending == 1  # its worker is still busy, and still counted
    finally:
        release.set()
        preparer.shutdown()
