"""Disaggregated prefill/decode through the gateway, on real engine processes (SmolLM2).

One prefill and one decode `servefleet engine` process (one thread each, one engine key) and
the gateway in front (in process) with `prefill.endpoints` naming the prefill engine. A long
prompt goes P/D: the gateway sends it to the decode engine with `remote_prefill`, the decode
engine has the prefill engine compute and stream the blocks, then decodes. The stream must be
token-identical to the same request served cold by one engine, greedy and seeded (batch-invariant
mode, the CPU default, makes the logits independent of the cache); and a short prompt stays
colocated. About a minute here:
    uv run pytest e2e/test_pd_processes.py -s
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import SecretStr

from servefleet.api.gateway_config import (
    ApiKeyRef,
    GatewayConfig,
    GatewayDeployment,
    GatewayTenant,
    PrefillRouting,
    SecretValueRef,
    TenantAccess,
    hash_api_key,
)
from servefleet.api.kv_events import ROUTE_DECISIONS_METRIC
from servefleet.api.llmdeployment import TenantLimits
from servefleet.bench.engine_process import EngineProcess, thread_env
from servefleet.bench.processes import serve_in_thread
from servefleet.gateway.app import Gateway

MODEL = "smollm2-135m-instruct"
ENGINE_KEY = "pd-e2e-engine-key"
TENANT = {"authorization": "Bearer key-a"}
PROMPT = " ".join(f"Note {i}: the mill turned {i * 3 % 7} times before noon." for i in range(40))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, str, str, str]]:
    logs = tmp_path_factory.mktemp("pd")
    flags = ["--api-key", ENGINE_KEY, "--threads", "1", "--kv-cache-memory", "128MiB"]
    flags += ["--served-model-name", "m"]
    with ExitStack() as s:
        p = s.enter_context(EngineProcess(MODEL, Path(logs / "p.log"), flags, env=thread_env(1)))
        d = s.enter_context(EngineProcess(MODEL, Path(logs / "d.log"), flags, env=thread_env(1)))
        config = GatewayConfig(
            tenants=[
                GatewayTenant(
                    name="a",
                    api_keys=[ApiKeyRef(sha256=hash_api_key("key-a"))],
                    limits=TenantLimits(tokens_per_minute=1_000_000),
                )
            ],
            deployments=[
                GatewayDeployment(
                    name="d",
                    model="m",
                    tenants=[TenantAccess(name="a")],
                    engine_api_key=SecretValueRef(value=SecretStr(ENGINE_KEY)),
                    prefill=PrefillRouting(endpoints=[p.base_url], threshold=256),
                )
            ],
        )
        gateway = Gateway(config)
        gateway.set_replicas("d", [d.base_url], ready=[d.base_url])
        base = s.enter_context(serve_in_thread(gateway))
        yield gateway, base, p.base_url, d.base_url


GREEDY: dict[str, Any] = {"temperature": 0}
SEEDED: dict[str, Any] = {"temperature": 1.0, "seed": 7}


def complete(
    url: str, prompt: str, headers: dict[str, str], sampling: dict[str, Any] = GREEDY
) -> tuple[list[str], int]:
    """(the text of each streamed token, cached prompt tokens) of a completion
    (`return_token_ids` is internal: the gateway refuses it from tenants)."""
    body: dict[str, Any] = {"model": "m", "prompt": prompt, "max_tokens": 12, **sampling}
    body |= {"ignore_eos": True, "stream": True}
    body["stream_options"] = {"include_usage": True}
    pieces: list[str] = []
    usage: dict[str, Any] = {}
    with httpx.stream(
        "POST", url + "/v1/completions", json=body, headers=headers, timeout=300
    ) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                usage = event.get("usage") or usage
                for choice in event["choices"]:
                    pieces.append(choice["text"])
    return pieces, usage["prompt_tokens_details"]["cached_tokens"]


def test_pd_through_the_gateway_equals_colocated(stack: tuple[Gateway, str, str, str]) -> None:
    gateway, base, p_url, d_url = stack
    engine = {"authorization": f"Bearer {ENGINE_KEY}"}
    prefill = gateway.pools["d"].prefill
    assert prefill is not None
    deadline = time.monotonic() + 30  # the gateway's prober finds the prefill engine ready
    while not prefill.replicas.ready_count(prefill.now()) and time.monotonic() < deadline:
        time.sleep(0.2)
    # 1. the prefill engine computed it before (cold, colocated): it streams its cached blocks
    for head, sampling in (("One. ", GREEDY), ("Three. ", SEEDED)):
        cold, cached = complete(p_url, head + PROMPT, engine, sampling)
        assert cached == 0 and len(cold) == 12
        via_pd, cached = complete(base, head + PROMPT, TENANT, sampling)
        assert via_pd == cold, sampling
        assert cached > 256  # the decode engine computed only the last partial block
    # 2. nobody holds it: the prefill engine computes it block by block for the decode engine
    via_pd, cached = complete(base, "Two. " + PROMPT, TENANT, SEEDED)
    assert cached > 256
    again, _ = complete(d_url, "Two. " + PROMPT, engine, SEEDED)  # the decode engine alone
    assert via_pd == again
    decisions = gateway.metrics.registry.get_sample_value(
        ROUTE_DECISIONS_METRIC, {"deployment": "d", "model": "m", "decision": "pd"}
    )
    assert decisions == 3
    exported = 'blocks_total{direction="export",model_name="m",outcome="ok"}'
    assert exported in httpx.get(p_url + "/metrics").text
    # 3. a short prompt stays on the decode engine
    complete(base, "Short one.", TENANT)
    assert (
        gateway.metrics.registry.get_sample_value(
            ROUTE_DECISIONS_METRIC, {"deployment": "d", "model": "m", "decision": "pd"}
        )
        == 3
    )
