"""Disaggregated prefill/decode as each engine's own flags, rendered from the one spec.

vLLM's and SGLang's P/D cannot run on this machine (no GPU, no NIXL/Mooncake), so their
command lines are pinned here against the spellings their docs give (vLLM
docs/features/nixl_connector_usage.md, SGLang docs/advanced_features/pd_disaggregation.md).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from servefleet.api.disaggregation_flags import (
    NIXL_SIDE_CHANNEL_PORT,
    SGLANG_BOOTSTRAP_PORT,
    RoleEnv,
    RolePort,
    role_env,
    role_ports,
)
from servefleet.api.engines import EngineListen, engine_adapter
from servefleet.api.llmdeployment import LLMDeploymentSpec

LISTEN = EngineListen("0.0.0.0", 8000)


def spec(kind: str, transfer: str | None = None, pd: bool = True) -> LLMDeploymentSpec:
    source: dict[str, Any] = (
        {"builtin": "smollm2-135m-instruct"}
        if kind == "servefleet"
        else {"pvc": {"claimName": "w"}}
    )
    body: dict[str, Any] = {
        "model": {"name": "m", "source": source},
        "engine": {"kind": kind, "args": ["--user-arg"]},
    }
    if pd:
        body["disaggregation"] = {"prefill": {"args": ["--prefill-only-arg", "1"]}}
        if transfer:
            body["disaggregation"]["transfer"] = transfer
    return LLMDeploymentSpec.model_validate(body)


def args(s: LLMDeploymentSpec, role: str | None) -> list[str]:
    return engine_adapter(s.engine.kind).args(s, "/models/m", LISTEN, role=role)


def after(flags: list[str], name: str) -> str:
    assert flags.count(name) == 1, flags
    return flags[flags.index(name) + 1]


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_vllm_gets_the_nixl_connector_in_its_role(role: str) -> None:
    s = spec("vllm", "nixl")
    flags = args(s, role)
    config = json.loads(after(flags, "--kv-transfer-config"))
    assert config == {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
        "kv_load_failure_policy": "recompute",
    }
    assert ("--prefill-only-arg" in flags) == (role == "prefill")
    # the user's args come after ours, a prefill replica's own after those
    assert flags.index("--kv-transfer-config") < flags.index("--user-arg")
    if role == "prefill":
        assert flags[-2:] == ["--prefill-only-arg", "1"]
    assert role_env(s, role) == [
        RoleEnv("VLLM_NIXL_SIDE_CHANNEL_HOST", field_path="status.podIP"),
        RoleEnv("VLLM_NIXL_SIDE_CHANNEL_PORT", value=str(NIXL_SIDE_CHANNEL_PORT)),
    ]
    assert role_ports(s, role) == [RolePort("nixl-side", 5600)]


@pytest.mark.parametrize("role", ["prefill", "decode"])
@pytest.mark.parametrize("transfer", ["nixl", "mooncake"])
def test_sglang_gets_its_disaggregation_mode(role: str, transfer: str) -> None:
    s = spec("sglang", transfer)
    flags = args(s, role)
    assert after(flags, "--disaggregation-mode") == role
    assert after(flags, "--disaggregation-transfer-backend") == transfer
    assert after(flags, "--disaggregation-bootstrap-port") == str(SGLANG_BOOTSTRAP_PORT)
    assert ("--prefill-only-arg" in flags) == (role == "prefill")
    assert role_env(s, role) == []
    expected = [RolePort("pd-bootstrap", 8998)] if role == "prefill" else []
    assert role_ports(s, role) == expected


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_our_engine_needs_no_role_flag_and_prefill_gets_its_args(role: str) -> None:
    s = spec("servefleet")
    colocated = args(spec("servefleet", pd=False), None)
    flags = args(s, role)
    extra = ["--prefill-only-arg", "1"] if role == "prefill" else []
    assert flags == [*colocated, *extra]
    assert role_env(s, role) == [] and role_ports(s, role) == []


@pytest.mark.parametrize("kind", ["servefleet", "vllm", "sglang"])
def test_without_the_block_or_a_role_nothing_changes(kind: str) -> None:
    plain = args(spec(kind, pd=False), "prefill")
    assert plain == args(spec(kind, pd=False), None)
    assert not any("disaggregation" in f or "kv-transfer" in f for f in plain)
    pd = spec(kind, "nixl" if kind != "servefleet" else None)
    assert args(pd, None) == plain
