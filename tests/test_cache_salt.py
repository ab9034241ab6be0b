"""Prefix caches shared only within a salt (`servefleet.api.cache_salt`): the chain's root, the
engine's cache, the warm start's chains and the gateway's salting of every request."""

from __future__ import annotations

import json
from contextlib import ExitStack

import httpx
import pytest

from servefleet.api.cache_salt import effective_salt, tenant_salt
from servefleet.api.kv_blocks import chain, root_hash
from servefleet.api.openai_requests import ChatCompletionRequest
from servefleet.bench.fake_upstream import FakeOpenAI
from servefleet.bench.processes import serve_in_thread
from servefleet.engine.kv_warm import hot_chains
from servefleet.engine.sequence import Sequence
from servefleet.gateway.proxy import prepare_body
from servefleet.gateway.token_counter import ROOT, Counted
from tests.support.gateway_rig import served_gateway
from tests.test_scheduler import make, run_to_end, seq


def test_roots_differ_by_salt_and_adapter_and_unsalted_ones_are_unchanged() -> None:
    roots = {
        root_hash(None),
        root_hash(None, "a"),
        root_hash(7),
        root_hash(7, "a"),
        root_hash(None, "b"),
        root_hash(None, "a\x00"),
    }
    assert len(roots) == 6
    assert root_hash(None) == root_hash() == ROOT
    # the value every engine and gateway already agree on (and that transfers name)
    assert f"{root_hash(None):032x}" == f"{root_hash(None, None):032x}"


def test_no_tenant_reaches_another_tenants_salt() -> None:
    victim = tenant_salt("beta", None)
    assert tenant_salt("alpha", None) != victim
    assert tenant_salt("alpha", victim) != victim  # a salt sent as one's own is salted again
    assert tenant_salt("ab", "c") != tenant_salt("a", "bc")  # length-prefixed, not joined
    assert tenant_salt("a", None) != tenant_salt("a", "")
    assert tenant_salt("beta", None) == victim  # every gateway replica agrees
    assert effective_salt("tenant", "beta", "x") == tenant_salt("beta", "x")
    assert effective_salt("deployment", "beta", "x") == "x"
    assert effective_salt("deployment", "beta", None) is None


def test_the_request_field_is_bounded_and_named() -> None:
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert ChatCompletionRequest.model_validate({**base, "cache_salt": "s"}).cache_salt == "s"
    for bad in ("", "x" * 257, 5):
        with pytest.raises(ValueError, match="cache_salt"):
            ChatCompletionRequest.model_validate({**base, "cache_salt": bad})


def _salted(prompt: list[int], salt: str | None, t: float) -> Sequence:
    s = seq(prompt, max_tokens=1, t=t)
    s.cache_salt = salt
    return s


def test_the_engine_shares_prefixes_only_within_a_salt() -> None:
    s = make()
    prompt = list(range(100, 113))  # 3 full blocks of 4, and one token
    cached = []
    for t, salt in enumerate(["x", None, "y", "x", None]):
        one = _salted(prompt, salt, float(t))
        s.add(one)
        run_to_end(s)
        cached.append(one.num_cached_tokens)
    assert cached == [0, 0, 0, 12, 12]
    # the warm start names salted chains of the base model too (their first block says so)
    chains = hot_chains(s.kv_cache.pool, 100, 10)
    expected = {tuple(chain(root_hash(None, salt), prompt[:12], 4)) for salt in ("x", "y", None)}
    assert {tuple(c) for c in chains} == expected


def test_the_gateways_hashes_follow_the_salt() -> None:
    ids = list(range(40))
    assert Counted.of(ids, 16).block_hashes == tuple(chain(ROOT, ids, 16))
    salted = Counted.of(ids, 16, root_hash(None, "s")).block_hashes
    assert salted == tuple(chain(root_hash(None, "s"), ids, 16)) != Counted.of(ids, 16).block_hashes


# what a client sends as its own: nothing, a salt per end user, another tenant's salt
OWN_SALTS = (None, "per-user-7", tenant_salt("someone-else", None))


@pytest.mark.parametrize("sharing", ["tenant", "deployment"])
def test_the_gateway_salts_each_request_with_its_tenant(sharing: str) -> None:
    """By default the engine gets the tenant's salt, whatever the client sent as its own;
    with `deployment` the client's own salt (or none) goes through unchanged."""
    with ExitStack() as stack:
        fake = FakeOpenAI()
        url = stack.enter_context(serve_in_thread(fake))
        _, base = served_gateway(stack, [url], prefix_cache_sharing=sharing)
        headers = {"authorization": "Bearer key-a"}
        for own in OWN_SALTS:
            body = {"model": "m", "prompt": "hi", "max_tokens": 2}
            if own is not None:
                body["cache_salt"] = own
            r = httpx.post(base + "/v1/completions", json=body, headers=headers, timeout=30)
            assert r.status_code == 200, r.text
    sent = [b.get("cache_salt") for b in fake.stats.requests]
    if sharing == "tenant":
        assert sent == [tenant_salt("a", own) for own in OWN_SALTS]
    else:
        assert sent == list(OWN_SALTS)


def test_a_spilled_request_goes_without_the_salt() -> None:
    """The salt scopes our engines' caches; a hosted API does not take the field."""
    parsed = {"model": "m", "prompt": "hi", "cache_salt": "s"}
    raw = json.dumps(parsed).encode()
    kept = prepare_body(raw, parsed, stream=False, client_wants_usage=False)
    assert kept == raw
    spilled = prepare_body(
        raw, parsed, stream=False, client_wants_usage=False, drop=("cache_salt",)
    )
    assert json.loads(spilled) == {"model": "m", "prompt": "hi"}
