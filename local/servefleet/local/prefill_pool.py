"""A disaggregated deployment's prefill pool on one machine (`spec.disaggregation`).

The gateway's config names the prefill replicas by URL (`GatewayDeployment.prefill
.endpoints`), so their ports are chosen before the gateway starts and each prefill process
takes one of them (a replacement takes the port its predecessor freed). The pool runs
`prefill.desired_replicas()` processes; locally it is not autoscaled (the machine's cores
bound it anyway), the decode pool is as before.
"""

from __future__ import annotations

from servefleet.api.disaggregation import PREFILL_SUFFIX
from servefleet.api.llmdeployment import LLMDeployment

from .engine_command import ENGINE_HOST
from .ports import free_port


def prefill_pool_name(deployment: str) -> str:
    """The prefill supervisor's name (its processes' names and log files start with it)."""
    return deployment + PREFILL_SUFFIX


def reserve_prefill_ports(deployments: list[LLMDeployment]) -> dict[str, list[int]]:
    """Ports for every disaggregated deployment's prefill replicas, by deployment name."""
    reserved: dict[str, list[int]] = {}
    taken: set[int] = set()
    for dep in deployments:
        block = dep.spec.disaggregation
        if block is None:
            continue
        ports: list[int] = []
        while len(ports) < block.prefill.desired_replicas():
            port = free_port(ENGINE_HOST)
            if port not in taken:
                ports.append(port)
                taken.add(port)
        reserved[dep.name] = ports
    return reserved


def prefill_endpoints(ports: dict[str, list[int]]) -> dict[str, list[str]]:
    """The prefill replicas' base URLs, as the gateway's config lists them."""
    return {name: [f"http://{ENGINE_HOST}:{p}" for p in found] for name, found in ports.items()}
