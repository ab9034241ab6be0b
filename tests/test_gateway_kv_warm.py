"""Scale-up warm start, the gateway's half: a replica whose readiness probe answers 503
kv-warming is asked once to warm from the pool's ready replicas (never itself), the first
replica of a pool is told there is no peer (so it is ready at once), and the engine key is
sent. A replica that answers anything else is never asked. The sizes are the deployment's
`spec.kvWarmStart`: the bound reaches the engine's flag, the blocks and deadline the call."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import pytest
import yaml
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from servefleet.api.conventions import ROUTE_GATEWAY_KEY
from servefleet.api.gateway_config import (
    GatewayConfig,
    GatewayDeployment,
    RoutingConfig,
    TenantAccess,
)
from servefleet.api.kv_warm import WARM_PATH, WARMING_DETAIL, KVWarmStartSpec
from servefleet.bench.fake_upstream import FakeOpenAI
from servefleet.bench.processes import serve_in_thread
from servefleet.gateway.app import Gateway
from servefleet.gateway.kv_warm import WarmAsker, warm_sources
from servefleet.gateway.pool import DeploymentPool
from servefleet.gateway.routing import ReplicaSet
from servefleet.operator import render
from tests.test_gateway_probes import states, tenant, wait_until
from tests.test_operator_render import KEY, make, pod_spec


class WarmingEngine:
    """`/ready`: 503 kv-warming until a warm call arrives; records the calls."""

    def __init__(self, detail: str = WARMING_DETAIL) -> None:
        self.detail, self.probes = detail, 0
        self.calls: list[tuple[dict[str, Any], str | None]] = []
        self.app = Starlette(
            routes=[
                Route("/ready", self.ready),
                Route(WARM_PATH, self.warm, methods=["POST"]),
            ]
        )

    async def ready(self, request: Request) -> JSONResponse:
        self.probes += 1
        if self.calls:
            return JSONResponse({"ready": True})
        return JSONResponse({"ready": False, "detail": self.detail}, 503)

    async def warm(self, request: Request) -> JSONResponse:
        self.calls.append((await request.json(), request.headers.get("authorization")))
        return JSONResponse({"blocks": 3, "chains": 1, "seconds": 0.0, "sources": {}})


@pytest.fixture
def served() -> Iterator[tuple[Gateway, ExitStack]]:
    with ExitStack() as stack:
        config = GatewayConfig(
            tenants=[tenant("a")],
            deployments=[
                GatewayDeployment(
                    name="d",
                    model="m",
                    tenants=[TenantAccess(name="a")],
                    kv_warm=KVWarmStartSpec(max_blocks=100, deadline_seconds=4.0),
                )
            ],
            routing=RoutingConfig(probe_interval_seconds=0.05),
        )
        gateway = Gateway(config)
        stack.enter_context(serve_in_thread(gateway))
        yield gateway, stack


def test_a_warming_replica_is_asked_once_with_the_ready_peers(
    served: tuple[Gateway, ExitStack],
) -> None:
    gateway, stack = served
    peers = [stack.enter_context(serve_in_thread(FakeOpenAI())) for _ in range(2)]
    engine = WarmingEngine()
    new = stack.enter_context(serve_in_thread(engine.app, lifespan="off"))
    gateway.set_replicas("d", [*peers, new], ready=peers)
    wait_until(lambda: states(gateway)[new] == "ready")
    ((body, key),) = engine.calls
    assert sorted(body["sources"]) == sorted(peers)
    assert new not in body["sources"]
    assert (body["max_blocks"], body["deadline_s"]) == (100, 4.0)  # the deployment's sizes
    assert key is None  # this deployment has no engine key


def test_the_first_replica_of_a_pool_is_told_there_is_no_peer(
    served: tuple[Gateway, ExitStack],
) -> None:
    gateway, stack = served
    engine = WarmingEngine()
    new = stack.enter_context(serve_in_thread(engine.app, lifespan="off"))
    gateway.set_replicas("d", [new], ready=[])
    wait_until(lambda: states(gateway)[new] == "ready")
    assert [body["sources"] for body, _ in engine.calls] == [[]]


def test_a_replica_still_loading_is_not_asked(served: tuple[Gateway, ExitStack]) -> None:
    gateway, stack = served
    engine = WarmingEngine(detail="loading")
    url = stack.enter_context(serve_in_thread(engine.app, lifespan="off"))
    gateway.set_replicas("d", [url], ready=[])
    wait_until(lambda: engine.probes >= 3)
    assert engine.calls == [] and states(gateway)[url] == "starting"


def test_sources_are_ready_others_least_busy_first_and_capped() -> None:
    replicas = ReplicaSet(cap=4)
    urls = [f"http://10.0.0.{i}:8000" for i in range(7)]
    replicas.set_endpoints(urls, 0.0, ready=urls[1:])
    replicas.replicas[urls[2]].outstanding = 3
    replicas.eject(replicas.replicas[urls[3]], 0.0)
    got = warm_sources(replicas, replicas.replicas[urls[1]])
    assert got == [urls[4], urls[5], urls[6], urls[2]]
    assert warm_sources(replicas, replicas.replicas[urls[0]])[:1] == [urls[1]]


async def test_each_replica_object_is_asked_once() -> None:
    """A second probe answer while the warm runs asks nothing; a restarted replica (a new
    object on the same endpoint) is asked again."""
    engine = WarmingEngine()
    config = GatewayDeployment(name="d", model="m", tenants=[TenantAccess(name="a")])
    pool = DeploymentPool(config, RoutingConfig())
    pool.set_replicas(["http://127.0.0.1:1"], ready=[])
    (replica,) = pool.replicas.replicas.values()
    asker = WarmAsker()
    transport = httpx.ASGITransport(app=engine.app)
    async with httpx.AsyncClient(transport=transport) as client:
        assert asker.ask(client, pool, replica)
        assert not asker.ask(client, pool, replica)
        asker.forget_gone([])
        assert asker.ask(client, pool, replica)
        await asker.close()


MODEL = {"name": "m", "source": {"builtin": "smollm2-135m-instruct"}}


def test_the_spec_sizes_reach_the_engine_flag_and_the_gateway_route() -> None:
    sizes = {"seconds": 3, "maxBlocks": 100, "deadlineSeconds": 4}
    args = pod_spec({"model": MODEL, "kvWarmStart": sizes})["containers"][0]["args"]
    assert args[args.index("--kv-warm-start-seconds") + 1] == "3.0"
    default = pod_spec({"model": MODEL})["containers"][0]["args"]
    assert default[default.index("--kv-warm-start-seconds") + 1] == "10.0"
    configmap = render.gateway_route_configmap(make({"model": MODEL, "kvWarmStart": sizes}), KEY)
    config = GatewayConfig.model_validate(yaml.safe_load(configmap["data"][ROUTE_GATEWAY_KEY]))
    (deployment,) = config.deployments
    assert deployment.kv_warm == KVWarmStartSpec(seconds=3, max_blocks=100, deadline_seconds=4)
    no_cache = {"model": MODEL, "engine": {"prefixCaching": False}, "kvWarmStart": sizes}
    assert "--kv-warm-start-seconds" not in pod_spec(no_cache)["containers"][0]["args"]


@pytest.mark.parametrize(
    "sizes",
    [{"seconds": 61}, {"seconds": -1}, {"maxBlocks": 8193}, {"deadlineSeconds": 0}, {"x": 1}],
)
def test_spec_sizes_out_of_bounds_are_refused(sizes: dict[str, Any]) -> None:
    with pytest.raises(ValidationError, match="kvWarmStart"):
        make({"model": MODEL, "kvWarmStart": sizes})
