"""`render_gateway_config`: LLMDeployments -> the one gateway config both modes run."""

from __future__ import annotations

from typing import Any

import pytest

from servefleet.api.gateway_config import GatewayConfig, ServiceRef, hash_api_key
from servefleet.api.gateway_render import (
    MountedSecretKeys,
    ResolvedSecretKeys,
    render_gateway_config,
)
from servefleet.api.llmdeployment import LLMDeployment, SecretKeyRef
from servefleet.gateway.app import Gateway

SECRETS = {("acme-key", "api-key"): "sk-acme", ("hosted", "key"): "sk-hosted"}


def deployment(name: str, model: str, **spec: Any) -> LLMDeployment:
    body: dict[str, Any] = {
        "model": {"name": model, "source": {"builtin": "smollm2-135m-instruct"}},
        "engine": {"blockSize": 32},
        "pool": {"perReplicaConcurrency": 3},
        "admission": {"maxQueueDepth": 7, "maxQueueWait": 9},
        "tenants": [
            {
                "name": "acme",
                "apiKeySecretRef": {"name": "acme-key", "key": "api-key"},
                "trafficClass": "batch",
                "weight": 2,
                "limits": {"tokensPerMinute": 1000},
            }
        ],
        **spec,
    }
    return LLMDeployment.model_validate(
        {
            "apiVersion": "servefleet.io/v1alpha1",
            "kind": "LLMDeployment",
            "metadata": {"name": name},
            "spec": body,
        }
    )


def resolve(ref: SecretKeyRef) -> str | None:
    return SECRETS.get((ref.name, ref.key))


SPILL = {
    "spillover": {
        "enabled": True,
        "baseURL": "https://hosted.example/v1",
        "model": "big",
        "apiKeySecretRef": {"name": "hosted", "key": "key"},
    }
}


def test_local_mode_keeps_only_key_hashes_and_merges_a_shared_tenant() -> None:
    config = render_gateway_config(
        [deployment("one", "m1", **SPILL), deployment("two", "m2")],
        {"one": ["http://127.0.0.1:9001"]},
        ResolvedSecretKeys(resolve),
        port=8123,
    )
    assert [t.name for t in config.tenants] == ["acme"]  # one tenant across both deployments
    (key,) = config.tenants[0].api_keys
    assert key.sha256 == hash_api_key("sk-acme") and key.source is None
    one, two = config.deployments
    assert (one.model, one.block_size, one.tokenizer) == ("m1", 32, "smollm2-135m-instruct")
    assert one.endpoints == ["http://127.0.0.1:9001"] and two.endpoints == []
    assert one.pool.per_replica_concurrency == 3 and one.admission.max_queue_depth == 7
    access = one.tenants[0]
    assert (access.traffic_class, access.weight) == ("batch", 2.0)
    assert one.spillover is not None and one.spillover.model == "big"
    assert two.spillover is None and two.spillover_api_key is None
    dumped = config.model_dump_json()
    assert "sk-acme" not in dumped and "sk-hosted" not in dumped  # never in clear text
    # It round-trips through a file and runs: the spill key is readable, the tenant resolves.
    again = GatewayConfig.model_validate_json(config.model_dump_json(by_alias=True))
    assert one.spillover_api_key is not None
    assert one.spillover_api_key.read() == "sk-hosted"
    gateway = Gateway(again)
    assert gateway.keys.tenant_for("Bearer sk-acme") == "acme"
    assert gateway.config.port == 8123


def test_kubernetes_mode_points_at_mounted_secrets_and_services() -> None:
    service = ServiceRef(namespace="ml", name="one-engines", port_name="http")
    config = render_gateway_config(
        [deployment("one", "m1", **SPILL)],
        {},
        MountedSecretKeys("/etc/servefleet/secrets/"),
        services={"one": service},
    )
    (key,) = config.tenants[0].api_keys
    assert key.source is not None and key.source.file == "/etc/servefleet/secrets/acme-key/api-key"
    spill_key = config.deployments[0].spillover_api_key
    assert spill_key is not None and spill_key.file == "/etc/servefleet/secrets/hosted/key"
    assert config.deployments[0].service == service and config.deployments[0].endpoints == []


def test_the_ready_path_comes_from_the_engine_adapter() -> None:
    vllm = deployment("big", "m2")
    vllm.spec.engine.kind = "vllm"
    config = render_gateway_config(
        [deployment("one", "m1"), vllm], {}, MountedSecretKeys("/etc/servefleet/secrets/")
    )
    assert [d.ready_path for d in config.deployments] == ["/ready", "/health"]


def test_engine_facts_the_gateway_acts_on_are_rendered() -> None:
    """Who takes the gateway's priority, the context a prompt is bounded by, and where the
    internal API may point replicas (local mode: loopback only)."""
    vllm = deployment("big", "m2")
    vllm.spec.engine.kind, vllm.spec.engine.max_model_len = "vllm", 4096
    config = render_gateway_config(
        [deployment("one", "m1"), vllm],
        {},
        ResolvedSecretKeys(resolve),
        allowed_replica_networks=["127.0.0.1/32"],
    )
    ours, theirs = config.deployments
    assert (ours.engine_priority, theirs.engine_priority) == (True, False)
    assert (ours.max_model_len, theirs.max_model_len) == (None, 4096)
    assert ours.allowed_replica_networks == theirs.allowed_replica_networks == ["127.0.0.1/32"]


def test_a_tenant_with_different_limits_in_two_deployments_is_refused() -> None:
    other = deployment("two", "m2")
    other.spec.tenants[0].limits.tokens_per_minute = 5
    with pytest.raises(ValueError, match="tenant acme: tenant-wide limits differ"):
        render_gateway_config([deployment("one", "m1"), other], {}, ResolvedSecretKeys(resolve))


def test_a_missing_secret_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="secret acme-key/api-key is not available"):
        render_gateway_config([deployment("one", "m1")], {}, ResolvedSecretKeys(lambda _r: None))


def test_two_deployments_serving_one_model_name_are_refused() -> None:
    with pytest.raises(ValueError, match="two deployments serve the same model name"):
        render_gateway_config(
            [deployment("one", "m"), deployment("two", "m")], {}, ResolvedSecretKeys(resolve)
        )
