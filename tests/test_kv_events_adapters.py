"""The engine's KV event stream carries its resident LoRA adapters' identities (hello, and the
first batch after a load or unload), and a gateway index fed by that stream hashes an adapter's
prompt exactly as the engine chains and announces its blocks (SmolLM2, loopback HTTP)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from servefleet.api.kv_blocks import chain, root_hash
from servefleet.api.kv_transfer import hash_hex
from servefleet.bench.make_adapters import random_adapter
from servefleet.engine.process import BuiltEngine
from servefleet.gateway.endpoints import chain_root
from servefleet.gateway.kv_index import KVIndex
from servefleet.gateway.kv_subscriber import apply_event
from tests.support.engine_harness import running_engine
from tests.support.http_server import serve_in_thread
from tests.test_kv_events_engine import AUTH, KEY, PROMPT, read_events


@pytest.fixture(scope="module")
def served(smollm2: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    adapter = random_adapter(tmp_path_factory.mktemp("adapters") / "x", seed=7, rank=8)
    settings = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8}
    with running_engine(smollm2, api_key=KEY, kv_cache_memory="32MiB", **settings) as built:
        built.state.api_key = KEY
        with serve_in_thread(built) as url:
            yield built, url, adapter


def post(url: str, path: str, body: dict[str, Any]) -> None:
    resp = httpx.post(url + path, json=body, headers=AUTH, timeout=120)
    assert resp.status_code == 200, resp.text


def adapters_told(events: list[Any]) -> list[dict[str, int]]:
    return [data["adapters"] for _, _, data in events if "adapters" in data]


def test_the_stream_tells_the_adapters_and_the_gateway_hashes_their_prompts(
    served: tuple[BuiltEngine, str, Path],
) -> None:
    built, url, adapter_dir = served
    opened = threading.Event()

    def until_told(events: list[Any]) -> bool:
        opened.set()  # the hello is out: a load from now on is told by a batch
        return len(adapters_told(events)) > 2

    with ThreadPoolExecutor(1) as pool:
        reading = pool.submit(read_events, url, 50, None, until_told)
        assert opened.wait(30)
        post(url, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(adapter_dir)})
        told = reading.result(timeout=60)
    loaded = built.state.loras.get("x")  # type: ignore[union-attr]
    assert loaded is not None
    # hello and snapshot (none resident), then the load's batch
    assert adapters_told(told) == [{}, {}, {"x": loaded.identity}]
    index = KVIndex()
    for event, _, data in told:
        apply_event(index, url, event, json.dumps(data))
    route = SimpleNamespace(pool=SimpleNamespace(kv_index=index), adapter=SimpleNamespace(name="x"))
    root = chain_root(route, None)  # type: ignore[arg-type]
    assert root == root_hash(loaded.identity)
    body = {"model": "x", "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    post(url, "/v1/completions", body)
    want = [hash_hex(b) for b in chain(root, built.state.tokenizer.encode(PROMPT), 16)]
    last_id = told[-1][1]

    def stored(events: list[Any]) -> list[str]:
        return [s[0] for e in events if e[0] == "batch" for s in e[2]["stored"]]

    events = read_events(url, 50, {"last-event-id": last_id}, lambda e: len(stored(e)) >= len(want))
    assert stored(events)[: len(want)] == want  # the engine announced the gateway's hashes
    post(url, "/v1/unload_lora_adapter", {"lora_name": "x"})
    after = read_events(url, 2, {"last-event-id": events[-1][1]})
    assert adapters_told(after) == [{}]  # a reconnecting stream's hello tells the unload
