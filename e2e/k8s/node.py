"""A real single-node cluster for the e2e tests, from cached binaries and Debian packages.

The control plane of `cluster.py` (plus kube-scheduler), and a node: containerd (its own
root, state and socket), CNI bridge networking, kubelet (cgroupfs, cgroup v1 accepted),
kube-proxy in iptables mode, kube-router's firewall enforcing NetworkPolicies
(`firewall.py`) and a small cluster DNS (`dns.py`). The project's images are
built from its Dockerfile and imported into containerd (`images.sh`). Needs root.

Persistent (cached, so a second run starts in seconds): containerd's image store and
buildah's storage under ~/.cache/servefleet. Per run: everything else, under `run_dir`.
`stop()` puts the host back: pods stopped, processes ended, mounts, iptables chains,
ipsets, cgroups and the bridge removed.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import yaml
from k8s import firewall, host
from k8s.cluster import LocalControlPlane
from k8s.kubectl import Kube

from servefleet.bench.processes import free_port

NODE_NAME = "servefleet-e2e"
BRIDGE = "sfe2e0"
POD_CIDR = "10.244.0.0/24"
NODE_IP = "10.244.0.1"  # the bridge's address: pods reach the API server and DNS here
SERVICE_CIDR = "10.96.0.0/16"
CNI_BIN_DIR = "/usr/lib/cni"
HERE = Path(__file__).resolve().parent


def cache_root() -> Path:
    return Path(os.environ.get("SERVEFLEET_CACHE_DIR") or Path.home() / ".cache" / "servefleet")


@dataclass
class NodeCluster:
    """What the real-pod tests get: admin access, the images by role, their pull policy."""

    kube: Kube
    images: dict[str, str]
    pull_policy: str
    containerd_socket: Path | None = None  # our node's (None on $KUBECONFIG's cluster)


@dataclass
class LocalNode:
    """One node and its control plane; `images` maps a role to the image containerd holds."""

    bin_dir: Path
    run_dir: Path
    plane: LocalControlPlane | None = None
    images: dict[str, str] = field(default_factory=dict)
    processes: list[tuple[str, subprocess.Popen[bytes]]] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    bridge_nf_before: str | None = None  # net.bridge.bridge-nf-call-iptables before start
    host_lock: IO[str] | None = None  # held from start to stop: one node per host

    @property
    def containerd_socket(self) -> Path:
        return self.run_dir / "containerd" / "containerd.sock"

    @property
    def containerd_root(self) -> Path:
        return cache_root() / "containerd"

    @property
    def kubelet_root(self) -> Path:
        return self.run_dir / "kubelet"

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.run_dir / f"{name}.log", "wb")  # noqa: SIM115 - lives as long as the process
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.processes.append((name, proc))
        return proc

    def log_tail(self, name: str, lines: int = 40) -> str:
        path = self.run_dir / f"{name}.log"
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def _timed(self, step: str, start: float) -> None:
        self.timings[step] = round(time.monotonic() - start, 1)

    # ----------------------------------------------------------------------- start

    def start(self) -> None:
        if os.geteuid() != 0:
            raise RuntimeError("the e2e node runs containerd and kubelet: run the tests as root")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._lock_host()
        self.bridge_nf_before = firewall.enable_bridge_netfilter()
        host.create_bridge(BRIDGE, f"{NODE_IP}/24")
        start = time.monotonic()
        self._start_containerd()
        self._timed("containerd", start)
        start = time.monotonic()
        self._build_images()
        self._timed("images", start)
        start = time.monotonic()
        self.plane = LocalControlPlane(
            bin_dir=self.bin_dir,
            work_dir=self.run_dir / "control-plane",
            address=NODE_IP,
            for_node=True,
            service_cluster_ip_range=SERVICE_CIDR,
        )
        self.plane.start()
        self._timed("control plane", start)
        start = time.monotonic()
        self._spawn(
            "dns",
            [
                sys.executable,
                str(HERE / "dns.py"),
                f"--listen={NODE_IP}",
                f"--kubeconfig={self.plane.kubeconfig}",
            ],
        )
        self._start_kubelet()
        self._start_kube_proxy()
        self._wait_node_ready(timeout=120)
        self._timed("node", start)
        start = time.monotonic()
        self._start_firewall()
        self._timed("network policies", start)

    def import_images(self) -> None:
        """Build the images and import them into the cached containerd store, then stop: the
        step of `start()` that takes minutes (a 4 GB engine image), run ahead of the node
        tests (`make e2e-images`) so their own start finds every image already there."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._lock_host()
        try:
            start = time.monotonic()
            self._start_containerd()
            self._build_images()
            self._timed("images", start)
        finally:
            self.stop()

    def _lock_host(self) -> None:
        """One node per host: its bridge name, image store, KUBE-* chains, ipsets and kubepods
        cgroups are the host's. A second run fails here, naming the first, instead of sharing
        them and tearing the first one's network down when it stops. The lock is the kernel's
        (flock), so a killed run leaves none behind."""
        path = cache_root() / "e2e-node.lock"
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = path.open("a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            handle.close()
            raise RuntimeError(
                f"an e2e node already runs on this host ({holder}; lock {path}): one node per "
                "host at a time, wait for it to stop"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()}, run dir {self.run_dir}\n")
        handle.flush()
        self.host_lock = handle

    def _start_containerd(self) -> None:
        state = self.run_dir / "containerd"
        cni_conf = self.run_dir / "cni"
        state.mkdir(parents=True, exist_ok=True)
        cni_conf.mkdir(exist_ok=True)
        (cni_conf / "10-servefleet-e2e.conflist").write_text(json.dumps(self._cni_config()))
        config = self.run_dir / "containerd.toml"
        config.write_text(
            CONTAINERD_CONFIG.format(
                root=self.containerd_root,
                state=state / "state",
                socket=self.containerd_socket,
                pause=PAUSE_IMAGE,
                cni_bin=CNI_BIN_DIR,
                cni_conf=cni_conf,
            )
        )
        proc = self._spawn("containerd", ["containerd", "--config", str(config)])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"containerd exited:\n{self.log_tail('containerd')}")
            if self._ctr("version").returncode == 0:
                return
            time.sleep(0.2)
        raise RuntimeError(f"containerd did not start:\n{self.log_tail('containerd')}")

    def _cni_config(self) -> dict[str, object]:
        ipam = {
            "type": "host-local",
            "ranges": [[{"subnet": POD_CIDR, "gateway": NODE_IP}]],
            "routes": [{"dst": "0.0.0.0/0"}],
            "dataDir": str(self.run_dir / "cni-ipam"),
        }
        bridge = {
            "type": "bridge",
            "bridge": BRIDGE,
            "isGateway": True,
            "ipMasq": False,
            "hairpinMode": True,
            "ipam": ipam,
        }
        return {"cniVersion": "0.4.0", "name": "servefleet-e2e", "plugins": [bridge]}

    def _ctr(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["ctr", "--address", str(self.containerd_socket), "--namespace", "k8s.io", *args],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    def _build_images(self) -> None:
        done = subprocess.run(
            ["bash", str(HERE / "images.sh"), str(self.containerd_socket)],
            stdout=subprocess.PIPE,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError("e2e/k8s/images.sh failed (its output is above)")
        for line in done.stdout.splitlines():
            role, _, ref = line.partition("=")
            if ref:
                self.images[role] = ref

    def _start_kubelet(self) -> None:
        assert self.plane is not None
        self.kubelet_root.mkdir(parents=True, exist_ok=True)
        config = self.run_dir / "kubelet.yaml"
        config.write_text(yaml.safe_dump(self._kubelet_config()))
        self._spawn(
            "kubelet",
            [
                str(self.bin_dir / "kubelet"),
                f"--config={config}",
                f"--kubeconfig={self.plane.kubeconfig}",
                f"--root-dir={self.kubelet_root}",
                f"--hostname-override={NODE_NAME}",
                f"--node-ip={NODE_IP}",
                "--v=1",
            ],
        )

    def _kubelet_config(self) -> dict[str, object]:
        endpoint = f"unix://{self.containerd_socket}"
        return {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "cgroupDriver": "cgroupfs",
            "failCgroupV1": False,
            "failSwapOn": False,
            "containerRuntimeEndpoint": endpoint,
            "imageServiceEndpoint": endpoint,
            "address": NODE_IP,
            "port": free_port(),
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": free_port(),
            # Only the API server (on this host) calls the kubelet: logs, exec, port-forward.
            "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
            "authorization": {"mode": "AlwaysAllow"},
            "clusterDNS": [NODE_IP],
            "clusterDomain": "cluster.local",
            "resolvConf": "",
            "podLogsDir": str(self.run_dir / "pod-logs"),
            "serializeImagePulls": False,
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "evictionHard": {
                "memory.available": "100Mi",
                "nodefs.available": "1%",
                "imagefs.available": "1%",
                "nodefs.inodesFree": "1%",
            },
            "maxPods": 50,
        }

    def _start_kube_proxy(self) -> None:
        assert self.plane is not None
        config = self.run_dir / "kube-proxy.yaml"
        settings = {
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
            "kind": "KubeProxyConfiguration",
            "mode": "iptables",
            "clientConnection": {"kubeconfig": str(self.plane.kubeconfig)},
            "hostnameOverride": NODE_NAME,
            "bindAddress": NODE_IP,
            "clusterCIDR": POD_CIDR,
            "healthzBindAddress": f"127.0.0.1:{free_port()}",
            "metricsBindAddress": f"127.0.0.1:{free_port()}",
            # Zero: leave the host's conntrack sysctls alone.
            "conntrack": {
                "maxPerCore": 0,
                "min": 0,
                "tcpEstablishedTimeout": "0s",
                "tcpCloseWaitTimeout": "0s",
            },
            "iptables": {"localhostNodePorts": False},
        }
        config.write_text(yaml.safe_dump(settings))
        self._spawn("kube-proxy", [str(self.bin_dir / "kube-proxy"), f"--config={config}"])

    def _start_firewall(self) -> None:
        """kube-router's NetworkPolicy firewall; it reads the Node object, so after Ready."""
        assert self.plane is not None
        metrics_port = free_port()
        args = firewall.kube_router_args(
            self.bin_dir, self.plane.kubeconfig, NODE_NAME, SERVICE_CIDR, metrics_port
        )
        proc = self._spawn("kube-router", args)
        firewall.wait_synced(
            metrics_port,
            alive=lambda: proc.poll() is None,
            log_tail=lambda: self.log_tail("kube-router"),
            timeout=60,
        )

    def _wait_node_ready(self, timeout: float) -> None:
        assert self.plane is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self.processes:
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited:\n{self.log_tail(name)}")
            if self.kubectl("get", "node", NODE_NAME, "-o", "json").returncode == 0:
                node = json.loads(self.kubectl("get", "node", NODE_NAME, "-o", "json").stdout)
                for cond in node.get("status", {}).get("conditions", []):
                    if cond["type"] == "Ready" and cond["status"] == "True":
                        return
            time.sleep(1)
        raise RuntimeError(f"node not Ready after {timeout}s:\n{self.log_tail('kubelet')}")

    def kubectl(self, *args: str) -> subprocess.CompletedProcess[str]:
        assert self.plane is not None
        return subprocess.run(
            [str(self.bin_dir / "kubectl"), f"--kubeconfig={self.plane.kubeconfig}", *args],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    # ----------------------------------------------------------------------- stop

    def stop(self) -> None:
        """Stop every pod (so CNI releases its addresses), then everything, then clean up;
        nothing when this run never held the host (another node runs: its state, not ours)."""
        if self.host_lock is None:
            return
        if self.plane is not None and self._alive("kubelet"):
            self.plane.stop_process("kube-controller-manager")
            self.kubectl(
                "delete", "pods", "--all", "--all-namespaces", "--grace-period=0", "--force"
            )
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and self._ctr("tasks", "ls", "-q").stdout.strip():
                time.sleep(1)
        if self._alive("containerd"):
            # The image store is cached between runs; the containers of this run are not.
            containers = self._ctr("containers", "ls", "-q").stdout.split()
            if containers:
                self._ctr("containers", "rm", *containers)
        for name, proc in reversed(self.processes):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=5)
            del name
        self.processes.clear()
        host.kill_shims(self.containerd_socket)
        host.unmount_under(self.run_dir, self.containerd_root)
        host.remove_iptables_chains()  # kube-router's chains are KUBE-* too
        host.destroy_ipsets()
        firewall.restore_bridge_netfilter(self.bridge_nf_before)
        host.remove_cgroups("kubepods")
        host.delete_bridge(BRIDGE)
        host.remove_links_into(Path("/var/log/containers"), self.run_dir)
        if self.plane is not None:
            self.plane.stop()
        self.host_lock.close()  # releases the flock
        self.host_lock = None

    def _alive(self, name: str) -> bool:
        return any(n == name and p.poll() is None for n, p in self.processes)


PAUSE_IMAGE = "localhost/servefleet-e2e-pause:catatonit"

CONTAINERD_CONFIG = """\
version = 2
root = "{root}"
state = "{state}"

[grpc]
  address = "{socket}"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{pause}"
  # This VM withholds CAP_SYS_RESOURCE: runc cannot set a negative oom_score_adj.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{cni_bin}"
    conf_dir = "{cni_conf}"
"""
