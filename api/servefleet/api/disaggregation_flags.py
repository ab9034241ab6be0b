"""What a prefill or decode replica adds to its engine's command line, env and ports.

One table for the operator (pods) and local mode (processes), per engine kind:

- ours (`transfer: http`): every replica can export and import KV blocks already (the
  gateway hands the prompt to a prefill replica and the decode replica pulls its blocks,
  `servefleet.api.kv_transfer`), so no role flag; a prefill replica gets
  `disaggregation.prefill.args`.
- vLLM (`transfer: nixl`): the NixlConnector as producer (prefill) or consumer (decode), a
  failed KV load recomputed rather than failed, and the NIXL side channel (handshake) on the
  pod's own IP (downward API) and `NIXL_SIDE_CHANNEL_PORT`.
- SGLang (`transfer: nixl|mooncake`): `--disaggregation-mode prefill|decode`, the transfer
  backend, and the bootstrap port the router names in each request.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from servefleet.api.disaggregation import Role
from servefleet.api.llmdeployment import LLMDeploymentSpec

NIXL_SIDE_CHANNEL_PORT = 5600
"""vLLM's default `VLLM_NIXL_SIDE_CHANNEL_PORT`: decode replicas handshake with prefill here."""
NIXL_SIDE_CHANNEL_PORT_NAME = "nixl-side"
SGLANG_BOOTSTRAP_PORT = 8998
"""SGLang's default `--disaggregation-bootstrap-port` (the gateway's `PrefillRouting` names it)."""
SGLANG_BOOTSTRAP_PORT_NAME = "pd-bootstrap"
POD_IP = "status.podIP"
"""The downward-API field the NIXL side channel binds and advertises."""

VLLM_KV_ROLES: dict[Role, str] = {"prefill": "kv_producer", "decode": "kv_consumer"}


@dataclass(frozen=True)
class RoleEnv:
    """One env var: a literal value, or (`field_path`) a downward-API field of the pod."""

    name: str
    value: str | None = None
    field_path: str | None = None


@dataclass(frozen=True)
class RolePort:
    """A container port a role serves besides the engine port."""

    name: str
    port: int


def vllm_kv_transfer_config(role: Role) -> str:
    """vLLM's `--kv-transfer-config` JSON for one role (compact, stable key order)."""
    config = {
        "kv_connector": "NixlConnector",
        "kv_role": VLLM_KV_ROLES[role],
        "kv_load_failure_policy": "recompute",
    }
    return json.dumps(config, separators=(",", ":"))


def role_args(spec: LLMDeploymentSpec, role: Role | None) -> list[str]:
    """The engine flags of one role, before `engine.args` (None or colocated: none)."""
    block = spec.disaggregation
    if block is None or role is None:
        return []
    kind = spec.engine.kind
    if kind == "vllm":
        return ["--kv-transfer-config", vllm_kv_transfer_config(role)]
    if kind == "sglang":
        return [
            "--disaggregation-mode",
            role,
            "--disaggregation-transfer-backend",
            block.transfer,
            "--disaggregation-bootstrap-port",
            str(SGLANG_BOOTSTRAP_PORT),
        ]
    return []


def role_extra_args(spec: LLMDeploymentSpec, role: Role | None) -> list[str]:
    """The user's prefill-only arguments, after `engine.args` (so they win there too)."""
    block = spec.disaggregation
    if block is None or role != "prefill":
        return []
    return list(block.prefill.args)


def role_env(spec: LLMDeploymentSpec, role: Role | None) -> list[RoleEnv]:
    """Env a role's engine needs (vLLM: where its NIXL side channel listens)."""
    if spec.disaggregation is None or role is None or spec.engine.kind != "vllm":
        return []
    return [
        RoleEnv("VLLM_NIXL_SIDE_CHANNEL_HOST", field_path=POD_IP),
        RoleEnv("VLLM_NIXL_SIDE_CHANNEL_PORT", value=str(NIXL_SIDE_CHANNEL_PORT)),
    ]


def role_ports(spec: LLMDeploymentSpec, role: Role | None) -> list[RolePort]:
    """Ports a role serves to its peers (vLLM: the side channel; SGLang prefill: bootstrap)."""
    if spec.disaggregation is None or role is None:
        return []
    if spec.engine.kind == "vllm":
        return [RolePort(NIXL_SIDE_CHANNEL_PORT_NAME, NIXL_SIDE_CHANNEL_PORT)]
    if spec.engine.kind == "sglang" and role == "prefill":
        return [RolePort(SGLANG_BOOTSTRAP_PORT_NAME, SGLANG_BOOTSTRAP_PORT)]
    return []
