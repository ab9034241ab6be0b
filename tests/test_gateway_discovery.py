"""EndpointSlice discovery against a small in-test API server speaking Kubernetes list/watch."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from servefleet.api.gateway_config import (
    ApiKeyRef,
    GatewayConfig,
    GatewayDeployment,
    GatewayTenant,
    RoutingConfig,
    SecretValueRef,
    ServiceRef,
    TenantAccess,
    hash_api_key,
)
from servefleet.bench.fake_upstream import FakeOpenAI
from servefleet.bench.processes import serve_in_thread
from servefleet.gateway.app import Gateway
from servefleet.gateway.discovery import EndpointSliceWatcher
from servefleet.kube import KubeAccess

Scope = dict[str, Any]


def endpoint_slice(name: str, port: int, endpoints: list[tuple[str, dict[str, bool]]]) -> Any:
    return {
        "metadata": {"name": name, "labels": {"kubernetes.io/service-name": "engines"}},
        "ports": [{"name": "metrics", "port": 9090}, {"name": "http", "port": port}],
        "endpoints": [{"addresses": [a], "conditions": c} for a, c in endpoints],
    }


class FakeKubernetes:
    """Answers lists from a script and streams watch events; a watch step may hold the stream."""

    def __init__(self, lists: list[dict[str, Any]], watches: list[list[dict[str, Any]]]) -> None:
        self.lists = lists
        self.watches = watches
        self.requests: list[tuple[str, dict[str, str], dict[str, str]]] = []
        self.hold = threading.Event()  # released when the test is done

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        query = dict(httpx.QueryParams(scope["query_string"].decode()))
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        self.requests.append((scope["path"], query, headers))
        start = {"type": "http.response.start", "status": 200}
        if query.get("watch") != "true":
            body = self.lists.pop(0) if len(self.lists) > 1 else self.lists[0]
            await send({**start, "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": json.dumps(body).encode()})
            return
        events = self.watches.pop(0) if self.watches else []
        await send({**start, "headers": [(b"content-type", b"application/json")]})
        for event in events:
            line = json.dumps(event).encode() + b"\n"
            await send({"type": "http.response.body", "body": line, "more_body": True})
            await asyncio.sleep(0.01)
        if not events:  # the last watch stays open, as a real one does
            while not self.hold.is_set():
                await asyncio.sleep(0.02)
        await send({"type": "http.response.body", "body": b""})


SERVICE = ServiceRef(namespace="ml", name="engines", port_name="http")


@pytest.fixture
def script() -> Iterator[tuple[FakeKubernetes, str]]:
    first = endpoint_slice(
        "engines-a",
        8000,
        [
            ("10.0.0.1", {"ready": True}),
            ("10.0.0.2", {"ready": False}),
            ("10.0.0.3", {"ready": True, "terminating": True}),  # draining pod: left out
        ],
    )
    v6 = endpoint_slice("engines-b", 8000, [("fd00::5", {"ready": True})])
    modified = endpoint_slice(
        "engines-a", 8000, [("10.0.0.1", {"ready": True}), ("10.0.0.2", {"ready": True})]
    )
    relisted = endpoint_slice("engines-a", 8000, [("10.0.0.9", {"ready": True})])
    fake = FakeKubernetes(
        lists=[
            {"metadata": {"resourceVersion": "41"}, "items": [first, v6]},
            {"metadata": {"resourceVersion": "77"}, "items": [relisted]},
        ],
        watches=[
            [
                {"type": "MODIFIED", "object": modified},
                {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "50"}}},
                {"type": "DELETED", "object": v6},
                {"type": "ERROR", "object": {"code": 410, "message": "too old resource version"}},
            ]
        ],
    )
    with serve_in_thread(fake) as url:
        try:
            yield fake, url
        finally:
            fake.hold.set()


async def test_list_then_watch_then_relist_after_a_410(script: tuple[FakeKubernetes, str]) -> None:
    fake, url = script
    updates: list[tuple[list[str], list[str]]] = []
    access = KubeAccess(server=url, token="sa-token")  # type: ignore[arg-type]
    watcher = EndpointSliceWatcher(access, SERVICE, retry_s=0.05)
    task = asyncio.create_task(watcher.run(lambda every, ready: updates.append((every, ready))))
    try:
        async with asyncio.timeout(10):
            while len(updates) < 4:
                await asyncio.sleep(0.02)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    one, two, nine, v6 = (
        "http://10.0.0.1:8000",
        "http://10.0.0.2:8000",
        "http://10.0.0.9:8000",
        "http://[fd00::5]:8000",
    )
    assert updates[0] == ([one, two, v6], [one, v6])  # listed: not-ready kept, terminating not
    assert updates[1] == ([one, two, v6], [one, two, v6])  # MODIFIED: .2 became ready
    assert updates[2] == ([one, two], [one, two])  # DELETED the v6 slice; BOOKMARK ignored
    assert updates[3] == ([nine], [nine])  # the watch broke (410): listed again
    lists = [q for path, q, _ in fake.requests if q.get("watch") != "true"]
    watch_path, watch_query, watch_headers = next(
        r for r in fake.requests if r[1].get("watch") == "true"
    )
    assert watch_path == "/apis/discovery.k8s.io/v1/namespaces/ml/endpointslices"
    assert watch_query["labelSelector"] == "kubernetes.io/service-name=engines"
    assert watch_query["resourceVersion"] == "41"  # resumes from the list it just read
    assert watch_headers["authorization"] == "Bearer sa-token"
    assert len(lists) >= 2


def test_the_gateway_routes_to_what_the_endpointslices_list() -> None:
    replicas = [FakeOpenAI(), FakeOpenAI()]
    replicas[1].behaviour.ready = False  # its probe agrees with its slice: not ready
    with serve_in_thread(replicas[0]) as first, serve_in_thread(replicas[1]) as second:
        # One slice per replica (each has its own port); the second is not ready yet.
        ports = [int(u.rsplit(":", 1)[1]) for u in (first, second)]
        slices = [
            endpoint_slice("s0", ports[0], [("127.0.0.1", {"ready": True})]),
            endpoint_slice("s1", ports[1], [("127.0.0.1", {"ready": False})]),
        ]
        fake = FakeKubernetes(
            lists=[{"metadata": {"resourceVersion": "1"}, "items": slices}], watches=[]
        )
        config = GatewayConfig(
            tenants=[GatewayTenant(name="a", api_keys=[ApiKeyRef(sha256=hash_api_key("key-a"))])],
            deployments=[
                GatewayDeployment(
                    name="d", model="m", service=SERVICE, tenants=[TenantAccess(name="a")]
                )
            ],
            routing=RoutingConfig(probe_interval_seconds=3600),
            internal_api_key=SecretValueRef(value="internal-key"),
        )
        with serve_in_thread(fake) as api:
            gateway = Gateway(config, kubernetes=KubeAccess(server=api))
            with (
                serve_in_thread(gateway) as base,
                serve_in_thread(gateway.internal, lifespan="off") as internal,
            ):
                try:
                    states: dict[str, str] = {}
                    for _ in range(200):
                        states = {
                            r.endpoint: r.state for r in gateway.deployment_stats()[0].replicas
                        }
                        if states.get(first) == "ready":
                            break
                        threading.Event().wait(0.02)
                    assert states == {first: "ready", second: "starting"}
                    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
                    for _ in range(3):
                        r = httpx.post(
                            base + "/v1/chat/completions",
                            json=body,
                            headers={"authorization": "Bearer key-a"},
                        )
                        assert r.status_code == 200
                    assert len(replicas[0].stats.requests) == 3 and not replicas[1].stats.requests
                    # Discovery owns this deployment's replicas: the static update is refused.
                    refused = httpx.post(
                        internal + "/internal/deployments/d/replicas",
                        json={"endpoints": []},
                        headers={"authorization": "Bearer internal-key"},
                    )
                    assert refused.status_code == 409
                finally:
                    fake.hold.set()
