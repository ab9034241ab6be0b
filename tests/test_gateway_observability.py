"""What the gateway tells operators: the internal port, bounded tenant series, the access log.

In process against in-test OpenAI stand-ins, plus one run of the real `servefleet gateway`
command: its tenant port must not answer `/metrics` or `/internal/*`, its internal port must,
and the access log it writes must replay in `servefleet sim --trace`.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from servefleet.api.access_log import AccessLogLine, parse_lines
from servefleet.api.gateway_config import (
    ApiKeyRef,
    GatewayConfig,
    GatewayDeployment,
    GatewayTenant,
    SecretValueRef,
    TenantAccess,
    hash_api_key,
)
from servefleet.api.llmdeployment import SpilloverSpec, TenantLimits
from servefleet.api.outcomes import Outcome
from servefleet.bench.fake_upstream import FakeOpenAI
from servefleet.bench.processes import free_port, serve_in_thread, servefleet_command
from servefleet.cli.main import main as cli_main
from servefleet.gateway.access_log import AccessLog
from servefleet.gateway.app import Gateway
from servefleet.gateway.metrics import OTHER_TENANT, GatewayMetrics

CHAT: dict[str, Any] = {
    "model": "m",
    "messages": [{"role": "user", "content": "hello there"}],
    "max_tokens": 8,
}


INTERNAL_KEY = "sk-internal-0123456789"
INTERNAL = {"authorization": f"Bearer {INTERNAL_KEY}"}


def key(tenant: str) -> str:
    return f"sk-secret-{tenant}-0123456789"


def auth(tenant: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key(tenant)}"}


def config(tenants: list[str], upstream: str | None, **kw: Any) -> GatewayConfig:
    limits = kw.pop("limits", {})
    spill = kw.pop("spill_url", None)
    kw.setdefault("internal_api_key", SecretValueRef(value=INTERNAL_KEY))
    spill_kw: dict[str, Any] = {}
    if spill is not None:
        spill_kw = {
            "spillover": SpilloverSpec.model_validate(
                {
                    "enabled": True,
                    "baseURL": spill + "/v1",
                    "model": "hosted",
                    "apiKeySecretRef": {"name": "s", "key": "k"},
                    "when": {"noReadyReplica": True},
                }
            ),
            "spillover_api_key": SecretValueRef(value="hosted-key"),
        }
    return GatewayConfig(
        host="127.0.0.1",
        tenants=[
            GatewayTenant(
                name=t,
                api_keys=[ApiKeyRef(sha256=hash_api_key(key(t)))],
                limits=TenantLimits(**limits.get(t, {})),
            )
            for t in tenants
        ],
        deployments=[
            GatewayDeployment(
                name="d",
                model="m",
                endpoints=[upstream] if upstream else [],
                tenants=[TenantAccess(name=t) for t in tenants],
                cold_start_seconds=60.0,
                **spill_kw,
            )
        ],
        **kw,
    )


@pytest.fixture
def upstream() -> Iterator[str]:
    with serve_in_thread(FakeOpenAI()) as url:
        yield url


def serve(gateway: Gateway, stack: ExitStack) -> tuple[str, str]:
    gateway.set_replicas("d", gateway.config.deployments[0].endpoints)
    base = stack.enter_context(serve_in_thread(gateway))
    internal = stack.enter_context(serve_in_thread(gateway.internal, lifespan="off"))
    return base, internal


def tenant_values(metrics_text: str) -> set[str]:
    return {
        sample.labels["tenant"]
        for family in text_string_to_metric_families(metrics_text)
        for sample in family.samples
        if "tenant" in sample.labels
    }


def test_the_tenant_port_serves_no_metrics_and_no_internal_api(upstream: str) -> None:
    gateway = Gateway(config(["acme", "globex"], upstream))
    with ExitStack() as stack:
        base, internal = serve(gateway, stack)
        assert httpx.post(base + "/v1/chat/completions", headers=auth("acme"), json=CHAT).is_success
        for path in ("/metrics", "/internal/deployments"):
            for headers in ({}, auth("acme")):
                refused = httpx.get(base + path, headers=headers)
                assert refused.status_code == 404, path
                assert "acme" not in refused.text and "globex" not in refused.text
        moved = httpx.post(base + "/internal/deployments/d/replicas", json={"endpoints": []})
        assert moved.status_code == 404
        # Everything is on the internal port, for the holder of the internal key.
        assert "acme" in tenant_values(httpx.get(internal + "/metrics", headers=INTERNAL).text)
        stats = httpx.get(internal + "/internal/deployments", headers=INTERNAL).json()
        assert [s["name"] for s in stats] == ["d"]
        assert httpx.get(internal + "/v1/models", headers=INTERNAL).status_code == 404


def test_tenant_series_stay_bounded_with_many_tenants(upstream: str) -> None:
    tenants = [f"team-{i:03d}" for i in range(120)]
    gateway = Gateway(config(tenants, upstream, tenant_series_limit=10))
    with ExitStack() as stack:
        base, internal = serve(gateway, stack)
        with httpx.Client(base_url=base) as client:
            for tenant in tenants[:40]:
                r = client.post("/v1/chat/completions", headers=auth(tenant), json=CHAT)
                assert r.status_code == 200
        text = httpx.get(internal + "/metrics", headers=INTERNAL).text
    labelled = tenant_values(text)
    assert len(labelled) == 11 and OTHER_TENANT in labelled  # 10 tenants + "_other"
    ok = {
        s.labels["tenant"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "servefleet_gateway_requests_total" and s.labels["outcome"] == "ok"
    }
    # Nothing is lost: every request is counted, under its tenant or under "_other".
    assert sum(ok.values()) == 40
    assert ok[OTHER_TENANT] == 40 - sum(v for t, v in ok.items() if t != OTHER_TENANT) > 0


def test_the_cap_keeps_the_first_tenants_for_life() -> None:
    metrics = GatewayMetrics(tenant_series_limit=2)
    assert [metrics.tenant_label(t) for t in ("a", "b", "c", "a", "d", "b")] == [
        "a",
        "b",
        OTHER_TENANT,
        "a",
        OTHER_TENANT,
        "b",
    ]
    assert metrics.for_tenant("c", "m") is metrics.for_tenant("d", "m")


def test_access_log_has_a_line_per_request_and_no_key(upstream: str) -> None:
    out = io.StringIO()
    limits = {"limited": {"requests_per_minute": 1}}
    gateway = Gateway(
        config(["acme", "limited"], upstream, limits=limits), access_log=AccessLog(out)
    )
    before = time.time()
    with ExitStack() as stack:
        base, _ = serve(gateway, stack)
        with httpx.Client(base_url=base) as client:
            assert client.post("/v1/chat/completions", headers=auth("acme"), json=CHAT).is_success
            streamed = client.post(
                "/v1/chat/completions", headers=auth("acme"), json={**CHAT, "stream": True}
            )
            assert streamed.is_success
            for expected in (200, 429):
                r = client.post("/v1/chat/completions", headers=auth("limited"), json=CHAT)
                assert r.status_code == expected
            # Refused before a deployment is known: no line (nothing to replay).
            assert client.post("/v1/chat/completions", json=CHAT).status_code == 401
    text = out.getvalue()
    for tenant in ("acme", "limited"):
        assert key(tenant) not in text and hash_api_key(key(tenant)) not in text
    lines = list(parse_lines(text.splitlines()))
    assert [(ln.tenant, ln.outcome, ln.status) for ln in lines] == [
        ("acme", Outcome.OK, 200),
        ("acme", Outcome.OK, 200),
        ("limited", Outcome.OK, 200),
        ("limited", Outcome.LIMITED, 429),
    ]
    served = lines[0]
    assert served.deployment == "d" and served.model == "m"
    assert served.replica == upstream and served.completion_tokens == 8
    assert served.prompt_tokens > 0 and served.traffic_class == "interactive"
    assert before <= served.ts <= time.time()
    assert served.ttft_s is not None and 0 <= served.ttft_s <= served.duration_s
    assert lines[1].completion_tokens == 8  # usage of a stream, learned from its last chunk
    assert lines[3].replica is None and lines[3].completion_tokens == 0


def test_access_log_outcomes_of_spill_over_and_shedding() -> None:
    out = io.StringIO()
    with ExitStack() as stack:
        hosted = stack.enter_context(serve_in_thread(FakeOpenAI()))
        gateway = Gateway(config(["acme"], None, spill_url=hosted), access_log=AccessLog(out))
        base = stack.enter_context(serve_in_thread(gateway))
        r = httpx.post(base + "/v1/chat/completions", headers=auth("acme"), json=CHAT)
        assert r.headers["x-servefleet-route"] == "spillover"
        usage = r.json()["usage"]
        want = {"prompt": usage["prompt_tokens"], "completion": usage["completion_tokens"]}

        def spilled_tokens() -> dict[str, float]:  # chargeback prices these (hosted table)
            return {
                s.labels["kind"]: s.value
                for family in text_string_to_metric_families(gateway.render_metrics().decode())
                for s in family.samples
                if s.name == "servefleet_gateway_spilled_tokens_total"
                and s.labels["tenant"] == "acme"
            }

        # counted when the relay ends, which may be just after the client has the body
        deadline = time.monotonic() + 5
        while spilled_tokens() != want and time.monotonic() < deadline:
            time.sleep(0.05)
        assert spilled_tokens() == want
    shed_gateway = Gateway(config(["acme"], None), access_log=AccessLog(out))
    with serve_in_thread(shed_gateway) as base:
        assert (
            httpx.post(base + "/v1/chat/completions", headers=auth("acme"), json=CHAT).status_code
            == 503
        )
    spilled, shed = parse_lines(out.getvalue().splitlines())
    assert (spilled.outcome, spilled.status) == (Outcome.SPILLED, 200)
    assert spilled.reason == "no ready replica"
    assert spilled.replica is None
    assert (shed.outcome, shed.status) == (Outcome.SHED, 503) and shed.reason


def _requests_by_outcome(metrics_text: str) -> dict[str, float]:
    return {
        sample.labels["outcome"]: sample.value
        for family in text_string_to_metric_families(metrics_text)
        for sample in family.samples
        if sample.name == "servefleet_gateway_requests_total" and sample.value
    }


def test_metrics_and_access_log_count_each_request_once_alike() -> None:
    """One outcome per request, decided once: the metric's label and the log's line agree
    (a /tokenize that admission would spill is shed: both say 503, not one of them `failed`)."""
    out = io.StringIO()
    limits = {"acme": {"requests_per_minute": 2}}
    with ExitStack() as stack:
        hosted = stack.enter_context(serve_in_thread(FakeOpenAI()))
        gateway = Gateway(
            config(["acme"], None, spill_url=hosted, limits=limits), access_log=AccessLog(out)
        )
        base = stack.enter_context(serve_in_thread(gateway))
        internal = stack.enter_context(serve_in_thread(gateway.internal, lifespan="off"))
        with httpx.Client(base_url=base, headers=auth("acme")) as client:
            assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
            assert client.post("/tokenize", json={"model": "m", "prompt": "hi"}).status_code == 503
            assert client.post("/v1/chat/completions", json=CHAT).status_code == 429
        deadline = time.monotonic() + 10  # counted as the handler ends, after the answer
        counted: dict[str, float] = {}
        while sum(counted.values()) < 3:
            assert time.monotonic() < deadline, counted
            metrics = httpx.get(internal + "/metrics", headers=INTERNAL).text
            counted = _requests_by_outcome(metrics)
    logged = [line.outcome for line in parse_lines(out.getvalue().splitlines())]
    assert logged == [Outcome.SPILLED, Outcome.SHED, Outcome.LIMITED]
    assert counted == {o.value: 1.0 for o in logged}


def test_the_gateway_command_serves_two_ports_and_its_log_replays_in_sim(
    upstream: str, tmp_path: Path
) -> None:
    port, internal_port = free_port(), free_port()
    config_file = tmp_path / "gateway.json"
    plain = config(["acme"], upstream, internal_api_key=None)
    config_file.write_text(plain.model_dump_json(exclude_none=True))
    key_file = tmp_path / "internal-key"
    key_file.write_text(INTERNAL_KEY + "\n")
    log = tmp_path / "access.jsonl"
    argv = [
        *servefleet_command(),
        "gateway",
        "--config",
        str(config_file),
        "--port",
        str(port),
        "--internal-port",
        str(internal_port),
        "--internal-api-key-file",
        str(key_file),
        "--access-log",
        str(log),
    ]
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ}
    )
    base, internal = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{internal_port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.communicate()[0].decode()
            try:
                if httpx.get(base + "/ready").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the gateway did not start"
            time.sleep(0.2)
        with httpx.Client(base_url=base, headers=auth("acme"), timeout=30) as client:
            for i in range(12):
                body = {**CHAT, "max_tokens": 4 + i, "stream": i % 2 == 1}
                assert client.post("/v1/chat/completions", json=body).status_code == 200
        assert httpx.get(base + "/metrics").status_code == 404
        assert httpx.get(base + "/internal/deployments").status_code == 404
        assert 'tenant="acme"' in httpx.get(internal + "/metrics", headers=INTERNAL).text
        stats = httpx.get(internal + "/internal/deployments", headers=INTERNAL)
        assert stats.json()[0]["name"] == "d"
        assert httpx.get(internal + "/internal/deployments").status_code == 401
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    lines = [AccessLogLine.model_validate_json(x) for x in log.read_text().splitlines()]
    assert len(lines) == 12 and {ln.outcome for ln in lines} == {Outcome.OK}
    out = tmp_path / "sim"
    argv = ["sim", "--trace", str(log), "--out", str(out), "--jobs", "1", "--max-replicas", "2"]
    assert cli_main([*argv, "--policies", "fixed"]) == 0
    report = json.loads((out / "sim.json").read_text())
    (trace,) = report["traces"].values()
    assert trace["points"] and all(p["policy"] == "fixed" for p in trace["points"])


def test_the_internal_port_cannot_be_the_tenant_port() -> None:
    with pytest.raises(ValueError, match="internal_port must differ"):
        GatewayConfig(port=8080, internal_port=8080)
    assert GatewayConfig(internal_port=None).internal_port is None
