"""One seed range (`servefleet.api.seeds`): a request's seed outside it is a 400 naming `seed`
in the engine and the gateway, and a missing seed is invented inside it, in one place."""

from __future__ import annotations

from collections.abc import Iterator

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
from servefleet.api.seeds import SEED_MAX, SEED_MIN, new_seed
from servefleet.bench.fake_upstream import FakeOpenAI
from servefleet.bench.processes import serve_in_thread
from servefleet.gateway.app import Gateway
from servefleet.gateway.stream_splice import first_body
from tests.test_engine_boundary import _client, _state

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
OUTSIDE = [SEED_MAX + 1, SEED_MIN - 1, 2**64]


def test_the_range_is_a_signed_64_bit_integer_and_invented_seeds_fill_it() -> None:
    assert (SEED_MIN, SEED_MAX) == (-(2**63), 2**63 - 1)
    seeds = [new_seed() for _ in range(256)]
    assert all(SEED_MIN <= s <= SEED_MAX for s in seeds)
    assert min(seeds) < -(2**62) and max(seeds) > 2**62  # the whole range, both signs
    for _ in range(64):
        assert SEED_MIN <= first_body(dict(CHAT), exact=True)["seed"] <= SEED_MAX
    assert first_body({**CHAT, "seed": SEED_MIN}, exact=True)["seed"] == SEED_MIN


@pytest.mark.parametrize("seed", OUTSIDE)
async def test_the_engine_refuses_a_seed_outside_the_range(seed: int) -> None:
    async with _client(_state(api_key=None)) as client:
        response = await client.post("/v1/chat/completions", json={**CHAT, "seed": seed})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "seed" and error["type"] == "invalid_request_error"


@pytest.fixture(scope="module")
def gateway() -> Iterator[tuple[str, FakeOpenAI]]:
    fake = FakeOpenAI()
    with serve_in_thread(fake) as upstream:
        config = GatewayConfig(
            tenants=[GatewayTenant(name="a", api_keys=[ApiKeyRef(sha256=hash_api_key("k"))])],
            deployments=[
                GatewayDeployment(
                    name="d", model="m", endpoints=[upstream], tenants=[TenantAccess(name="a")]
                )
            ],
        )
        app = Gateway(config)
        app.set_replicas("d", [upstream], ready=[upstream])
        with serve_in_thread(app) as base:
            yield base, fake


@pytest.mark.parametrize("seed", OUTSIDE)
def test_the_gateway_refuses_a_seed_outside_the_range(
    gateway: tuple[str, FakeOpenAI], seed: int
) -> None:
    base, fake = gateway
    before = len(fake.stats.requests)
    response = httpx.post(
        base + "/v1/chat/completions",
        json={**CHAT, "seed": seed},
        headers={"authorization": "Bearer k"},
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "seed"
    assert len(fake.stats.requests) == before  # refused before anything went upstream


@pytest.mark.parametrize("seed", [SEED_MIN, -1, 0, SEED_MAX])
def test_the_gateway_passes_a_seed_inside_the_range(
    gateway: tuple[str, FakeOpenAI], seed: int
) -> None:
    base, fake = gateway
    response = httpx.post(
        base + "/v1/chat/completions",
        json={**CHAT, "seed": seed},
        headers={"authorization": "Bearer k"},
    )
    assert response.status_code == 200, response.text
    assert fake.stats.requests[-1]["seed"] == seed
