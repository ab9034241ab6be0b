"""The OpenAI API of the engine, over real HTTP, with the real model and the official client."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import torch

from servefleet.engine.kv_plan import resolve_kv_cache_dtype
from servefleet.engine.model.kv_layout import kv_bytes_per_block
from servefleet.engine.process import BuiltEngine
from tests.support.engine_harness import make_engine, running_engine
from tests.support.http_server import openai_client, serve_in_thread

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def built(smollm2) -> Iterator[BuiltEngine]:  # type: ignore[no-untyped-def]
    with running_engine(smollm2, max_queue_depth=64) as engine:
        yield engine


@pytest.fixture(scope="module")
def url(built: BuiltEngine) -> Iterator[str]:
    with serve_in_thread(built) as base:
        yield base


@pytest.fixture()
def client(url: str) -> openai.OpenAI:
    return openai_client(url)


def wait_all_free(built: BuiltEngine, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while built.engine.scheduler.num_unfinished or not built.engine._inbox.empty():
        assert time.monotonic() < deadline, "requests still in the engine"
        time.sleep(0.02)
    built.kv_cache.check_all_free()


def test_chat_answers_paris(client: openai.OpenAI, built: BuiltEngine) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=30,
    )
    assert "Paris" in (reply.choices[0].message.content or "")
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage is not None and reply.usage.prompt_tokens > 5
    wait_all_free(built)


def test_plain_curl_style_body_is_accepted(url: str) -> None:
    # `curl -d` sends application/x-www-form-urlencoded; the body is JSON all the same.
    # ignore_eos: sampling (the default temperature) may end the answer before 4 tokens.
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4,
            "ignore_eos": True}  # fmt: skip
    r = httpx.post(
        f"{url}/v1/completions",
        content=json.dumps(body),
        headers={"content-type": "application/x-www-form-urlencoded"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4


def test_chat_stream_with_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Count from one to five."}],
        temperature=0,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 12
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == ["length"]


def test_streamed_text_equals_non_streamed(client: openai.OpenAI) -> None:
    kwargs = {"model": MODEL, "prompt": "Here is a short poem about the sea:", "max_tokens": 24}
    whole = client.completions.create(temperature=0, **kwargs)  # type: ignore[call-overload]
    parts = client.completions.create(temperature=0, stream=True, **kwargs)  # type: ignore[call-overload]
    assert "".join(p.choices[0].text for p in parts) == whole.choices[0].text


def test_completions_with_token_ids_n_logprobs_and_seed(client: openai.OpenAI, smollm2) -> None:  # type: ignore[no-untyped-def]
    ids = smollm2.tokenizer.encode("Once upon a time", add_special_tokens=False)
    a = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=8, temperature=1.0, seed=7, n=2, logprobs=3
    )
    b = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=8, temperature=1.0, seed=7, n=2, logprobs=3
    )
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len(a.choices) == 2 and a.usage is not None and a.usage.completion_tokens == 16
    lp = a.choices[0].logprobs
    assert lp is not None and len(lp.token_logprobs or []) == 8
    assert all(len(t) == 3 for t in lp.top_logprobs or [])
    assert all(v <= 0 for v in lp.token_logprobs or [])


def test_chat_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)
    # Greedy: the chosen token is the best alternative.
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob) for c in content)


def test_stop_strings_and_stop_token_ids(client: openai.OpenAI, smollm2) -> None:  # type: ignore[no-untyped-def]
    base = client.completions.create(
        model=MODEL, prompt="1, 2, 3, 4,", max_tokens=16, temperature=0
    )
    text = base.choices[0].text
    assert " 7" in text
    cut = client.completions.create(
        model=MODEL, prompt="1, 2, 3, 4,", max_tokens=16, temperature=0, stop=[" 7"]
    )
    assert cut.choices[0].text == text[: text.index(" 7")]
    assert cut.choices[0].finish_reason == "stop"
    first_token = smollm2.tokenizer.encode(text, add_special_tokens=False)[0]
    by_id = client.completions.create(
        model=MODEL,
        prompt="1, 2, 3, 4,",
        max_tokens=16,
        temperature=0,
        extra_body={"stop_token_ids": [first_token]},
    )
    assert by_id.choices[0].finish_reason == "stop"
    assert by_id.usage is not None and by_id.usage.completion_tokens == 1


def test_penalties_reduce_repeated_tokens(client: openai.OpenAI) -> None:
    def repeats(**extra: float) -> int:
        r = client.completions.create(
            model=MODEL, prompt="1, 2, 3, 4,", max_tokens=24, temperature=0, logprobs=0, **extra
        )
        tokens = r.choices[0].logprobs.tokens  # type: ignore[union-attr]
        assert tokens is not None and len(tokens) == 24
        return len(tokens) - len(set(tokens))

    plain = repeats()
    assert plain > 5  # counting repeats ", " over and over
    assert repeats(frequency_penalty=2.0, presence_penalty=2.0) < plain


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        ({"model": "nope", "prompt": "x"}, 404, "does not exist"),
        ({"model": MODEL, "prompt": "x", "temperature": 5}, 400, "temperature"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 9000}, 400, "maximum context length"),
        ({"model": MODEL, "prompt": [999999]}, 400, "out of range"),
        ({"model": MODEL, "prompt": []}, 400, "prompt"),
        ({"model": MODEL, "messages": []}, 400, "prompt"),
        ({"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
        ({"model": MODEL, "prompt": "x", "stop": [""]}, 400, "stop"),
    ],
)
def test_bad_requests_get_openai_errors(url: str, body: dict, status: int, needle: str) -> None:  # type: ignore[type-arg]
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert needle in error["message"]
    assert set(error) == {"message", "type", "param", "code"}


def test_invalid_json_and_chat_errors(url: str) -> None:
    r = httpx.post(f"{url}/v1/chat/completions", content=b"{not json", timeout=30)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": []}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]},
        timeout=30,
    )
    assert r.status_code == 400


def test_text_parts_are_read_and_other_parts_refused(url: str) -> None:
    """A text model honours text parts and refuses an image with a 400 that names the part
    (the gateway answers the same, from the same validation in servefleet.text)."""
    question = [
        {"type": "text", "text": "What is the capital "},
        {"type": "text", "text": "of France?"},
    ]
    bodies = [
        {"model": MODEL, "messages": [{"role": "user", "content": c}], "max_tokens": 1}
        for c in (question, "What is the capital of France?")
    ]
    usages = [httpx.post(f"{url}/v1/chat/completions", json=b, timeout=60).json() for b in bodies]
    assert usages[0]["usage"]["prompt_tokens"] == usages[1]["usage"]["prompt_tokens"]
    image = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    body = {"model": MODEL, "messages": [{"role": "user", "content": [*question, image]}]}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "messages.0.content"
    assert "content part 2 has type 'image_url'" in error["message"]


def test_request_bigger_than_the_cache_is_refused(smollm2) -> None:  # type: ignore[no-untyped-def]
    kv_dtype = resolve_kv_cache_dtype("auto", torch.float32)
    eight_blocks = 8 * kv_bytes_per_block(smollm2.config, 16, kv_dtype)
    small = make_engine(smollm2, kv_cache_memory=str(eight_blocks))
    assert small.kv_cache.num_blocks == 8
    try:
        with serve_in_thread(small) as base:
            r = httpx.post(
                f"{base}/v1/completions",
                json={"model": MODEL, "prompt": "hello", "max_tokens": 200},
                timeout=30,
            )
    finally:
        small.engine.stop()
    assert r.status_code == 400
    assert "KV-cache blocks" in r.json()["error"]["message"]


@pytest.mark.parametrize("kv_cache_dtype", ["float32", "float16"])
def test_kv_cache_dtype_setting(smollm2, kv_cache_dtype: str) -> None:  # type: ignore[no-untyped-def]
    """Either cache dtype serves the same greedy answer; float16 holds twice the tokens."""
    built = make_engine(smollm2, kv_cache_dtype=kv_cache_dtype, kv_cache_memory="64MiB")
    try:
        assert built.engine.runner.kv_caches[0][0].dtype == getattr(torch, kv_cache_dtype)
        per_token = 2 * 30 * 3 * 64 * (4 if kv_cache_dtype == "float32" else 2)
        assert built.kv_cache.num_blocks == (64 << 20) // (16 * per_token)
        with serve_in_thread(built) as base:
            r = httpx.post(
                f"{base}/v1/completions",
                json={"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8,
                      "temperature": 0},
                timeout=60,
            )  # fmt: skip
    finally:
        built.engine.stop()
    assert r.status_code == 200
    assert "Paris" in r.json()["choices"][0]["text"]


def test_auto_kv_cache_dtype() -> None:
    assert resolve_kv_cache_dtype("auto", torch.float32) == torch.float32
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_cache_dtype("float16", torch.float32) == torch.float16


def test_full_queue_answers_503_with_retry_after(smollm2) -> None:  # type: ignore[no-untyped-def]
    tiny = make_engine(smollm2, max_queue_depth=1, max_num_seqs=1)
    try:
        with serve_in_thread(tiny) as base:

            async def burst() -> list[httpx.Response]:
                async with httpx.AsyncClient(timeout=120) as c:
                    body = {"model": MODEL, "prompt": "Tell me a story", "max_tokens": 24}
                    return list(
                        await asyncio.gather(
                            *(c.post(f"{base}/v1/completions", json=body) for _ in range(6))
                        )
                    )

            responses = asyncio.run(burst())
    finally:
        tiny.engine.stop()
    codes = sorted(r.status_code for r in responses)
    assert 200 in codes and 503 in codes
    for r in responses:
        if r.status_code == 503:
            assert int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["code"] == "queue_full"
    tiny.kv_cache.check_all_free()


def test_client_disconnect_aborts_and_frees_blocks(url: str, built: BuiltEngine) -> None:
    body = {"model": MODEL, "prompt": "Write a long essay.", "max_tokens": 2000, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        for i, _line in enumerate(r.iter_lines()):
            if i > 6:
                break  # hang up mid-stream
    wait_all_free(built)
    # Non-streaming requests are aborted too when the client goes away.
    with contextlib.suppress(httpx.TimeoutException):
        httpx.post(
            f"{url}/v1/completions",
            json={**body, "stream": False},
            timeout=1.0,
        )
    wait_all_free(built)


def test_metrics_use_vllm_names(url: str) -> None:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for name in (
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:request_queue_time_seconds_bucket",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:num_preemptions_total",
        "servefleet_engine_step_seconds_bucket",
    ):
        assert f'{name}{{model_name="{MODEL}"' in text or f"{name}{{" in text, name
    generated = [
        line for line in text.splitlines() if line.startswith("vllm:generation_tokens_total")
    ]
    assert float(generated[0].split()[-1]) > 0


def test_health_turns_unhealthy_when_the_loop_dies(smollm2) -> None:  # type: ignore[no-untyped-def]
    doomed = make_engine(smollm2)

    def explode(_out: object) -> None:
        raise RuntimeError("simulated kernel crash")

    try:
        with serve_in_thread(doomed) as base:
            assert httpx.get(f"{base}/health").status_code == 200
            doomed.engine.runner.execute = explode  # type: ignore[method-assign]
            r = httpx.post(
                f"{base}/v1/completions",
                json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                timeout=30,
            )
            assert r.status_code == 500 and "died" in r.json()["error"]["message"]
            health = httpx.get(f"{base}/health")
            assert health.status_code == 503 and "simulated kernel crash" in health.text
            assert httpx.get(f"{base}/ready").status_code == 503
    finally:
        doomed.engine.stop()


def test_health_turns_unhealthy_when_a_step_stalls(smollm2) -> None:  # type: ignore[no-untyped-def]
    stalled = make_engine(smollm2, stall_timeout=0.5)
    real_execute = stalled.engine.runner.execute

    def slow(out):  # type: ignore[no-untyped-def]
        time.sleep(1.5)
        return real_execute(out)

    try:
        with serve_in_thread(stalled) as base:
            stalled.engine.runner.execute = slow  # type: ignore[method-assign]
            body = {"model": MODEL, "prompt": "a", "max_tokens": 1}
            request = threading.Thread(
                target=lambda: httpx.post(f"{base}/v1/completions", json=body, timeout=30)
            )
            request.start()
            time.sleep(1.0)  # inside the 1.5 s step, past the 0.5 s stall timeout
            assert httpx.get(f"{base}/health").status_code == 503
            request.join()
            # The answer can reach the client a moment before the loop leaves the step and
            # beats again: healthy again within a few loop turns, not necessarily at once.
            deadline = time.monotonic() + 5.0
            while httpx.get(f"{base}/health").status_code != 200:
                assert time.monotonic() < deadline, "still unhealthy after the stalled step"
                time.sleep(0.1)
    finally:
        stalled.engine.stop()


def test_cli_flags_reach_the_engine_config() -> None:
    import argparse

    from servefleet.cli import engine_cmd
    from servefleet.engine.config import EngineConfig

    parser = argparse.ArgumentParser()
    engine_cmd.add_arguments(parser)
    args = parser.parse_args(["--model", "m", "--kv-cache-dtype", "float32", "--no-packed-weights"])
    config = EngineConfig(**engine_cmd.engine_settings(args))
    assert config.kv_cache_dtype == "float32" and config.packed_weights is False
    defaults = EngineConfig(**engine_cmd.engine_settings(parser.parse_args(["--model", "m"])))
    assert defaults.kv_cache_dtype == "auto" and defaults.packed_weights is True
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--kv-cache-dtype", "fp8"])  # no fp8 on this engine


def test_sliding_window_caps_the_context_length(smollm2) -> None:  # type: ignore[no-untyped-def]
    from servefleet.engine.config import EngineConfig
    from servefleet.engine.kv_plan import serving_context_length

    config = EngineConfig(model=MODEL)
    windowed = smollm2.config.model_copy(update={"sliding_window": 1024})
    assert serving_context_length(config, smollm2.config) == 8192
    assert serving_context_length(config, windowed) == 1024
    assert serving_context_length(config.model_copy(update={"max_model_len": 512}), windowed) == 512
    wide = smollm2.config.model_copy(update={"sliding_window": 100_000})
    assert serving_context_length(config, wide) == 8192
