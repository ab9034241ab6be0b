"""Attacks on `servefleet up` (local mode): a user of the same machine with one tenant key.

Local mode must be as closed as a cluster: heads bounded on its gateway, engines only on
loopback and only with the key the run generated, so nothing on the machine bypasses the
gateway's keys and limits.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from servefleet.bench.attack_common import VICTIM_CLIENTS, AttackResult
from servefleet.bench.attack_sockets import huge_head, slowloris
from servefleet.bench.fault_stack import MODEL, Part, StackError, api_key
from servefleet.bench.processes import free_port, servefleet_command

LOCAL_ATTACKER = "alpha"
LOCAL_VICTIM = "beta"
SLOWLORIS_CONNECTIONS = 30
HEAD_CUT_BOUND_S = 25.0  # the head deadline (10 s) plus slack on a loaded machine
HUGE_HEAD_BYTES = 100 * 2**20
FLOOD_LINES = 2000  # lines of each hostile batch
FLOOD_BATCHES = 5
FLOOD_S = 10.0  # the flood runs this long while the victim is timed, then is cancelled

MANIFEST = f"""
apiVersion: servefleet.io/v1alpha1
kind: LLMDeployment
metadata: {{name: attacked}}
spec:
  model: {{name: {MODEL}, source: {{builtin: {MODEL}}}}}
  engine: {{maxNumSeqs: 4, args: ["--threads", "1", "--kv-cache-memory", "128MiB"]}}
  pool: {{minReplicas: 1, maxReplicas: 1, perReplicaConcurrency: 4}}
  # As many slots as the victim has live clients stay free of batch lines (gateway README).
  admission: {{interactiveReservedSlots: {VICTIM_CLIENTS}}}
  autoscaling: {{enabled: false}}
  tenants:
    - {{name: {LOCAL_ATTACKER}, apiKeySecretRef: {{name: keys, key: {LOCAL_ATTACKER}}}}}
    - {{name: {LOCAL_VICTIM}, apiKeySecretRef: {{name: keys, key: {LOCAL_VICTIM}}}}}
---
apiVersion: v1
kind: Secret
metadata: {{name: keys}}
stringData: {{{LOCAL_ATTACKER}: {api_key(LOCAL_ATTACKER)}, {LOCAL_VICTIM}: {api_key(LOCAL_VICTIM)}}}
"""


@dataclass
class LocalUp:
    """`servefleet up` as a process, and the engines it started."""

    workdir: Path
    part: Part | None = None
    engines: list[str] = field(default_factory=list)

    def start(self, ready_timeout_s: float = 240.0) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        manifest = self.workdir / "llmd.yaml"
        manifest.write_text(MANIFEST)
        port = free_port()
        argv = [*servefleet_command(), "up", str(manifest), "--port", str(port)]
        argv += ["--log-dir", str(self.workdir / "logs")]
        argv += ["--batch-dir", str(self.workdir / "batches")]
        self.part = Part("servefleet-up", argv, f"http://127.0.0.1:{port}", self.workdir / "up.log")
        self.part.start()
        deadline = time.monotonic() + ready_timeout_s
        while time.monotonic() < deadline:
            if not self.part.alive():
                raise StackError(f"servefleet up exited:\n{self.part.tail()}")
            if "ready: warm replicas are serving" in self.part.log.read_text(errors="replace"):
                self.engines = self._engine_urls()
                return
            time.sleep(0.5)
        raise StackError(f"servefleet up not ready in time:\n{self.part.tail()}")

    @property
    def url(self) -> str:
        """Where tenants call: the local gateway."""
        assert self.part is not None
        return self.part.url

    def _engine_urls(self) -> list[str]:
        assert self.part is not None and self.part.proc is not None
        urls = []
        for child in psutil.Process(self.part.proc.pid).children(recursive=True):
            found = re.search(r"--port (\d+)", " ".join(child.cmdline()))
            if found and "engine" in child.cmdline():
                urls.append(f"http://127.0.0.1:{found.group(1)}")
        return urls

    def engine_listen_addresses(self) -> list[str]:
        assert self.part is not None and self.part.proc is not None
        found = []
        for child in psutil.Process(self.part.proc.pid).children(recursive=True):
            if "engine" not in child.cmdline():
                continue
            for conn in child.net_connections(kind="tcp"):
                if conn.status == psutil.CONN_LISTEN:
                    found.append(f"{conn.laddr.ip}:{conn.laddr.port}")
        return found

    def stop(self) -> None:
        if self.part is None or self.part.proc is None:
            return
        if self.part.alive():
            self.part.signal(signal.SIGINT)
            try:
                self.part.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.part.stop()


def local_slowloris(up: LocalUp, result: AttackResult) -> None:
    """servefleet up: 30 request heads at one byte a second."""
    assert up.part is not None
    cuts = slowloris(up.part.url, SLOWLORIS_CONNECTIONS, interval_s=1.0, max_s=60.0)
    slowest = max(c.seconds for c in cuts)
    held = [c for c in cuts if not c.cut]
    result.figures.update({"connections": len(cuts), "held": len(held), "slowest_cut_s": slowest})
    result.require(not held, f"{len(held)} slow heads were never cut")
    result.require(slowest <= HEAD_CUT_BOUND_S, f"a slow head was cut only after {slowest} s")
    result.outcome = (
        f"{len(cuts) - len(held)}/{len(cuts)} slow heads cut, the last after {slowest} s"
    )


def local_huge_head(up: LocalUp, result: AttackResult) -> None:
    """servefleet up: a 100 MB request head."""
    assert up.part is not None
    cut = huge_head(up.part.url, HUGE_HEAD_BYTES)
    result.figures.update({"status": cut.status, "seconds": cut.seconds})
    result.require(cut.cut and cut.status in (431, None), f"huge head: {cut}")
    result.require(cut.seconds <= HEAD_CUT_BOUND_S, f"huge head read for {cut.seconds} s")
    result.outcome = f"{cut.status or 'closed'} after {cut.seconds} s"


def local_engine_bypass(up: LocalUp, result: AttackResult) -> None:
    """servefleet up: a local user calls the engines directly.

    Engines listen on loopback only and refuse anyone without the run's engine key."""
    listening = up.engine_listen_addresses()
    result.figures["engine_listen"] = listening
    result.require(bool(listening), "no engine listening socket found")
    result.require(
        all(a.startswith("127.0.0.1:") for a in listening),
        f"engines listen beyond loopback: {listening}",
    )
    headers = {"authorization": f"Bearer {api_key(LOCAL_ATTACKER)}"}
    for url in up.engines:
        for path, body in (
            (
                "/v1/chat/completions",
                {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
            ),
            ("/tokenize", {"model": MODEL, "prompt": "hi"}),
        ):
            response = httpx.post(url + path, json=body, headers=headers, timeout=30)
            result.figures[path] = response.status_code
            result.require(response.status_code == 401, f"{url}{path}: {response.status_code}")
    result.outcome = f"engines on {', '.join(listening)}; 401 without the run's engine key"


def local_batch_snooping(up: LocalUp, result: AttackResult) -> None:
    """servefleet up: a tenant reads, deletes, cancels and reuses another tenant's batch.

    Files and batches are per tenant: another's id is the 404 of an id that does not exist."""
    mine = {"authorization": f"Bearer {api_key(LOCAL_ATTACKER)}"}
    theirs = {"authorization": f"Bearer {api_key(LOCAL_VICTIM)}"}
    line: dict[str, object] = {"custom_id": "v", "method": "POST", "url": "/v1/chat/completions"}
    line["body"] = {
        "model": MODEL,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "hi"}],
    }
    with httpx.Client(base_url=up.url, timeout=30) as http:
        upload = {"file": ("v.jsonl", json.dumps(line).encode() + b"\n")}
        file_id = http.post(
            "/v1/files", files=upload, data={"purpose": "batch"}, headers=theirs
        ).json()["id"]
        create = {"input_file_id": file_id, "endpoint": line["url"], "completion_window": "24h"}
        batch_id = http.post("/v1/batches", json=create, headers=theirs).json()["id"]
        tries = {
            "read file": http.get(f"/v1/files/{file_id}", headers=mine),
            "download file": http.get(f"/v1/files/{file_id}/content", headers=mine),
            "delete file": http.delete(f"/v1/files/{file_id}", headers=mine),
            "read batch": http.get(f"/v1/batches/{batch_id}", headers=mine),
            "cancel batch": http.post(f"/v1/batches/{batch_id}/cancel", headers=mine),
            "climb to it": http.get(
                f"/v1/files/..%2F..%2F{LOCAL_VICTIM}%2Ffiles%2F{file_id}", headers=mine
            ),
        }
        reuse = http.post("/v1/batches", json=create, headers=mine)
        listed = http.get("/v1/files", headers=mine).json()["data"]
        deadline = time.monotonic() + 120
        status = ""
        while time.monotonic() < deadline and status != "completed":
            status = http.get(f"/v1/batches/{batch_id}", headers=theirs).json()["status"]
            time.sleep(0.5)
        kept = http.get(f"/v1/files/{file_id}/content", headers=theirs)
    got = {what: answer.status_code for what, answer in tries.items()}
    result.figures.update({"answers": got, "reuse": reuse.status_code, "victim_batch": status})
    for what, code in got.items():
        result.require(code == 404, f"{what}: {code}")
    result.require(reuse.status_code == 400, f"a batch from another's file: {reuse.status_code}")
    result.require(all(f["id"] != file_id for f in listed), "another's file is listed")
    result.require(status == "completed", f"the victim's batch ended {status!r}")
    result.require(kept.status_code == 200, "the victim's file is gone")
    result.outcome = "404 on every id of another tenant; 400 on reuse; the victim's batch completed"


def _chat_line(custom_id: str) -> dict[str, object]:
    body = {"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": "Count."}]}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def local_batch_flood(up: LocalUp, result: AttackResult) -> None:
    """servefleet up: a tenant floods the Batch API with 5 batches of 2,000 lines each.

    Lines run as the batch class: they take only the slots interactive requests leave, so
    the victim's chats keep their latency; the flood is cancelled at the end."""
    mine = {"authorization": f"Bearer {api_key(LOCAL_ATTACKER)}"}
    data = b"".join(json.dumps(_chat_line(f"f{i}")).encode() + b"\n" for i in range(FLOOD_LINES))
    with httpx.Client(base_url=up.url, headers=mine, timeout=60) as http:
        upload = {"file": ("flood.jsonl", data)}
        file_id = http.post("/v1/files", files=upload, data={"purpose": "batch"}).json()["id"]
        create = {"input_file_id": file_id, "endpoint": "/v1/chat/completions"}
        create["completion_window"] = "24h"
        ids = [http.post("/v1/batches", json=create).json()["id"] for _ in range(FLOOD_BATCHES)]
        time.sleep(FLOOD_S)
        for batch_id in ids:
            http.post(f"/v1/batches/{batch_id}/cancel")
        deadline = time.monotonic() + 60
        ended: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            ended = [http.get(f"/v1/batches/{b}").json() for b in ids]
            if all(b["status"] == "cancelled" for b in ended):
                break
            time.sleep(0.5)
    answered = sum(int(b["request_counts"]["completed"]) for b in ended)
    statuses = sorted({str(b["status"]) for b in ended})
    result.figures.update({"batches": len(ids), "lines_answered": answered, "ended": statuses})
    result.require(len(ids) == FLOOD_BATCHES, f"batches accepted: {len(ids)}")
    result.require(answered > 0, "the flood ran no line: the victim was not tested against it")
    result.require(statuses == ["cancelled"], f"the flood's batches ended {statuses}")
    result.outcome = (
        f"{FLOOD_BATCHES} x {FLOOD_LINES} lines accepted; {answered} answered as the batch "
        f"class in {FLOOD_S:.0f} s, then cancelled"
    )
