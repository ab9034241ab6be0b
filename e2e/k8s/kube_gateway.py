"""The gateway in Kubernetes mode as a process, and the stand-ins it routes to, for the e2e
tests on a control plane without a node: `servefleet gateway --kube-routes` as the chart's
gateway ServiceAccount, OpenAI stand-in replicas on this machine, and the EndpointSlices the
EndpointSlice controller would write for them (there is no kubelet to run pods)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import uvicorn
import yaml
from k8s.kubectl import wait_for

from servefleet.api.conventions import LABEL_SERVICE_NAME
from servefleet.bench.fake_upstream import FakeOpenAI
from servefleet.bench.processes import free_port


def host_address() -> str:
    """This machine's non-loopback IPv4: EndpointSlices refuse 127.0.0.0/8 (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(("10.255.255.255", 1))
        except OSError as exc:
            raise RuntimeError(f"no non-loopback IPv4 address for a stand-in: {exc}") from exc
        address = str(sock.getsockname()[0])
    if address.startswith("127."):
        raise RuntimeError("no non-loopback IPv4 address for a stand-in replica")
    return address


@contextlib.contextmanager
def stand_in(host: str) -> Iterator[tuple[FakeOpenAI, int]]:
    """An OpenAI stand-in replica on `host` (a thread); yields the app and its port."""
    app, port = FakeOpenAI(), free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_for("the stand-in replica to start", lambda: server.started, timeout=10)
        yield app, port
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def endpoint_slice(namespace: str, service: str, address: str, port: int) -> dict[str, Any]:
    """What the EndpointSlice controller writes for one ready engine pod."""
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{service}-e2e",
            "namespace": namespace,
            "labels": {
                LABEL_SERVICE_NAME: service,
                "endpointslice.kubernetes.io/managed-by": "e2e-test",
            },
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
        "endpoints": [{"addresses": [address], "conditions": {"ready": True}}],
    }


class KubeGateway:
    """`servefleet gateway --kube-routes` with the given identity and route signing key; no
    internal port (these tests read nothing there, and serving it would need a key)."""

    def __init__(self, kubeconfig: Path, route_key: Path, work: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = work / "gateway.log"
        base = work / "gateway.yaml"
        base.write_text(
            yaml.safe_dump({"host": "127.0.0.1", "port": self.port, "internal_port": None})
        )
        code = "import sys; from servefleet.cli.main import main; sys.exit(main())"
        argv = [
            sys.executable, "-c", code, "gateway", f"--config={base}", "--kube-routes",
            f"--kubeconfig={kubeconfig}", f"--route-signing-key-file={route_key}",
            "--secret-refresh-seconds=1", "--log-level=info",
        ]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def logs(self) -> str:
        return self.log.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=5)

    def chat(self, key: str, model: str) -> httpx.Response:
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        return httpx.post(
            self.url + "/v1/chat/completions",
            headers={"authorization": f"Bearer {key}"},
            json=body,
            timeout=30,
        )

    def status(self, key: str, model: str) -> int | None:
        """The status of one chat as `key` (None when the gateway is not listening yet)."""
        assert self.alive(), f"gateway died:\n{self.logs()[-4000:]}"
        try:
            return self.chat(key, model).status_code
        except httpx.HTTPError:
            return None
