"""`GET /internal/usage` on the gateway's internal port: the series it selects per deployment,
its parameters (each honoured or a 400 naming it), and what it answers when it cannot price or
reach Prometheus. Prometheus is a recording stand-in here (`servefleet.api.usage_query` is
tested against an HTTP one in test_usage_cli)."""

from __future__ import annotations

import csv
import io
from collections.abc import Iterator

import httpx
import pytest

from servefleet.api import chargeback as cb
from servefleet.api.chargeback_spec import ChargebackSpec, HostedPrices
from servefleet.api.gateway_config import (
    ApiKeyRef,
    GatewayConfig,
    GatewayDeployment,
    GatewayTenant,
    SecretValueRef,
    ServiceRef,
    TenantAccess,
    hash_api_key,
)
from servefleet.api.prices_spec import PricesSpec
from servefleet.bench.processes import serve_in_thread
from servefleet.gateway.app import Gateway
from servefleet.gateway.usage_api import selectors

KEY = "internal-key-0123456789"
INTERNAL = {"authorization": f"Bearer {KEY}"}
IDLE = ChargebackSpec(idle=cb.IdlePolicy.PLATFORM)
PRICED = PricesSpec(
    replica_hour=3.6, hosted=HostedPrices(input_per_million=1.0, output_per_million=4.0)
)


def _config() -> GatewayConfig:
    access = [TenantAccess(name="a")]
    return GatewayConfig(
        tenants=[GatewayTenant(name="a", api_keys=[ApiKeyRef(sha256=hash_api_key("key-a"))])],
        internal_api_key=SecretValueRef(value=KEY),
        deployments=[
            GatewayDeployment(
                name="kube", model="m", tenants=access, chargeback=IDLE, prices=PRICED
            ),
            GatewayDeployment(
                name="static", model="m2", endpoints=["http://10.1.2.3:8000"], tenants=access,
                chargeback=IDLE, prices=PRICED,
            ),
            GatewayDeployment(name="unpriced", model="m3", tenants=access),
        ],
    )  # fmt: skip


class FakePrometheus:
    def __init__(self) -> None:
        self.queries: list[tuple[str, float]] = []

    def __call__(self, promql: str, at: float) -> list[tuple[dict[str, str], float]]:
        self.queries.append((promql, at))
        if cb.ENGINE_BUSY_SECONDS in promql:
            return [({"tenant": "a"}, 360.0)]
        if cb.ENGINE_REPLICA_SECONDS in promql:
            return [({}, 3600.0)]
        if cb.ENGINE_IDLE_SECONDS in promql:
            return [({}, 3240.0)]
        return []


@pytest.fixture
def served() -> Iterator[tuple[str, str, FakePrometheus]]:
    gateway = Gateway(_config())
    prometheus = FakePrometheus()
    gateway.internal._usage_query = prometheus
    with serve_in_thread(gateway) as base, serve_in_thread(gateway.internal, lifespan="off") as i:
        yield base, i, prometheus


def test_engines_are_selected_by_their_service_or_their_addresses() -> None:
    kube = GatewayDeployment(
        name="kube", model="m", service=ServiceRef(namespace="ns", name="kube-engine")
    )
    assert selectors(kube) == ('namespace="ns", service="kube-engine"', 'model="m"')
    static = GatewayDeployment(
        name="s", model='m"x', endpoints=["http://10.0.0.1:8000", "https://e-0:9000/"]
    )
    assert selectors(static) == (
        r'instance=~"10\\.0\\.0\\.1:8000|e\\-0:9000"',  # PromQL strings escape \ too
        'model="m\\"x"',
    )


def test_the_report_selects_the_deployments_series_and_prices_them(
    served: tuple[str, str, FakePrometheus],
) -> None:
    _, internal, prometheus = served
    params = {"deployment": "kube", "from": "0", "to": "3600"}
    r = httpx.get(internal + "/internal/usage", params=params, headers=INTERNAL)
    assert r.status_code == 200, r.text
    report = r.json()
    rows = {row["tenant"]: row for row in report["tenants"]}
    assert rows["a"]["self_hosted_cost"] == pytest.approx(0.36)
    assert rows["_platform"]["cost"] == pytest.approx(3.24)
    assert report["conservation_error"] == 0.0 and report["period_to"] == "1970-01-01T01:00:00Z"
    engine = [q for q, _ in prometheus.queries if "servefleet_engine_" in q]
    assert engine and all('instance=~"$^"' in q for q in engine)  # no replicas: no series
    gateway = [q for q, _ in prometheus.queries if "servefleet_gateway_" in q]
    assert gateway and all('model="m"' in q and "[3600s]" in q for q in gateway)
    prometheus.queries.clear()
    params = {"deployment": "static", "from": "0", "to": "60", "format": "csv"}
    r = httpx.get(internal + "/internal/usage", params=params, headers=INTERNAL)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/csv")
    assert [row["tenant"] for row in csv.DictReader(io.StringIO(r.text))] == ["a", "_platform"]
    assert any(r'instance=~"10\\.1\\.2\\.3:8000"' in q for q, _ in prometheus.queries)


@pytest.mark.parametrize(
    "params,status,param",
    [
        ({"deployment": "kube", "tenant": "a"}, 400, "tenant"),
        ({"deployment": "kube", "format": "xml"}, 400, "format"),
        ({"deployment": "kube", "from": "yesterday"}, 400, "from"),
        ({"deployment": "kube", "from": "2026-11-01T00:00:00"}, 400, "from"),
        ({"deployment": "kube", "from": "100", "to": "50"}, 400, "to"),
        ({}, 400, "deployment"),  # three deployments: name one
        ({"deployment": "nope"}, 404, None),
        ({"deployment": "unpriced"}, 409, None),
    ],
)
def test_bad_parameters_are_refused_by_name(
    served: tuple[str, str, FakePrometheus], params: dict[str, str], status: int, param: str | None
) -> None:
    _, internal, prometheus = served
    r = httpx.get(internal + "/internal/usage", params=params, headers=INTERNAL)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param
    assert not prometheus.queries  # refused before anything was read


def test_without_prometheus_it_is_501_and_the_tenant_port_has_no_such_path() -> None:
    gateway = Gateway(_config())
    with serve_in_thread(gateway) as base, serve_in_thread(gateway.internal, lifespan="off") as i:
        r = httpx.get(i + "/internal/usage", params={"deployment": "kube"}, headers=INTERNAL)
        assert r.status_code == 501 and r.json()["error"]["code"] == "not_configured"
        tenant = httpx.get(base + "/internal/usage", headers={"authorization": "Bearer key-a"})
        assert tenant.status_code == 404


def test_the_engine_gets_the_routes_tenant_never_the_clients_claim() -> None:
    """A tenant sending the header itself still bills its own name: the gateway builds the
    engine's headers from the route its key resolved to."""
    from contextlib import ExitStack

    from servefleet.bench.fake_upstream import FakeOpenAI
    from tests.support.gateway_rig import served_gateway

    with ExitStack() as stack:
        fake = FakeOpenAI()
        url = stack.enter_context(serve_in_thread(fake))
        _, base = served_gateway(stack, [url])
        headers = {"authorization": "Bearer key-a", cb.TENANT_HEADER: "someone-else"}
        body = {"model": "m", "prompt": "hi", "max_tokens": 2}
        r = httpx.post(base + "/v1/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 200, r.text
    assert [h.get(cb.TENANT_HEADER) for h in fake.stats.headers] == ["a"]
