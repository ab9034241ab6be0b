"""LoRA adapters at the gateway: who may use which, where each request goes, loads on demand.

Against stand-in replicas with vLLM's load endpoint (`tests/support/lora_replica.py`); the
same path against real engines and real adapters is in e2e/test_lora_local.py.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from pydantic import SecretStr

from servefleet.api.gateway_config import (
    ApiKeyRef,
    GatewayAdapter,
    GatewayConfig,
    GatewayDeployment,
    GatewayTenant,
    SecretValueRef,
    TenantAccess,
    hash_api_key,
)
from servefleet.api.gateway_stats import ReplicaHealth
from servefleet.bench.processes import serve_in_thread
from servefleet.gateway.adapter_loads import AdapterLoads, refresh
from servefleet.gateway.app import Gateway
from servefleet.gateway.routing import ReplicaSet
from tests.support.lora_replica import BASE, lora_replica

ADAPTERS = [
    GatewayAdapter(name="alpha", path="/adapters/alpha"),
    GatewayAdapter(name="beta", path="/adapters/beta", tenants=["a"]),
    GatewayAdapter(name="broken", path="/bad/broken"),
]


def _config(adapters: list[GatewayAdapter] = ADAPTERS, **deployment: Any) -> GatewayConfig:
    tenants = [
        GatewayTenant(name=n, api_keys=[ApiKeyRef(sha256=hash_api_key(f"key-{n}"))])
        for n in ("a", "b")
    ]
    return GatewayConfig(
        tenants=tenants,
        deployments=[
            GatewayDeployment(
                name="pool",
                model=BASE,
                tenants=[TenantAccess(name="a"), TenantAccess(name="b")],
                adapters=adapters,
                engine_api_key=SecretValueRef(value=SecretStr("engine-secret")),
                **deployment,
            )
        ],
    )


@contextlib.contextmanager
def _gateway(replicas: int = 1, **kwargs: Any) -> Iterator[tuple[str, list[Any]]]:
    """A gateway in front of `replicas` stand-ins; yields (its URL, [(app, held, log)])."""
    made = [lora_replica(**kwargs) for _ in range(replicas)]
    with contextlib.ExitStack() as stack:
        urls = [stack.enter_context(serve_in_thread(app)) for app, _, _ in made]
        gateway = Gateway(_config())
        gateway.set_replicas("pool", urls, ready=urls)
        yield stack.enter_context(serve_in_thread(gateway)), made


def _chat(base: str, model: str, tenant: str = "a") -> httpx.Response:
    return httpx.post(
        base + "/v1/chat/completions",
        headers={"authorization": f"Bearer key-{tenant}"},
        json={"model": model, "messages": [{"role": "user", "content": "hi"}]},
        timeout=30,
    )


# -- who may use which ------------------------------------------------------------------


def test_models_lists_each_tenant_only_its_adapters_with_their_parent() -> None:
    with _gateway() as (base, _):
        listed = {
            tenant: httpx.get(
                base + "/v1/models", headers={"authorization": f"Bearer key-{tenant}"}
            ).json()["data"]
            for tenant in ("a", "b")
        }
    ids = {tenant: sorted(card["id"] for card in cards) for tenant, cards in listed.items()}
    assert ids == {"a": ["alpha", BASE, "beta", "broken"], "b": ["alpha", BASE, "broken"]}
    alpha = next(card for card in listed["a"] if card["id"] == "alpha")
    assert alpha["parent"] == BASE
    assert "parent" not in next(card for card in listed["a"] if card["id"] == BASE)


def test_an_adapter_a_tenant_may_not_use_is_model_not_found_and_never_loaded() -> None:
    with _gateway() as (base, made):
        reply = _chat(base, "beta", tenant="b")
    assert reply.status_code == 404, reply.text
    assert reply.json()["error"]["code"] == "model_not_found"
    assert made[0][2].loads == []


# -- loading on demand --------------------------------------------------------------------


def test_first_request_loads_the_adapter_with_the_engine_key_and_the_next_reuses_it() -> None:
    with _gateway() as (base, made):
        first, second = _chat(base, "alpha"), _chat(base, "alpha")
    assert first.status_code == second.status_code == 200, first.text
    assert first.json()["choices"][0]["message"]["content"] == "answer of alpha"
    log = made[0][2]
    assert log.loads == [("alpha", "/adapters/alpha")]
    assert log.auth == ["Bearer engine-secret"]


def test_concurrent_requests_for_a_new_adapter_make_one_load() -> None:
    with _gateway(replicas=2, load_delay_s=0.3) as (base, made):

        async def burst() -> list[int]:
            async with httpx.AsyncClient(timeout=30) as client:
                replies = await asyncio.gather(
                    *(
                        client.post(
                            base + "/v1/chat/completions",
                            headers={"authorization": "Bearer key-a"},
                            json={"model": "alpha", "messages": [{"role": "user", "content": "x"}]},
                        )
                        for _ in range(6)
                    )
                )
            return [r.status_code for r in replies]

        statuses = asyncio.run(burst())
    assert statuses == [200] * 6
    loads = [load for _, _, log in made for load in log.loads]
    # At most one load at a time; every request waited for it rather than loading its own.
    # With 6 requests on 2 replicas of 4 slots each, the adapter may spread to the second
    # replica once the first is busier, but never loads twice on one replica.
    assert 1 <= len(loads) <= 2
    assert all(len(log.loads) <= 1 for _, _, log in made)


def test_a_refused_adapter_is_a_400_naming_it_and_is_not_retried_for_a_while() -> None:
    with _gateway() as (base, made):
        replies = [_chat(base, "broken") for _ in range(3)]
        after = _chat(base, "alpha")
    for reply in replies:
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["code"] == "adapter_load_failed"
        assert "broken" in error["message"] and "max-lora-rank" in error["message"]
    assert [name for name, _ in made[0][2].loads] == ["broken", "alpha"]
    assert after.status_code == 200  # the replica stayed in rotation


def test_an_adapter_the_engine_evicted_is_loaded_again() -> None:
    with _gateway(max_loras=1) as (base, made):
        assert _chat(base, "alpha").status_code == 200
        assert _chat(base, "broken").status_code == 400
        held = made[0][1]
        held.clear()  # the engine evicted it (another caller loaded other adapters)
        reply = _chat(base, "alpha")
    assert reply.status_code == 200, reply.text
    assert [name for name, _ in made[0][2].loads] == ["alpha", "broken", "alpha"]


# -- where a request goes -----------------------------------------------------------------


def _replicas(n: int) -> ReplicaSet:
    replicas = ReplicaSet(cap=4)
    endpoints = [f"http://r{i}:8000" for i in range(n)]
    replicas.set_endpoints(endpoints, 0.0, ready=endpoints)
    return replicas


def test_a_holder_is_preferred_until_it_is_more_than_slack_busier() -> None:
    replicas = _replicas(3)
    r0, r1, _ = replicas.replicas.values()
    r1.adapters.add("alpha")
    assert replicas.pick(None, 1.0, slack=2, adapter="alpha") is r1
    r1.outstanding = 2  # two more than the idle ones: still within slack
    assert replicas.pick(None, 1.0, slack=2, adapter="alpha") is r1
    r1.outstanding = 3  # the bottleneck: the adapter goes to an idle replica too
    chosen = replicas.pick(None, 1.0, slack=2, adapter="alpha")
    assert chosen is not r1 and chosen is not None
    r0.loading.add("alpha")  # a load under way counts as holding it
    assert replicas.pick(None, 1.0, slack=2, adapter="alpha") is r0


def test_prefix_affinity_is_kept_among_the_holders() -> None:
    replicas = _replicas(4)
    holders = list(replicas.replicas.values())[:2]
    for replica in holders:
        replica.adapters.add("alpha")
    chosen = {replicas.pick(key, 1.0, slack=2, adapter="alpha") for key in range(64)}
    assert chosen == set(holders)  # both holders used, by key; never a non-holder
    assert replicas.pick(7, 1.0, slack=2, adapter="alpha") is replicas.pick(
        7, 1.0, slack=2, adapter="alpha"
    )


def test_refresh_takes_what_the_replica_lists_and_keeps_loads_under_way() -> None:
    replica = _replicas(1).replicas["http://r0:8000"]
    replica.adapters = {"gone", "loading"}
    replica.loading = {"loading"}
    cards = [{"id": BASE}, {"id": "alpha", "parent": BASE}, {"id": "x", "parent": "other"}]
    refresh(replica, cards, BASE)
    assert replica.adapters == {"alpha", "loading"}
    assert replica.state is ReplicaHealth.READY


@pytest.mark.parametrize("status", [502, 599])
def test_a_replica_that_fails_the_load_is_the_replicas_failure(status: int) -> None:
    class Answer:
        def __init__(self, status: int) -> None:
            self.status = status

        async def read(self) -> bytes:
            return b"{}"

        def close(self) -> None:
            pass

    async def post(url: str, body: bytes) -> Answer:
        return Answer(status)

    replica = _replicas(1).replicas["http://r0:8000"]
    failure = asyncio.run(AdapterLoads().ensure(replica, ADAPTERS[0], post, deadline_s=1.0))
    assert failure is not None and failure.status == 502
    assert type(failure).__name__ == "OpenAIError"  # not AdapterLoadFailed: the replica moves on
    assert replica.adapters == set() and replica.loading == set()
