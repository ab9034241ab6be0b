"""The Batch API through `servefleet up` with the real engine (SmolLM2), driven by the official
`openai` client: a batch is uploaded and created, `up` is stopped mid-batch, started again on
the same `--batch-dir`, and the batch completes with every line answered once, in input order.

    uv run pytest e2e/test_local_batch.py -s
"""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
from procs import free_port

MANIFEST = """
apiVersion: servefleet.io/v1alpha1
kind: LLMDeployment
metadata: {name: smollm2}
spec:
  model: {name: smollm2, source: {builtin: smollm2-135m-instruct}}
  engine: {maxNumSeqs: 4}
  pool: {minReplicas: 1, maxReplicas: 1}
"""
LINES = 12
READY_TIMEOUT_S = 240


class Up:
    def __init__(self, work: Path, port: int) -> None:
        manifest = work / "llmd.yaml"
        manifest.write_text(MANIFEST)
        argv = [sys.executable, "-m", "servefleet.cli.main", "up", str(manifest)]
        argv += ["--port", str(port), "--log-dir", str(work / "logs")]
        argv += ["--batch-dir", str(work / "batches")]
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        assert self.proc.stdout is not None
        self.key, lines = "", []
        deadline = time.monotonic() + READY_TIMEOUT_S
        for line in self.proc.stdout:
            lines.append(line)
            if line.startswith("export OPENAI_API_KEY="):
                self.key = line.split("=", 1)[1].strip()
            if line.startswith("ready:") or time.monotonic() > deadline:
                break
        assert self.key and lines[-1].startswith("ready:"), "".join(lines)
        self.client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key=self.key, max_retries=0, timeout=60
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            self.proc.wait(timeout=90)


def _journaled(work: Path, batch_id: str) -> list[dict[str, object]]:
    journals = list((work / "batches").glob(f"tenants/*/batches/{batch_id}.jsonl"))
    if not journals:
        return []
    return [json.loads(x) for x in journals[0].read_text().splitlines() if x.strip()]


def test_a_batch_survives_a_restart_of_up_and_answers_every_line_once(tmp_path: Path) -> None:
    work = tmp_path
    port = free_port()
    up = Up(work, port)
    try:
        rows = [
            {
                "custom_id": f"q{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": "smollm2",
                    "max_tokens": 24,
                    "temperature": 0,
                    "messages": [{"role": "user", "content": f"Say the number {i}."}],
                },
            }
            for i in range(LINES)
        ]
        data = b"".join(json.dumps(r).encode() + b"\n" for r in rows)
        file = up.client.files.create(file=("q.jsonl", io.BytesIO(data)), purpose="batch")
        batch = up.client.batches.create(
            input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        assert batch.status == "in_progress" and batch.request_counts.total == LINES
        deadline = time.monotonic() + 180
        while len(_journaled(work, batch.id)) < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        before = len(_journaled(work, batch.id))
        assert 3 <= before < LINES, before
    finally:
        up.stop()  # the gateway goes down mid-batch
    print(f"\n{before} of {LINES} lines journaled when up stopped")

    up = Up(work, port)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            done = up.client.batches.retrieve(batch.id)
            if done.status == "completed":
                break
            time.sleep(0.5)
        assert done.status == "completed", done
        assert (done.request_counts.completed, done.request_counts.failed) == (LINES, 0)
        text = up.client.files.content(done.output_file_id).text
        output = [json.loads(line) for line in text.splitlines()]
        assert [o["custom_id"] for o in output] == [f"q{i}" for i in range(LINES)]
        for line in output:
            body = line["response"]["body"]
            assert line["response"]["status_code"] == 200
            assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"]
            assert 0 < body["usage"]["completion_tokens"] <= 24
        journal = _journaled(work, batch.id)
        indices = [r["index"] for r in journal]
        assert sorted(indices) == list(range(LINES))  # each line journaled once
        print(f"completed after the restart: {LINES - before} lines ran in the second run")
    finally:
        up.stop()
