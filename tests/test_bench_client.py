"""The bench client against a small in-test OpenAI-compatible streaming server."""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from servefleet.bench.benchmark import BenchOptions, make_prompts, run_benchmark
from servefleet.bench.client import RequestResult
from servefleet.bench.report import percentile, summarize
from servefleet.cli import bench_cmd


@dataclass
class FakeServer:
    """Knobs of the fake server and what it saw."""

    base_url: str = ""
    accepts_stream_options: bool = True
    tokens_per_chunk: int = 1
    token_delay_s: float = 0.001
    fail_when: Callable[[dict[str, Any]], bool] = lambda body: False
    hang_when: Callable[[dict[str, Any]], bool] = lambda body: False
    break_stream_when: Callable[[dict[str, Any]], bool] = lambda body: False
    bodies: list[dict[str, Any]] = field(default_factory=list)
    auth_headers: list[str | None] = field(default_factory=list)


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _make_app(server: FakeServer) -> FastAPI:
    app = FastAPI()

    async def handle(request: Request, chat: bool) -> Any:
        body = await request.json()
        server.bodies.append(body)
        server.auth_headers.append(request.headers.get("authorization"))
        if "stream_options" in body and not server.accepts_stream_options:
            return JSONResponse(
                {"error": {"message": "unknown field stream_options", "type": "invalid"}}, 400
            )
        if server.fail_when(body):
            return JSONResponse({"error": {"message": "boom", "type": "server_error"}}, 500)
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        max_tokens = int(body["max_tokens"])
        prompt_tokens = len(body["prompt"]) if not chat and isinstance(body["prompt"], list) else 7

        async def stream() -> AsyncIterator[str]:
            if server.hang_when(body):
                await asyncio.sleep(30)
            if chat:
                yield _sse(
                    {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
                )
            sent = 0
            while sent < max_tokens:
                await asyncio.sleep(server.token_delay_s)
                n = min(server.tokens_per_chunk, max_tokens - sent)
                sent += n
                text = " tok" * n
                finish = "length" if sent == max_tokens else None
                choice: dict[str, Any] = (
                    {"index": 0, "delta": {"content": text}, "finish_reason": finish}
                    if chat
                    else {"index": 0, "text": text, "finish_reason": finish}
                )
                yield _sse({"choices": [choice]})
                if sent == 2 and server.break_stream_when(body):
                    yield _sse({"error": {"message": "engine died", "type": "server_error"}})
                    yield "data: [DONE]\n\n"
                    return
            if include_usage:
                usage = {"prompt_tokens": prompt_tokens, "completion_tokens": max_tokens}
                yield _sse({"choices": [], "usage": usage})
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await handle(request, chat=True)

    return app


@pytest.fixture
def fake_server() -> Iterator[FakeServer]:
    state = FakeServer()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        _make_app(state), log_level="warning", lifespan="off", timeout_graceful_shutdown=2
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("fake server did not start")
        time.sleep(0.02)
    state.base_url = f"http://127.0.0.1:{port}"
    yield state
    server.should_exit = True
    thread.join(timeout=10)
    sock.close()


def _options(server: FakeServer, **overrides: Any) -> BenchOptions:
    params: dict[str, Any] = {
        "url": server.base_url,
        "model": "fake",
        "concurrency": 4,
        "num_prompts": 12,
        "input_tokens": 20,
        "output_tokens": 6,
        "warmup": 3,
        "seed": 7,
        **overrides,
    }
    return BenchOptions(**params)


async def test_counts_tokens_from_usage_and_excludes_warmup(fake_server: FakeServer) -> None:
    fake_server.tokens_per_chunk = 2  # usage, not the chunk count, must give the token count
    options = _options(fake_server, api_key="sekret")
    run = await run_benchmark(options)
    s = run.summary
    assert len(fake_server.bodies) == 12 + 3  # warm-up was sent ...
    assert s.completed == 12 and s.failed == 0 and s.errors == []  # ... but not counted
    assert s.total_output_tokens == 12 * 6
    assert s.output_tokens_source == "usage"
    assert s.total_input_tokens == 12 * 20 and s.mean_input_tokens == 20
    assert s.parameters["stream_usage"] is True
    assert "sekret" not in json.dumps(s.model_dump(mode="json"))
    assert set(fake_server.auth_headers) == {"Bearer sekret"}
    body = fake_server.bodies[-1]
    assert body["ignore_eos"] is True and body["temperature"] == 0 and body["max_tokens"] == 6
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    # Token-id prompts, exactly the measured ones, in order after the warm-up.
    measured, warmup = make_prompts(options)
    sent = [b["prompt"] for b in fake_server.bodies]
    assert sorted(map(tuple, sent[:3])) == sorted(tuple(p.token_ids or []) for p in warmup)
    assert sorted(map(tuple, sent[3:])) == sorted(tuple(p.token_ids or []) for p in measured)


async def test_falls_back_to_chunk_counting_without_usage(fake_server: FakeServer) -> None:
    fake_server.accepts_stream_options = False
    run = await run_benchmark(_options(fake_server))
    s = run.summary
    assert s.failed == 0
    assert s.parameters["stream_usage"] is False
    assert s.output_tokens_source == "chunks"
    assert s.total_output_tokens == 12 * 6
    # Without usage, input tokens are the prompt lengths we generated.
    assert s.total_input_tokens == 12 * 20
    # One first token and five gaps per request; TPOT for every request.
    assert s.ttft_ms.count == 12 and s.itl_ms.count == 12 * 5 and s.tpot_ms.count == 12
    assert s.ttft_ms.p50 is not None and s.e2e_latency_ms.p50 is not None
    assert 0 < s.ttft_ms.p50 <= s.e2e_latency_ms.p50
    assert s.e2e_latency_ms.p99 is not None and s.e2e_latency_ms.p50 <= s.e2e_latency_ms.p99
    # Throughputs are the totals over the measured duration.
    assert s.output_token_throughput_tps == pytest.approx(s.total_output_tokens / s.duration_s)
    assert s.request_throughput_rps == pytest.approx(12 / s.duration_s)


async def test_server_errors_are_counted_as_failures(fake_server: FakeServer) -> None:
    fake_server.fail_when = lambda body: body["prompt"][0] % 3 == 0
    options = _options(fake_server, num_prompts=30)
    measured, _ = make_prompts(options)
    expected_failures = sum(1 for p in measured if (p.token_ids or [0])[0] % 3 == 0)
    assert 0 < expected_failures < 30  # the seed gives a mix
    s = (await run_benchmark(options)).summary
    assert s.failed == expected_failures
    assert s.completed == 30 - expected_failures
    assert s.total_output_tokens == s.completed * 6
    assert len(s.errors) == 1 and s.errors[0].startswith("HTTP 500") and "boom" in s.errors[0]


async def test_error_event_mid_stream_is_a_failure(fake_server: FakeServer) -> None:
    fake_server.break_stream_when = lambda body: body["prompt"][0] % 2 == 1
    options = _options(fake_server, warmup=0)
    measured, _ = make_prompts(options)
    broken = sum(1 for p in measured if (p.token_ids or [0])[0] % 2 == 1)
    assert 0 < broken < 12
    s = (await run_benchmark(options)).summary
    assert s.failed == broken and s.errors == ["engine died"]
    assert s.total_output_tokens == (12 - broken) * 6


async def test_chat_endpoint_sends_text_and_system_prefix(fake_server: FakeServer) -> None:
    options = _options(
        fake_server,
        endpoint="chat",
        workload="shared-prefix",
        shared_prefix_tokens=15,
        num_prefixes=2,
        warmup=0,
    )
    s = (await run_benchmark(options)).summary
    assert s.failed == 0 and s.total_output_tokens == 12 * 6
    # The role-only first delta is not a token: one TTFT and five gaps per request.
    assert s.itl_ms.count == 12 * 5
    systems = set()
    for body in fake_server.bodies:
        system, user = body["messages"]
        assert system["role"] == "system" and user["role"] == "user"
        assert len(system["content"].split()) == 15 and len(user["content"].split()) == 20
        systems.add(system["content"])
    assert len(systems) == 2


async def test_request_timeout_marks_only_the_slow_requests(fake_server: FakeServer) -> None:
    fake_server.hang_when = lambda body: body["prompt"][0] % 2 == 0
    options = _options(fake_server, warmup=0, request_timeout_s=0.5)
    measured, _ = make_prompts(options)
    slow = sum(1 for p in measured if (p.token_ids or [0])[0] % 2 == 0)
    s = (await run_benchmark(options)).summary
    assert s.failed == slow and s.completed == 12 - slow
    assert s.errors == ["request timed out after 0.5s"]


async def test_total_timeout_stops_the_run(fake_server: FakeServer) -> None:
    fake_server.hang_when = lambda body: True
    s = (await run_benchmark(_options(fake_server, warmup=0, total_timeout_s=0.5))).summary
    assert s.completed == 0 and s.failed == 12 and s.output_tokens_source == "none"
    assert s.errors == ["total timeout reached"]


def test_percentile_matches_numpy_linear() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 99) == pytest.approx(99.01)
    rng = np.random.default_rng(0)
    sample = rng.exponential(size=37).tolist()
    for q in (0, 1, 25, 50, 90, 99, 100):
        assert percentile(sample, q) == pytest.approx(float(np.percentile(sample, q)))
    with pytest.raises(ValueError):
        percentile(values, 101)


def test_summary_on_known_results() -> None:
    # Two requests with hand-made timings: TTFT 0.1 and 0.3 s; chunks every 0.1 / 0.2 s.
    a = RequestResult(index=0, start=0.0, end=0.4, chunk_times=[0.1, 0.2, 0.3, 0.4])
    b = RequestResult(index=1, start=0.0, end=0.7, chunk_times=[0.3, 0.5, 0.7])
    a.prompt_tokens_sent = b.prompt_tokens_sent = 10
    c = RequestResult(index=2, start=0.0, end=0.1, error="HTTP 500: x")
    s = summarize([a, b, c], duration_s=1.0, parameters={})
    assert (s.completed, s.failed, s.errors) == (2, 1, ["HTTP 500: x"])
    assert s.total_output_tokens == 7 and s.total_input_tokens == 20
    assert s.output_token_throughput_tps == pytest.approx(7.0)
    assert s.ttft_ms.mean == pytest.approx(200.0)
    assert s.ttft_ms.p50 == pytest.approx(200.0)
    assert s.ttft_ms.p99 == pytest.approx(100 + 200 * 0.99)
    # TPOT: (0.4-0.1)/3 = 0.1 s and (0.7-0.3)/2 = 0.2 s.
    assert s.tpot_ms.mean == pytest.approx(150.0)
    # ITL samples: 100, 100, 100, 200, 200 ms.
    assert s.itl_ms.count == 5 and s.itl_ms.p50 == pytest.approx(100.0)
    assert s.itl_ms.mean == pytest.approx(140.0)
    assert s.e2e_latency_ms.p50 == pytest.approx(550.0)


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_cmd.add_arguments(parser)
    return parser.parse_args(argv)


def _cli_args(server: FakeServer, *extra: str) -> list[str]:
    return [
        "--url", server.base_url + "/v1", "--model", "fake", "--concurrency", "3",
        "--num-prompts", "8", "--input-tokens", "10", "--output-tokens", "5", "--warmup", "1",
        *extra,
    ]  # fmt: skip


def test_cli_prints_json_and_writes_json_and_png(
    fake_server: FakeServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "results" / "run.json"
    code = bench_cmd.run(_parse(_cli_args(fake_server, "--out", str(out))))
    assert code == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text())
    assert printed["completed"] == 8 and printed["total_output_tokens"] == 40
    assert printed["parameters"]["workload"] == "random"
    png = out.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_exit_code_reports_failures(
    fake_server: FakeServer, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_server.fail_when = lambda body: True
    assert bench_cmd.run(_parse(_cli_args(fake_server))) == 1
    assert json.loads(capsys.readouterr().out)["failed"] == 8


def test_cli_rejects_bad_options(capsys: pytest.CaptureFixture[str]) -> None:
    args = _parse(["--url", "http://127.0.0.1:9", "--model", "m", "--concurrency", "0"])
    assert bench_cmd.run(args) == 2
    assert "--concurrency" in capsys.readouterr().err
    args = _parse(["--url", "http://127.0.0.1:9", "--model", "m", "--timeout", "-1"])
    assert bench_cmd.run(args) == 2
    assert "--timeout" in capsys.readouterr().err
