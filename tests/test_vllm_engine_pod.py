"""What a vLLM engine pod needs beyond the shared flags, found by running one
(e2e/test_vllm_node.py): a drain on SIGTERM, and its adapter endpoints switched on."""

from __future__ import annotations

from typing import Any

import pytest

from servefleet.api.engines import ENGINE_ADAPTERS
from servefleet.api.llmdeployment import LLMDeployment
from servefleet.operator import render

SETTINGS = render.RenderSettings(
    engine_image="servefleet:test",
    gateway_url="http://gw:8080",
    route_signing_key=b"route-signing-key-for-tests",
)
SOURCES = {
    "servefleet": {"builtin": "smollm2-135m-instruct"},
    "vllm": {"pvc": {"claimName": "models", "path": "smollm2"}},
    "sglang": {"pvc": {"claimName": "models", "path": "smollm2"}},
}
RUNTIME_LORA = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def deployment(kind: str, **engine: Any) -> LLMDeployment:
    spec = {"model": {"name": "m", "source": SOURCES[kind]}, "engine": {"kind": kind, **engine}}
    return LLMDeployment.model_validate(
        {"metadata": {"name": "d", "namespace": "ns", "uid": "u"}, "spec": spec}
    )


def container(dep: LLMDeployment) -> dict[str, Any]:
    pod = render.engine_deployment(dep, SETTINGS)["spec"]["template"]["spec"]
    result: dict[str, Any] = pod["containers"][0]
    return result


def env(dep: LLMDeployment) -> dict[str, Any]:
    return {var["name"]: var.get("value") for var in container(dep)["env"]}


@pytest.mark.parametrize("seconds", [0, 30, 120])
def test_vllm_drains_for_the_spec_s_drain_timeout(seconds: int) -> None:
    """vLLM aborts in-flight requests on SIGTERM unless --shutdown-timeout says to wait (its
    default is 0); the pod's grace period already covers the drain timeout."""
    dep = deployment("vllm", drainTimeoutSeconds=seconds)
    args = container(dep)["args"]
    assert args.count("--shutdown-timeout") == 1
    assert args[args.index("--shutdown-timeout") + 1] == str(seconds)
    grace = render.engine_deployment(dep, SETTINGS)["spec"]["template"]["spec"][
        "terminationGracePeriodSeconds"
    ]
    assert grace > seconds


def test_vllm_pods_with_lora_allow_runtime_adapter_loads() -> None:
    """The gateway loads adapters through POST /v1/load_lora_adapter, which vLLM serves only
    with this variable set; without engine.lora it is not set."""
    assert env(deployment("vllm", lora={"maxLoras": 2}))[RUNTIME_LORA] == "True"
    assert RUNTIME_LORA not in env(deployment("vllm"))


@pytest.mark.parametrize("kind", ["servefleet", "sglang"])
def test_other_kinds_get_no_vllm_variable(kind: str) -> None:
    assert RUNTIME_LORA not in env(deployment(kind, lora={}))


def test_the_user_s_own_value_is_left_alone() -> None:
    own = {"name": RUNTIME_LORA, "value": "False"}
    values = [v for v in container(deployment("vllm", lora={}, env=[own]))["env"]
              if v["name"] == RUNTIME_LORA]  # fmt: skip
    assert values == [own]


def test_the_default_vllm_image_knows_every_flag_we_render() -> None:
    """--shutdown-timeout and --kv-cache-memory are newer than v0.10: the default image is the
    release the e2e test runs."""
    image = ENGINE_ADAPTERS["vllm"].default_image
    assert image is not None
    major, minor = (int(part) for part in image.rsplit(":v", 1)[1].split(".")[:2])
    assert (major, minor) >= (0, 32), image
