"""The LeaderWorkerSet controller (sigs.k8s.io/lws) as a local process, with its webhooks.

LWS's pod webhook is not optional: it gives each pod of a group its group index and worker
index labels and the `LWS_*` env (leader address, group size, worker index) that the
engines rendezvous with, and its controllers read those labels back. So the webhooks run
here too. In a cluster LWS manages its own certificates for its webhook Service; this
control plane has no node to route a Service to, so the webhook server listens on
127.0.0.1 with a certificate made here for that address (LWS's internal certificate
management off), and the webhook configurations name it by URL with that CA. The
manifests (CRD, webhook rules) are LWS's own, from its Go module (`build.sh`).
"""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from k8s.kubectl import Kube, wait_for

from servefleet.bench.processes import free_port

CRD_NAME = "leaderworkersets.leaderworkerset.x-k8s.io"


def _certificate(cert_dir: Path) -> bytes:
    """A self-signed serving certificate for 127.0.0.1 (tls.crt / tls.key, as
    controller-runtime's webhook server reads them); its PEM is its own CA bundle."""
    cert_dir.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(cert_dir / "tls.key"), "-out", str(cert_dir / "tls.crt"),
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    return (cert_dir / "tls.crt").read_bytes()


def webhook_configurations(manifests: str, port: int, ca: bytes) -> list[dict[str, Any]]:
    """LWS's webhook configurations, pointed at https://127.0.0.1:port; the pod webhooks only
    for pods of a LeaderWorkerSet (as LWS's kustomize patch narrows them)."""
    out = []
    for doc in yaml.safe_load_all(manifests):
        if not doc:
            continue
        doc["metadata"]["name"] = "lws-e2e-" + doc["metadata"]["name"]
        for hook in doc["webhooks"]:
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {
                "url": f"https://127.0.0.1:{port}{path}",
                "caBundle": base64.b64encode(ca).decode(),
            }
            if path.endswith("-v1-pod"):
                exists = {"key": "leaderworkerset.sigs.k8s.io/name", "operator": "Exists"}
                hook["objectSelector"] = {"matchExpressions": [exists]}
        out.append(doc)
    return out


@dataclass
class LwsController:
    """The controller process; `stop()` ends it and removes its webhook configurations."""

    bin_dir: Path
    work_dir: Path
    kube: Kube
    proc: subprocess.Popen[bytes] | None = None
    hooks: list[dict[str, Any]] = field(default_factory=list)

    @property
    def manifests(self) -> Path:
        return self.bin_dir.parent / "lws"

    def start(self) -> None:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.kube.kubectl("apply", "--server-side", "-f", str(self.manifests / "crd.yaml"))
        established = '{.status.conditions[?(@.type=="Established")].status}'
        wait_for("the LeaderWorkerSet CRD", lambda: self.kube.kubectl(
            "get", "crd", CRD_NAME, "-o", f"jsonpath={established}") == "True")  # fmt: skip
        certs = self.work_dir / "certs"
        ca = _certificate(certs)
        port, health = free_port(), free_port()
        config = {
            "apiVersion": "config.lws.x-k8s.io/v1alpha1",
            "kind": "Configuration",
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {"enable": False},
            "webhook": {"host": "127.0.0.1", "port": port, "certDir": str(certs)},
            "metrics": {"bindAddress": "0"},
            "health": {"healthProbeBindAddress": f"127.0.0.1:{health}"},
        }
        (self.work_dir / "config.yaml").write_text(yaml.safe_dump(config))
        log = open(self.work_dir / "lws-controller.log", "wb")  # noqa: SIM115 - lives with it
        self.proc = subprocess.Popen(
            [str(self.bin_dir / "lws-controller"), f"--config={self.work_dir / 'config.yaml'}"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "KUBECONFIG": str(self.kube.kubeconfig)},
        )  # fmt: skip
        self._wait_healthy(health)
        self.hooks = webhook_configurations((self.manifests / "webhooks.yaml").read_text(),
                                            port, ca)  # fmt: skip
        self.kube.apply_text(yaml.safe_dump_all(self.hooks))

    def _wait_healthy(self, port: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"lws-controller exited {self.proc.returncode}:\n{self.logs()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.3)
        raise RuntimeError(f"lws-controller not ready after {timeout}s:\n{self.logs()}")

    def logs(self) -> str:
        path = self.work_dir / "lws-controller.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def stop(self) -> None:
        for hook in self.hooks:
            kind = hook["kind"].lower()
            self.kube.kubectl("delete", kind, hook["metadata"]["name"], "--ignore-not-found",
                              check=False)  # fmt: skip
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=5)
