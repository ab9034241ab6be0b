"""Zero loss on a real node: an engine SIGKILLed mid-stream costs no stream (issue 16).

The fault suite proves this with local processes (`servefleet.bench.fault_engines`); here the
engines are pods of the chart on a real node, and the fault is what the OOM killer or a crash
does to a pod: the engine container's main process gets SIGKILL from the host, with no drain
and no goodbye (a `kubectl delete pod` would be graceful, and proves something else). Streams
that were running on it must still end, through the gateway Service, with exactly the text
and token count an uninterrupted run gives, because the gateway continues each one on the
other replica from the token ids the client already has (`servefleet.api.stream_resume`).
The gateway's `stream_continuations` counter proves a kill hit live streams, so the test
cannot pass with a kill that came too late; the pool must then be whole again.

The module installs the chart itself (`helm upgrade --install`) and removes it at the end, so
it runs alone or beside `test_node_pods.py` in any order. Run (as root): `uv run pytest
e2e/test_node_failover.py -q -s` or `make e2e-node`.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from k8s.kubectl import Kube, is_ready, wait_for
from k8s.node import NodeCluster

from servefleet.api.engines import engine_adapter
from servefleet.api.stream_resume import CONTINUATION_HEADER
from servefleet.bench.fault_stack import metric_sum, scrape
from servefleet.gateway.metrics import PREFIX

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "servefleet"
EXAMPLE = ROOT / "examples" / "llmdeployment.yaml"
RELEASE = "servefleet"
SYSTEM_NAMESPACE = "servefleet"
NAMESPACE = "default"
LLMD = "smollm2"
MODEL = "smollm2-135m-instruct"
API_KEY = "sk-servefleet-demo-change-me"  # the example's demo Secret
ENGINE_PORT = engine_adapter("servefleet").port
STARTUP_TIMEOUT_S = 480  # a busy two-core node loads a model slowly
STREAM_TIMEOUT_S = 240.0
MAX_TOKENS = 128  # long enough that every stream is still running when the kill lands
TOKENS_BEFORE_KILL = 12  # each stream has had this many chunks: all of them are mid-stream
ENGINE_RUNNING = engine_adapter("servefleet").metrics.requests_running
CONTINUATIONS = PREFIX + "stream_continuations_total"
REPLICAS_READY = PREFIX + "replicas_ready"

# Greedy, and sampled with the client's own seed: both must come out token-identical.
PROMPTS = (
    "Count from one to one hundred in words.",
    "Write a long story about a lighthouse keeper.",
    "List the countries of Europe with their capitals.",
)
SAMPLED = ((0.8, 1234), (1.0, 77), (0.7, 2026))

pytestmark = pytest.mark.timeout(1200)


def request_bodies() -> list[dict[str, Any]]:
    """Three greedy and three seeded sampled requests; ignore_eos so none ends early."""
    bodies = []
    for prompt in PROMPTS:
        bodies.append({"temperature": 0.0, "messages": [{"role": "user", "content": prompt}]})
    for prompt, (temperature, seed) in zip(PROMPTS, SAMPLED, strict=True):
        bodies.append(
            {
                "temperature": temperature,
                "seed": seed,
                "messages": [{"role": "user", "content": prompt}],
            }
        )
    common = {
        "model": MODEL,
        "stream": True,
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    return [{**common, **body} for body in bodies]


@dataclass
class Stream:
    """One streamed answer as the client saw it; `chunks` grows while it runs."""

    body: dict[str, Any]
    status: int = 0
    continuation: str = ""
    text: str = ""
    chunks: int = 0
    completion_tokens: int | None = None
    finish_reason: str | None = None
    done: bool = False
    errors: list[str] = field(default_factory=list)

    def run(self, url: str) -> None:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        try:
            with (
                httpx.Client(timeout=STREAM_TIMEOUT_S) as client,
                client.stream("POST", url, json=self.body, headers=headers) as response,
            ):
                self.status = response.status_code
                self.continuation = response.headers.get(CONTINUATION_HEADER, "")
                for line in response.iter_lines():
                    self._event(line)
        except httpx.HTTPError as exc:
            self.errors.append(f"{type(exc).__name__}: {exc}")

    def _event(self, line: str) -> None:
        if not line.startswith("data: "):
            return
        if line == "data: [DONE]":
            self.done = True
            return
        payload = json.loads(line.removeprefix("data: "))
        if "error" in payload:
            self.errors.append(json.dumps(payload["error"]))
        for choice in payload.get("choices") or []:
            content = (choice.get("delta") or {}).get("content") or ""
            self.text += content
            self.chunks += bool(content)
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        if payload.get("usage"):
            self.completion_tokens = payload["usage"]["completion_tokens"]

    def problems(self) -> list[str]:
        """Why this stream did not end as a complete answer (empty: it did)."""
        found = list(self.errors)
        if self.status != 200:
            found.append(f"HTTP {self.status}")
        if not self.done or self.finish_reason != "length":
            found.append(f"ended without [DONE] or finish_reason length ({self.finish_reason})")
        return found


def run_streams(
    url: str, bodies: list[dict[str, Any]]
) -> tuple[list[Stream], list[threading.Thread]]:
    """Start every request at once, each in its own thread; (streams, threads)."""
    streams = [Stream(body) for body in bodies]
    threads = [threading.Thread(target=s.run, args=(url,), daemon=True) for s in streams]
    for thread in threads:
        thread.start()
    return streams, threads


def join(threads: list[threading.Thread]) -> None:
    for thread in threads:
        thread.join(timeout=STREAM_TIMEOUT_S + 10)
    assert not any(t.is_alive() for t in threads), "a stream hung"


# --------------------------------------------------------------------------- the cluster


def split_image(ref: str) -> tuple[str, str]:
    repository, _, tag = ref.rpartition(":")
    return repository, tag


def example_with_two_engines() -> str:
    """The example, pinned at two replicas, with a CPU request two of which fit a 2-core node."""
    docs = list(yaml.safe_load_all(EXAMPLE.read_text()))
    for doc in docs:
        if doc.get("kind") == "LLMDeployment":
            doc["spec"]["pool"].update(minReplicas=2, maxReplicas=2)
            doc["spec"]["engine"]["resources"]["requests"]["cpu"] = "250m"
    return yaml.safe_dump_all(docs)


@pytest.fixture(scope="module")
def cluster(node_cluster: NodeCluster) -> Iterator[NodeCluster]:
    """The chart with this run's images, and the example at two ready engines; both removed
    at the end, so `test_node_pods.py` finds the node as it would alone."""
    kube = node_cluster.kube
    repo, tag = split_image(node_cluster.images["control-plane"])
    engine_repo, engine_tag = split_image(node_cluster.images["engine"])
    kube.helm(
        "upgrade", "--install", RELEASE, str(CHART), "--namespace", SYSTEM_NAMESPACE,
        "--create-namespace", "--wait", "--timeout=5m",
        "--set", f"image.repository={repo}", "--set", f"image.tag={tag}",
        "--set", f"image.pullPolicy={node_cluster.pull_policy}",
        "--set", f"engineImage.repository={engine_repo}", "--set", f"engineImage.tag={engine_tag}",
        "--set", "operator.resyncSeconds=5",
        "--set", f"operator.watchNamespaces={{{NAMESPACE}}}",
    )  # fmt: skip
    kube.apply_text(example_with_two_engines(), NAMESPACE)
    try:
        yield node_cluster
    finally:
        kube.kubectl(
            "delete", "llmd", LLMD, "-n", NAMESPACE, "--wait=true", "--timeout=120s", check=False
        )
        kube.helm("uninstall", RELEASE, "--namespace", SYSTEM_NAMESPACE, "--wait")


def engine_pods(kube: Kube) -> list[dict[str, Any]]:
    llmd = kube.get("llmd", LLMD, NAMESPACE) or {}
    selector = llmd.get("status", {}).get("selector")
    if not selector:
        return []
    pods = kube.list("pods", NAMESPACE, selector)
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def internal_headers(kube: Kube) -> dict[str, str]:
    """The chart's generated internal API key: the gateways' /metrics answer only it."""
    encoded = kube.kubectl(
        "get", "secret", f"{RELEASE}-internal", "-n", SYSTEM_NAMESPACE,
        "-o", "jsonpath={.data.internal-api-key}",
    )  # fmt: skip
    return {"authorization": f"Bearer {base64.b64decode(encoded).decode()}"}


def gateway_urls(kube: Kube) -> tuple[str, list[str]]:
    """(the tenant URL of the gateway Service, the internal URL of every gateway pod)."""
    service = kube.get("service", f"{RELEASE}-gateway", SYSTEM_NAMESPACE)
    assert service is not None
    port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "http")
    internal = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "internal")
    selector = ",".join(f"{k}={v}" for k, v in service["spec"]["selector"].items())
    pods = [p for p in kube.list("pods", SYSTEM_NAMESPACE, selector) if is_ready(p)]
    tenant = f"http://{service['spec']['clusterIP']}:{port}/v1/chat/completions"
    return tenant, [f"http://{p['status']['podIP']}:{internal}" for p in pods]


def gateway_sum(kube: Kube, urls: list[str], name: str) -> float:
    headers = internal_headers(kube)
    return sum(metric_sum(scrape(url, headers), name, model=MODEL) for url in urls)


def pool_whole(kube: Kube, gateways: list[str]) -> bool:
    """Two ready engine pods, and every gateway routes to both."""
    pods = engine_pods(kube)
    if len(pods) != 2 or not all(is_ready(p) for p in pods):
        return False
    headers = internal_headers(kube)
    try:
        return all(
            metric_sum(scrape(url, headers), REPLICAS_READY, model=MODEL) == 2 for url in gateways
        )
    except httpx.HTTPError:
        return False


def running_on(pod: dict[str, Any]) -> float:
    """Sequences the engine pod is generating now, from its own /metrics."""
    try:
        samples = scrape(f"http://{pod['status']['podIP']}:{ENGINE_PORT}", headers={})
    except httpx.HTTPError:
        return 0.0
    return metric_sum(samples, ENGINE_RUNNING)


# --------------------------------------------------------------------------- the kill


def main_process(container_id: str) -> int:
    """The host pid of a container's main process: the process in the container's cgroup
    that is pid 1 of its own pid namespace (the runtime's name for it is not needed)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if container_id not in (entry / "cgroup").read_text():
                continue
            status = (entry / "status").read_text()
        except OSError:
            continue  # gone meanwhile
        nspid = next(line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:"))
        if nspid[-1] == "1":
            return int(entry.name)
    # Only with KUBECONFIG at a remote cluster: its node is another machine, and a SIGKILL
    # from inside the container cannot reach its pid 1 (the kernel shields a namespace's init).
    pytest.skip(
        f"container {container_id[:12]} runs on a remote node: a host SIGKILL needs the node here"
    )


def sigkill_engine(pod: dict[str, Any]) -> int:
    """SIGKILL the engine container's main process from the host; its pid."""
    container_id = pod["status"]["containerStatuses"][0]["containerID"].partition("://")[2]
    pid = main_process(container_id)
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    assert b"engine" in cmdline, cmdline
    os.kill(pid, signal.SIGKILL)
    return pid


def killed_by_sigkill(kube: Kube, name: str) -> dict[str, Any] | None:
    """The victim pod's last termination once the kubelet has restarted it (None before)."""
    pod = next((p for p in engine_pods(kube) if p["metadata"]["name"] == name), None)
    if pod is None:
        return None
    status = pod["status"]["containerStatuses"][0]
    terminated = status.get("lastState", {}).get("terminated")
    if status.get("restartCount", 0) < 1 or not terminated:
        return None
    result: dict[str, Any] = terminated
    return result


@dataclass
class Kill:
    """What the kill hit: the pod, its running sequences, every stream's chunks so far."""

    pod: str
    running: float
    chunks: list[int]
    at: float


def kill_busiest_engine(kube: Kube, streams: list[Stream]) -> Kill:
    """Once every stream is mid-answer, SIGKILL the engine generating the most of them."""
    wait_for(
        f"every stream to have {TOKENS_BEFORE_KILL} chunks",
        lambda: all(s.chunks >= TOKENS_BEFORE_KILL for s in streams),
        timeout=120,
        interval=0.05,
    )
    running = {p["metadata"]["name"]: (running_on(p), p) for p in engine_pods(kube)}
    name, (on_victim, victim) = max(running.items(), key=lambda item: item[1][0])
    assert on_victim > 0, f"no engine is generating: { {k: v[0] for k, v in running.items()} }"
    chunks = [s.chunks for s in streams]
    sigkill_engine(victim)
    return Kill(name, on_victim, chunks, time.monotonic())


def whole_again(kube: Kube, gateways: list[str], kill: Kill) -> bool:
    """The killed engine restarted by the kubelet, and both engines ready and routed to."""
    return killed_by_sigkill(kube, kill.pod) is not None and pool_whole(kube, gateways)


def join_watching_pool(
    kube: Kube, gateways: list[str], threads: list[threading.Thread], kill: Kill
) -> float:
    """Wait for the streams, and meanwhile for the pool to be whole again; seconds from the
    kill to a whole pool (the streams may end before or after that)."""
    whole_at: float | None = None
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while (any(t.is_alive() for t in threads) or whole_at is None) and time.monotonic() < deadline:
        if whole_at is None and whole_again(kube, gateways, kill):
            whole_at = time.monotonic()
        time.sleep(0.5)
    join(threads)
    assert whole_at is not None, "the pool was not whole again"
    return whole_at - kill.at


# --------------------------------------------------------------------------- the test


def test_sigkilled_engine_mid_stream_loses_no_stream(cluster: NodeCluster) -> None:
    kube = cluster.kube
    started = time.monotonic()
    wait_for("2 ready engine pods", lambda: len(engine_pods(kube)) == 2, STARTUP_TIMEOUT_S, 2)
    url, gateways = gateway_urls(kube)
    wait_for("the gateway to route to both", lambda: pool_whole(kube, gateways), STARTUP_TIMEOUT_S)
    bodies = request_bodies()

    references, threads = run_streams(url, bodies)  # nothing fails: the reference run
    join(threads)
    for ref in references:
        assert not ref.problems(), (ref.body["messages"], ref.problems())

    continued_before = gateway_sum(kube, gateways, CONTINUATIONS)
    streams, threads = run_streams(url, bodies)
    kill = kill_busiest_engine(kube, streams)
    to_whole = join_watching_pool(kube, gateways, threads, kill)
    continued = gateway_sum(kube, gateways, CONTINUATIONS) - continued_before

    assert all(s.status == 200 for s in streams), [s.status for s in streams]
    for stream, ref in zip(streams, references, strict=True):
        assert not stream.problems(), (stream.body["messages"], stream.problems())
        assert stream.continuation == "exact", stream.continuation
        assert stream.text == ref.text, (stream.body, stream.text, ref.text)
        assert stream.completion_tokens == ref.completion_tokens == MAX_TOKENS
    assert continued >= 1, "the kill hit no live stream: nothing was continued"
    terminated = killed_by_sigkill(kube, kill.pod)
    assert terminated is not None and terminated["exitCode"] == 128 + signal.SIGKILL, terminated
    print(
        f"\nengine SIGKILL: {len(streams)} streams, {kill.running:.0f} running on the victim, "
        f"chunks at the kill {kill.chunks}, {continued:.0f} continued, 0 failed, every text "
        f"and token count equal to its reference; pool whole {to_whole:.0f}s after the kill; "
        f"test {time.monotonic() - started:.0f}s"
    )
