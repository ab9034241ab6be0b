"""A throwaway control plane for the e2e tests: etcd + kube-apiserver + kube-controller-manager.

No kubelet and no scheduler: pods are created by the real ReplicaSet controller and
stay unscheduled; the tests mark them Ready through the status subresource, standing
in for the kubelet. Everything else (RBAC, CRD validation with CEL, defaulting, the
scale subresource, garbage collection) is the real thing.
"""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ADMIN_TOKEN = "servefleet-e2e-admin-token"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


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

        api_port = free_port()
        self.server = f"https://127.0.0.1:{api_port}"
        self._spawn(
            "kube-apiserver",
            [
                f"--etcd-servers=http://127.0.0.1:{etcd_port}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={api_port}",
                f"--cert-dir={pki}",
                "--authorization-mode=RBAC",
                f"--token-auth-file={pki / 'tokens.csv'}",
                "--service-cluster-ip-range=10.96.0.0/16",
                f"--service-account-key-file={pki / 'sa.pub'}",
                f"--service-account-signing-key-file={pki / 'sa.key'}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                # No kubelet mounts tokens here; the plugin would only make pod creation
                # wait for each namespace's default ServiceAccount.
                "--disable-admission-plugins=ServiceAccount",
                "--allow-privileged=true",
                "--v=1",
            ],
        )
        self._wait_ready(f"{self.server}/readyz", ADMIN_TOKEN, 120, "kube-apiserver")
        self.kubeconfig = write_kubeconfig(
            self.work_dir / "admin.kubeconfig", self.server, ADMIN_TOKEN
        )

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
                "--controllers=*,-nodeipam,-nodelifecycle,-persistentvolume-binder,-attachdetach,"
                "-persistentvolume-expander,-ttl,-bootstrapsigner,-tokencleaner,-cloud-node-lifecycle,"
                "-service-lb-controller,-node-route-controller",
                "--concurrent-gc-syncs=10",
                "--v=1",
            ],
        )
        self._wait_ready(
            f"https://127.0.0.1:{kcm_port}/healthz", ADMIN_TOKEN, 60, "kube-controller-manager"
        )

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
