"""The e2e node's NetworkPolicy enforcer: kube-router's firewall controller, as a host process.

The bridge CNI plugin wires pods together but enforces no NetworkPolicy, so a policy test on
it would pass with every packet let through. kube-router (built from its Go module by
`build.sh`) runs here with only its firewall controller: no BGP routing (the bridge already
connects the node's pods) and no service proxy (kube-proxy keeps that job). It watches pods,
namespaces and NetworkPolicies and renders them into iptables chains (`KUBE-ROUTER-*`,
`KUBE-POD-FW-*`, `KUBE-NWPLCY-*`) matching ipsets (`KUBE-SRC-*`, `KUBE-DST-*`) on the FORWARD
path. Pod-to-pod frames cross the bridge without being routed, so they only meet those
chains when the kernel hands bridged traffic to iptables (`br_netfilter`,
`net.bridge.bridge-nf-call-iptables=1`), which `enable_bridge_netfilter` checks and sets.
Traffic from the node itself (kubelet probes, the tests on the host) stays allowed, as
kube-router allows it on every cluster.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx

BRIDGE_NF_CALL_IPTABLES = Path("/proc/sys/net/bridge/bridge-nf-call-iptables")
FORWARD_CHAIN = "KUBE-ROUTER-FORWARD"
# kube-router appends this to its top-level chains only in an iptables-restore that
# succeeded: present means a full policy sync has reached the kernel.
SYNCED_RULE = "--mark 0x20000/0x20000 -j ACCEPT"
SYNC_COUNT_METRIC = "kube_router_controller_iptables_sync_time_count"


def enable_bridge_netfilter() -> str:
    """Make bridged pod traffic traverse iptables; returns the setting before, to restore."""
    if not BRIDGE_NF_CALL_IPTABLES.exists() and shutil.which("modprobe"):
        subprocess.run(["modprobe", "br_netfilter"], capture_output=True, check=False)
    if not BRIDGE_NF_CALL_IPTABLES.exists():
        raise RuntimeError(
            "this kernel has no br_netfilter (CONFIG_BRIDGE_NETFILTER): bridged pod traffic "
            "would bypass iptables, so no NetworkPolicy could be enforced on the e2e node"
        )
    before = BRIDGE_NF_CALL_IPTABLES.read_text().strip()
    if before != "1":
        BRIDGE_NF_CALL_IPTABLES.write_text("1")
    return before


def restore_bridge_netfilter(before: str | None) -> None:
    if before is not None and before != "1" and BRIDGE_NF_CALL_IPTABLES.exists():
        BRIDGE_NF_CALL_IPTABLES.write_text(before)


def kube_router_args(
    bin_dir: Path, kubeconfig: Path, node_name: str, service_cidr: str, metrics_port: int
) -> list[str]:
    """The firewall controller alone; metrics on loopback (they tell when it has synced)."""
    if shutil.which("ipset") is None:
        raise RuntimeError("kube-router needs the ipset command: run scripts/system-deps.sh")
    return [
        str(bin_dir / "kube-router"),
        f"--kubeconfig={kubeconfig}",
        f"--hostname-override={node_name}",
        "--run-firewall=true",
        "--run-router=false",
        "--run-service-proxy=false",
        "--enable-cni=false",
        f"--service-cluster-ip-range={service_cidr}",
        "--health-port=0",  # its health server would listen on every address
        "--metrics-addr=127.0.0.1",
        f"--metrics-port={metrics_port}",
        # Policies sync on every pod, namespace and policy event; the periodic full sync
        # only repairs what something else rewrote.
        "--iptables-sync-period=30s",
        "--v=1",
    ]


def synced(metrics_port: int) -> bool:
    """A full policy sync finished and its iptables-restore reached the kernel."""
    try:
        text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=2).text
    except httpx.HTTPError:
        return False
    counts = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(SYNC_COUNT_METRIC + " ")
    ]
    if not counts or counts[0] < 1:
        return False
    return SYNCED_RULE in _rules(FORWARD_CHAIN) and any(
        rule.endswith(f"-j {FORWARD_CHAIN}") for rule in _rules("FORWARD").splitlines()
    )


def _rules(chain: str) -> str:
    listed = subprocess.run(
        ["iptables", "-t", "filter", "-S", chain], capture_output=True, text=True, check=False
    )
    return listed.stdout


def wait_synced(
    metrics_port: int, alive: Callable[[], bool], log_tail: Callable[[], str], timeout: float
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError(f"kube-router exited:\n{log_tail()}")
        if synced(metrics_port):
            return
        time.sleep(0.5)
    raise RuntimeError(f"kube-router did not sync its firewall in {timeout}s:\n{log_tail()}")
