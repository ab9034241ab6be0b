"""KV cache events on a real engine (SmolLM2, in process): announced only after the step that
wrote the blocks, served as SSE behind the engine key, resumable, and hashed exactly as the
gateway hashes a prompt."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from servefleet.api.kv_blocks import chain, root_hash
from servefleet.api.kv_events import EVENTS_PATH
from servefleet.api.kv_transfer import hash_hex
from servefleet.engine.process import BuiltEngine
from servefleet.engine.sampling_params import SamplingParams
from tests.support.engine_harness import generate, running_engine
from tests.support.http_server import serve_in_thread

MODEL = "smollm2-135m-instruct"
KEY = "events-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = " ".join(f"Line {i}: the ferry leaves at {i % 12 + 1} o'clock." for i in range(12))


@pytest.fixture(scope="module")
def served(smollm2: Any) -> Iterator[tuple[BuiltEngine, str]]:
    with running_engine(smollm2, api_key=KEY, kv_cache_memory="32MiB") as built:
        built.state.api_key = KEY
        with serve_in_thread(built) as url:
            yield built, url


def read_events(
    url: str,
    count: int,
    headers: dict[str, str] | None = None,
    until: Callable[[list[Any]], bool] | None = None,
) -> list[Any]:
    """The first `count` events of a fresh stream (or fewer, once `until` says so): (event,
    id, data) each."""
    out: list[Any] = []
    deadline = time.monotonic() + 30
    event, ident = "", None
    with httpx.stream(
        "GET", url + EVENTS_PATH, headers={**AUTH, **(headers or {})}, timeout=30
    ) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("id: "):
                ident = line[4:]
            elif line.startswith("data: "):
                out.append((event, ident, json.loads(line[6:])))
                event, ident = "", None
                if len(out) == count or (until is not None and until(out)):
                    break
            assert time.monotonic() < deadline, f"no more events after {out}"
    return out


def complete(url: str, prompt: str) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    resp = httpx.post(url + "/v1/completions", json=body, headers=AUTH, timeout=120)
    assert resp.status_code == 200, resp.text


def test_events_need_the_engine_key(served: tuple[BuiltEngine, str]) -> None:
    _, url = served
    assert httpx.get(url + EVENTS_PATH, timeout=10).status_code == 401


def test_a_stream_says_hello_then_snapshot_then_each_steps_blocks(
    served: tuple[BuiltEngine, str],
) -> None:
    built, url = served
    (hello, _, h), (snap_event, snap_id, _snap) = read_events(url, 2)
    assert hello == "hello" and snap_event == "snapshot"
    assert h["block_size"] == 16 and h["num_blocks"] == built.state.num_kv_blocks
    assert h["bytes_per_token"] > 0 and h["epoch"] == built.engine.kv_events.epoch
    complete(url, PROMPT)
    ids = built.state.tokenizer.encode(PROMPT)
    expected = chain(root_hash(None), ids, 16)
    want = [hash_hex(x) for x in expected]

    def stored(events: list[Any]) -> list[str]:
        return [s[0] for e in events[1:] if e[0] == "batch" for s in e[2]["stored"]]

    events = read_events(
        url, 50, {"last-event-id": snap_id}, lambda ev: len(stored(ev)) >= len(want)
    )
    assert events[0][0] == "hello"
    assert stored(events)[: len(want)] == want
    # A fresh stream's snapshot holds them too.
    (_, _, _), (_, _, snap2) = read_events(url, 2)
    held = {s[0] for s in snap2["stored"]}
    assert {hash_hex(x) for x in expected} <= held


def test_an_id_the_ring_moved_past_gets_a_snapshot(served: tuple[BuiltEngine, str]) -> None:
    built, url = served
    epoch = built.engine.kv_events.epoch
    events = read_events(url, 2, {"last-event-id": f"{epoch}-0"})
    if built.engine.kv_events.since(0) is None:
        assert events[1][0] == "snapshot"
    events = read_events(url, 2, {"last-event-id": "otherrun-3"})
    assert events[1][0] == "snapshot"


def test_blocks_are_announced_only_after_the_step_that_wrote_them(
    served: tuple[BuiltEngine, str],
) -> None:
    built, _ = served
    engine = built.engine
    seen: list[tuple[set[int], set[int]]] = []
    execute = engine.runner.execute

    def spy(out: Any) -> Any:
        pending = set(engine._kv_sink.stored)
        logged = {h for b in engine.kv_events.ring for h, _ in b.stored}
        seen.append((pending, logged))
        return execute(out)

    engine.runner.execute = spy  # type: ignore[method-assign]
    try:
        prompt = built.state.tokenizer.encode("A fresh prompt for the spy. " * 8)
        asyncio.run(generate(built, prompt, SamplingParams(max_tokens=2, temperature=0)))
    finally:
        engine.runner.execute = execute  # type: ignore[method-assign]
    first_pending, first_logged = seen[0]
    assert first_pending, "the prefill step published blocks at schedule time"
    assert not first_pending & first_logged, "announced before its KV was written"
    logged = {h for b in engine.kv_events.ring for h, _ in b.stored}
    assert first_pending <= logged


def test_the_gateway_hashes_a_chat_prompt_as_the_engine_caches_it(
    served: tuple[BuiltEngine, str],
) -> None:
    from servefleet.gateway.token_counter import load_token_counter

    _, url = served
    messages = [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Name three rivers of Europe and say where they end. " * 4},
    ]
    counted = load_token_counter(MODEL).chat_counted(messages, 16)
    assert counted is not None and len(counted.block_hashes) >= 4
    body = {"model": MODEL, "messages": messages, "max_tokens": 2, "temperature": 0}
    resp = httpx.post(url + "/v1/chat/completions", json=body, headers=AUTH, timeout=120)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["prompt_tokens"] == counted.tokens
    (_, _, _), (_, _, snap) = read_events(url, 2)
    held = {s[0] for s in snap["stored"]}
    assert {hash_hex(h) for h in counted.block_hashes} <= held
