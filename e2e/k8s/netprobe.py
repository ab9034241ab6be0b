"""Who can open a TCP connection to whom, asked from inside pods: the NetworkPolicy tests' probe.

A probe pod runs the control-plane image (it has python3) with whatever labels the test
gives it, in whatever namespace, and sleeps. `probe` runs a short Python loop in it with
`kubectl exec`: for `seconds`, it tries to connect to every target in turn and counts what
happened. A connection that completes its handshake reached the port; a policy's REJECT shows
as a refused connection and a DROP as a timeout. Since a refused connection also means
"nothing listens there", a test pairs every "blocked" with a "reached" for the same target
from a pod that should get through (the chart's gateway to an engine, say).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from k8s.kubectl import Kube, is_ready, wait_for

CONNECT_TIMEOUT_S = 2.0
PROBE_SCRIPT = r"""
import json, socket, sys, time
targets = json.loads(sys.argv[1])
seconds, pause, timeout = (float(arg) for arg in sys.argv[2:5])
counts = {name: {"connected": 0, "refused": 0, "timeout": 0, "error": 0} for name in targets}
end = time.monotonic() + seconds
while True:
    for name, (host, port) in targets.items():
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            counts[name]["connected"] += 1
        except ConnectionRefusedError:
            counts[name]["refused"] += 1
        except socket.timeout:
            counts[name]["timeout"] += 1
        except OSError:
            counts[name]["error"] += 1
    if time.monotonic() >= end:
        break
    time.sleep(pause)
print(json.dumps(counts))
"""

Target = tuple[str, int]


@dataclass(frozen=True)
class Tally:
    """What the connection attempts to one target came to."""

    connected: int
    refused: int
    timeout: int
    error: int

    @property
    def attempts(self) -> int:
        return self.connected + self.refused + self.timeout + self.error

    @property
    def blocked(self) -> bool:
        return self.attempts > 0 and self.connected == 0

    @property
    def reached(self) -> bool:
        return self.connected > 0

    def __str__(self) -> str:
        if self.blocked:
            how = "refused" if self.refused else "timed out" if self.timeout else "failed"
            return f"blocked {self.attempts}/{self.attempts} ({how})"
        return f"reached {self.connected}/{self.attempts}"


def probe_pod(
    name: str, namespace: str, labels: dict[str, str], image: str, pull_policy: str
) -> dict[str, Any]:
    """A pod that sleeps, labelled as the test (the attacker) chooses."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {
            "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": 0,
            "containers": [
                {
                    "name": "probe",
                    "image": image,
                    "imagePullPolicy": pull_policy,
                    "command": ["python3", "-c", "import time; time.sleep(10**9)"],
                    "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}},
                }
            ],
        },
    }


def start_pod(kube: Kube, manifest: dict[str, Any], timeout: float = 120) -> dict[str, Any]:
    """Apply a pod and wait until it runs; returns it (with its IP)."""
    kube.apply_text(json.dumps(manifest))
    name, namespace = manifest["metadata"]["name"], manifest["metadata"]["namespace"]

    def ready() -> dict[str, Any] | None:
        pod = kube.get("pod", name, namespace)
        return pod if pod is not None and is_ready(pod) else None

    return wait_for(f"pod {namespace}/{name} to run", ready, timeout=timeout, interval=1)


def probe(
    kube: Kube,
    namespace: str,
    pod: str,
    targets: dict[str, Target],
    seconds: float = 0.0,
    pause_s: float = 0.2,
) -> dict[str, Tally]:
    """Connection attempts from inside `pod` to every target, for `seconds` (once if 0)."""
    out = kube.kubectl(
        "exec", "-n", namespace, pod, "--", "python3", "-c", PROBE_SCRIPT,
        json.dumps(targets), str(seconds), str(pause_s), str(CONNECT_TIMEOUT_S),
    )  # fmt: skip
    counts = json.loads(out.strip().splitlines()[-1])
    return {name: Tally(**counts[name]) for name in targets}
