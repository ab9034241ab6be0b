"""Failover without recompute on real engines (SmolLM2, in process, over loopback HTTP).

Engine A streams a long prompt's answer and so caches the prompt and the tokens it
generated. A continuation of that stream on engine B (`resume_token_ids`: what reached the
client before the break) that names a dead source and A pulls the longest chain A holds for
prompt + resumed tokens, computes only the tail, and continues with exactly the tokens A
gave and a recomputing B gives.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import pytest

from servefleet.api.kv_blocks import chain, root_hash
from servefleet.api.kv_transfer import LOOKUP_PATH, hash_hex
from servefleet.engine.process import BuiltEngine
from tests.support.engine_harness import running_engine
from tests.support.http_server import serve_in_thread
from tests.test_kv_transfer_engine import AUTH, KEY, MODEL, PROMPT, SETTINGS, complete, reset

Trio = tuple[tuple[BuiltEngine, str], ...]
TOKENS, BROKEN_AT = 24, 10


@pytest.fixture(scope="module")
def trio(smollm2: Any) -> Iterator[Trio]:
    with ExitStack() as stack:
        out = []
        for _ in range(3):
            built = stack.enter_context(running_engine(smollm2, **SETTINGS))
            built.state.api_key = KEY
            out.append((built, stack.enter_context(serve_in_thread(built))))
        yield tuple(out)


def _dead_url() -> str:
    """A loopback port nothing listens on: the replica that was SIGKILLed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def test_a_continuation_pulls_the_prefix_from_a_live_holder(trio: Trio) -> None:
    (a, a_url), (b, b_url), _ = trio
    reset(a), reset(b)
    whole, prompt_tokens, _ = complete(a_url, max_tokens=TOKENS)
    assert len(whole) == TOKENS and prompt_tokens > 400
    resume = {"max_tokens": TOKENS, "resume_token_ids": whole[:BROKEN_AT]}
    recomputed, _, cached = complete(b_url, **resume)
    assert cached == 0 and recomputed == whole[BROKEN_AT:]
    reset(b)
    params = {"kv_sources": [_dead_url(), a_url], "deadline_s": 30}
    before = _counted(b_url, "import")
    pulled, _, cached = complete(b_url, **resume, kv_transfer_params=params)
    assert pulled == whole[BROKEN_AT:]
    # the prompt's full blocks and those the resumed tokens filled came from A
    usable = (prompt_tokens + BROKEN_AT - 1) // 16 * 16
    assert cached == usable, (cached, usable)
    assert _counted(b_url, "import") - before == usable // 16
    a.kv_cache.check_all_free()
    b.kv_cache.check_all_free()


def test_the_longest_holder_is_pulled_from(trio: Trio) -> None:
    """C holds the first half of the prompt, A all of it and the resumed tokens: the
    puller looks both up and pulls the whole chain from A, nothing from C."""
    (a, a_url), (b, b_url), (c, c_url) = trio
    reset(a), reset(b), reset(c)
    whole, prompt_tokens, _ = complete(a_url, max_tokens=TOKENS)
    complete(c_url, max_tokens=1, prompt=PROMPT[: len(PROMPT) // 2])
    held_by_c = _lookup(c_url, a_url)
    assert 0 < held_by_c < prompt_tokens // 16
    before = _counted(c_url, "export")
    params = {"kv_sources": [c_url, a_url], "deadline_s": 30}
    resume = {"max_tokens": TOKENS, "resume_token_ids": whole[:BROKEN_AT]}
    got, _, cached = complete(b_url, **resume, kv_transfer_params=params)
    assert got == whole[BROKEN_AT:]
    assert cached == (prompt_tokens + BROKEN_AT - 1) // 16 * 16
    assert _counted(c_url, "export") == before  # C was only looked up
    for built in (a, b, c):
        built.kv_cache.check_all_free()


def _lookup(url: str, holder_url: str) -> int:
    """How many of the prompt's blocks (as `holder_url` hashes them) `url` holds."""
    r = httpx.post(holder_url + "/tokenize", json={"model": MODEL, "prompt": PROMPT}, headers=AUTH)
    ids = r.json()["tokens"]
    hashes = [hash_hex(h) for h in chain(root_hash(None), ids[: len(ids) - 1], 16)]
    r = httpx.post(url + LOOKUP_PATH, json={"hashes": hashes}, headers=AUTH)
    return int(r.json()["cached"])


def _counted(url: str, direction: str) -> float:
    text = httpx.get(url + "/metrics").text
    total = 0.0
    prefix = f'servefleet_engine_kv_transfer_blocks_total{{direction="{direction}"'
    for line in text.splitlines():
        if line.startswith(prefix):
            total += float(line.rsplit(" ", 1)[1])
    return total
