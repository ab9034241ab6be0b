"""A throwaway control plane for the e2e tests: etcd + kube-apiserver + kube-controller-manager.

By default there is no kubelet and no scheduler: pods are created by the real ReplicaSet
controller and stay unscheduled; the API-server-only tests mark them Ready through the
status subresource, standing in for the kubelet. Everything else (RBAC, CRD validation
with CEL, defaulting, the scale subresource, garbage collection) is the real thing.
`for_node=True` makes it the control plane of a real node (`node.py`): the API server
listens where pods reach it, ServiceAccount tokens are mounted, and kube-scheduler runs.
"""

from __future__ import annotations

import os
import signal
import ssl
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from servefleet.bench.processes import free_port

ADMIN_TOKEN = "servefleet-e2e-admin-token"


def write_kubeconfig(path: Path, server: str, token: str, namespace: str = "default") -> Path:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "e2e", "cluster": {"server": server, "insecure-skip-tls-verify": True}}
        ],
        "users": [{"name": "user", "user": {"token": token}}],
        "contexts": [
            {"name": "e2e", "context": {"cluster": "e2e", "user": "user", "namespace": namespace}}
        ],
        "current-context": "e2e",
    }
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


@dataclass
class LocalControlPlane:
    """Processes of one test control plane; `stop()` ends them and nothing else."""

    bin_dir: Path
    work_dir: Path
    # Where the API server listens and what it advertises (the `kubernetes` Service).
    address: str = "127.0.0.1"
    for_node: bool = False
    service_cluster_ip_range: str = "10.96.0.0/16"
    processes: list[tuple[str, subprocess.Popen[bytes]]] = field(default_factory=list)
    server: str = ""
    kubeconfig: Path = field(default_factory=Path)

    def _spawn(self, name: str, args: list[str]) -> None:
        log = open(self.work_dir / f"{name}.log", "wb")  # noqa: SIM115 - lives as long as the process
        proc = subprocess.Popen(
            [str(self.bin_dir / name), *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.processes.append((name, proc))

    def log_tail(self, name: str, lines: int = 40) -> str:
        path = self.work_dir / f"{name}.log"
        return (
            "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
            if path.exists()
            else ""
        )

    def _wait_ready(self, url: str, token: str | None, timeout: float, name: str) -> None:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            for pname, proc in self.processes:
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"{pname} exited with {proc.returncode}:\n{self.log_tail(pname)}"
                    )
            request = urllib.request.Request(
                url, headers={"Authorization": f"Bearer {token}"} if token else {}
            )
            try:
                with urllib.request.urlopen(request, timeout=2, context=ctx) as response:
                    if response.status == 200:
                        return
            except OSError as exc:
                last = str(exc)
            time.sleep(0.3)
        raise RuntimeError(
            f"{name} not ready at {url} after {timeout}s ({last}):\n{self.log_tail(name)}"
        )

    def start(self) -> None:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        pki = self.work_dir / "pki"
        pki.mkdir(exist_ok=True)
        subprocess.run(
            ["openssl", "genrsa", "-out", str(pki / "sa.key"), "2048"],
            check=True,
            capture_output=True,
        )
        subprocess.run(
            ["openssl", "rsa", "-in", str(pki / "sa.key"), "-pubout", "-out", str(pki / "sa.pub")],
            check=True,
            capture_output=True,
        )
        (pki / "tokens.csv").write_text(f'{ADMIN_TOKEN},e2e-admin,e2e-admin,"system:masters"\n')
        etcd_port = self._start_etcd()
        self._start_apiserver(pki, etcd_port)
        self._start_controller_manager(pki)
        if self.for_node:
            self._start_scheduler(pki)

    def _start_etcd(self) -> int:
        etcd_port, etcd_peer = free_port(), free_port()
        self._spawn(
            "etcd",
            [
                "--name=e2e",
                f"--data-dir={self.work_dir / 'etcd'}",
                f"--listen-client-urls=http://127.0.0.1:{etcd_port}",
                f"--advertise-client-urls=http://127.0.0.1:{etcd_port}",
                f"--listen-peer-urls=http://127.0.0.1:{etcd_peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{etcd_peer}",
                f"--initial-cluster=e2e=http://127.0.0.1:{etcd_peer}",
                "--unsafe-no-fsync=true",
                "--log-level=warn",
            ],
        )
        self._wait_ready(f"http://127.0.0.1:{etcd_port}/health", None, 30, "etcd")
        return etcd_port

    def _start_apiserver(self, pki: Path, etcd_port: int) -> None:
        api_port = free_port()
        self.server = f"https://{self.address}:{api_port}"
        self._spawn(
            "kube-apiserver",
            [
                f"--etcd-servers=http://127.0.0.1:{etcd_port}",
                f"--bind-address={self.address}",
                f"--advertise-address={self.address}",
                f"--secure-port={api_port}",
                f"--cert-dir={pki}",
                "--authorization-mode=RBAC",
                f"--token-auth-file={pki / 'tokens.csv'}",
                f"--service-cluster-ip-range={self.service_cluster_ip_range}",
                f"--service-account-key-file={pki / 'sa.pub'}",
                f"--service-account-signing-key-file={pki / 'sa.key'}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                *self._admission_args(),
                "--allow-privileged=true",
                # The node's name resolves nowhere; logs, exec and port-forward use its IP.
                "--kubelet-preferred-address-types=InternalIP",
                "--v=1",
            ],
        )
        self._wait_ready(f"{self.server}/readyz", ADMIN_TOKEN, 120, "kube-apiserver")
        self.kubeconfig = write_kubeconfig(
            self.work_dir / "admin.kubeconfig", self.server, ADMIN_TOKEN
        )

    def _start_controller_manager(self, pki: Path) -> None:
        kcm_port = free_port()
        self._spawn(
            "kube-controller-manager",
            [
                f"--kubeconfig={self.kubeconfig}",
                f"--authentication-kubeconfig={self.kubeconfig}",
                f"--authorization-kubeconfig={self.kubeconfig}",
                "--bind-address=127.0.0.1",
                f"--secure-port={kcm_port}",
                f"--cert-dir={pki}",
                "--leader-elect=false",
                f"--service-account-private-key-file={pki / 'sa.key'}",
                # The self-signed serving certificate holds its CA: pods trust the API
                # server through the kube-root-ca.crt ConfigMap published from it.
                f"--root-ca-file={pki / 'apiserver.crt'}",
                f"--controllers={self._controllers()}",
                "--concurrent-gc-syncs=10",
                "--v=1",
            ],
        )
        self._wait_ready(
            f"https://127.0.0.1:{kcm_port}/healthz", ADMIN_TOKEN, 60, "kube-controller-manager"
        )

    def _controllers(self) -> str:
        off = [
            "nodeipam",
            "persistentvolume-binder",
            "attachdetach",
            "persistentvolume-expander",
            "ttl",
            "bootstrapsigner",
            "tokencleaner",
            "cloud-node-lifecycle",
            "service-lb-controller",
            "node-route-controller",
        ]
        if not self.for_node:
            off.append("nodelifecycle")
        # With a node, nodelifecycle lifts the not-ready taint a kubelet registers with.
        return ",".join(["*", *(f"-{name}" for name in off)])

    def _admission_args(self) -> list[str]:
        if self.for_node:
            return []
        # No kubelet mounts tokens here; the plugin would only make pod creation wait for
        # each namespace's default ServiceAccount.
        return ["--disable-admission-plugins=ServiceAccount"]

    def _start_scheduler(self, pki: Path) -> None:
        port = free_port()
        self._spawn(
            "kube-scheduler",
            [
                f"--kubeconfig={self.kubeconfig}",
                f"--authentication-kubeconfig={self.kubeconfig}",
                f"--authorization-kubeconfig={self.kubeconfig}",
                "--bind-address=127.0.0.1",
                f"--secure-port={port}",
                f"--cert-dir={pki}",
                "--leader-elect=false",
                "--v=1",
            ],
        )
        self._wait_ready(f"https://127.0.0.1:{port}/healthz", ADMIN_TOKEN, 60, "kube-scheduler")

    def stop_process(self, name: str) -> None:
        """End one component (the node stops kube-controller-manager before its pods)."""
        for pname, proc in self.processes:
            if pname == name and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=15)

    def stop(self) -> None:
        for _, proc in reversed(self.processes):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for name, proc in reversed(self.processes):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)
            del name
        self.processes.clear()
