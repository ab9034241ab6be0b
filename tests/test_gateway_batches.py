"""The Batch API through a real gateway (fake replicas behind it), driven by the official
`openai` client: upload, create, run as the batch class, output in input order, tenant
isolation, bad files, cancel, and a restart that resumes after the journaled lines."""

from __future__ import annotations

import asyncio
import io
import json
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from servefleet.api.batches import BatchConfig
from servefleet.api.gateway_config import (
    ApiKeyRef,
    GatewayConfig,
    GatewayDeployment,
    GatewayTenant,
    TenantAccess,
    hash_api_key,
)
from servefleet.bench.fake_upstream import FakeBehaviour, FakeOpenAI
from servefleet.bench.processes import serve_in_thread
from servefleet.gateway.app import Gateway
from servefleet.gateway.batch_runner import BatchRunner, is_not_now
from servefleet.gateway.batch_store_folder import FolderBatchStore

MODEL = "m"


class Rig:
    def __init__(self, gateway: Gateway, base: str, fake: FakeOpenAI, store: Path) -> None:
        self.gateway, self.base, self.fake, self.store = gateway, base, fake, store

    def client(self, tenant: str = "a") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base + "/v1", api_key=f"key-{tenant}", max_retries=0)


def _config(store: Path | None) -> GatewayConfig:
    tenants = [
        GatewayTenant(name=t, api_keys=[ApiKeyRef(sha256=hash_api_key(f"key-{t}"))])
        for t in ("a", "b")
    ]
    access = [TenantAccess(name="a"), TenantAccess(name="b")]
    deployment = GatewayDeployment(name="d", model=MODEL, tenants=access)
    batch = BatchConfig(store_dir=str(store), retry_seconds=0.2) if store else None
    return GatewayConfig(tenants=tenants, deployments=[deployment], batch=batch)


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    with ExitStack() as stack:
        fake = FakeOpenAI(FakeBehaviour(completion_tokens=3))
        url = stack.enter_context(serve_in_thread(fake))
        gateway = Gateway(_config(tmp_path / "batches"))
        gateway.set_replicas("d", [url], ready=[url])
        yield Rig(gateway, stack.enter_context(serve_in_thread(gateway)), fake, tmp_path)


def _lines(count: int, url: str = "/v1/chat/completions", **extra: Any) -> bytes:
    rows = []
    for i in range(count):
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"line {i}"}]}
        rows.append({"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body} | extra)
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


def _submit(client: openai.OpenAI, data: bytes) -> Any:
    file = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    return client.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )


def _wait(client: openai.OpenAI, batch_id: str, statuses: set[str], timeout: float = 30) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        time.sleep(0.1)
    raise AssertionError(f"batch {batch_id} still {batch.status}")


def test_a_batch_runs_every_line_once_and_writes_the_output_in_input_order(rig: Rig) -> None:
    client = rig.client()
    batch = _submit(client, _lines(12))
    assert batch.status == "in_progress" and batch.request_counts.total == 12
    done = _wait(client, batch.id, {"completed"})
    assert done.request_counts.completed == 12 and done.request_counts.failed == 0
    assert done.error_file_id is None and done.completed_at >= done.created_at
    output = [
        json.loads(line) for line in client.files.content(done.output_file_id).text.splitlines()
    ]
    assert [o["custom_id"] for o in output] == [f"req-{i}" for i in range(12)]
    assert all(o["response"]["status_code"] == 200 for o in output)
    assert all(o["response"]["body"]["object"] == "chat.completion" for o in output)
    prompts = [r["messages"][0]["content"] for r in rig.fake.stats.requests]
    assert sorted(prompts) == sorted(f"line {i}" for i in range(12))  # each line once
    # The lines ran as the batch class: the engine was told so (the scheduler's priority).
    interactive = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "now"}]
    )
    assert interactive.choices[0].message.content
    priorities = {r.get("priority") for r in rig.fake.stats.requests[:12]}
    assert priorities != {rig.fake.stats.requests[-1].get("priority")}, priorities
    listed = client.batches.list()
    assert [b.id for b in listed.data] == [batch.id]


def test_failed_lines_go_to_the_error_file(rig: Rig) -> None:
    client = rig.client()
    data = (
        _lines(2)
        + json.dumps(
            {
                "custom_id": "unknown-model",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"model": "nope", "messages": [{"role": "user", "content": "x"}]},
            }
        ).encode()
    )
    done = _wait(client, _submit(client, data).id, {"completed"})
    assert (done.request_counts.completed, done.request_counts.failed) == (2, 1)
    errors = [json.loads(x) for x in client.files.content(done.error_file_id).text.split("\n") if x]
    assert [e["custom_id"] for e in errors] == ["unknown-model"]
    assert errors[0]["response"]["status_code"] == 404


@pytest.mark.parametrize(
    ("data", "code", "line"),
    [
        (b"not json\n", "invalid_request", 1),
        (_lines(1) + _lines(1), "duplicate_custom_id", 2),
        (_lines(1, url="/v1/completions"), "mismatched_endpoint", 1),
        (_lines(1, body={"model": MODEL, "prompt": "x", "stream": True}), "invalid_request", 1),
        (_lines(1, extra_field=1), "invalid_request", 1),
        (b"\n\n", "empty_file", None),
    ],
    ids=["json", "duplicate", "endpoint", "stream", "unknown-field", "empty"],
)
def test_a_bad_input_file_fails_the_batch_naming_the_line(
    rig: Rig, data: bytes, code: str, line: int | None
) -> None:
    batch = _submit(rig.client(), data)
    assert batch.status == "failed" and batch.failed_at is not None
    assert batch.errors is not None
    assert (batch.errors.data[0].code, batch.errors.data[0].line) == (code, line)
    assert rig.fake.stats.requests == []


def test_tenants_see_only_their_own_files_and_batches(rig: Rig) -> None:
    mine, theirs = rig.client("a"), rig.client("b")
    file = mine.files.create(file=("in.jsonl", io.BytesIO(_lines(1))), purpose="batch")
    batch = mine.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    for call in (
        lambda: theirs.files.retrieve(file.id),
        lambda: theirs.files.content(file.id),
        lambda: theirs.files.delete(file.id),
        lambda: theirs.batches.retrieve(batch.id),
        lambda: theirs.batches.cancel(batch.id),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    with pytest.raises(openai.BadRequestError, match="input_file_id"):
        theirs.batches.create(
            input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
    assert theirs.files.list().data == [] and theirs.batches.list().data == []
    assert [f.id for f in mine.files.list(purpose="batch").data] == [file.id]
    with pytest.raises(openai.AuthenticationError):
        rig.client("nobody").files.list()
    _wait(mine, batch.id, {"completed"})


def test_bad_requests_are_refused_naming_the_field(rig: Rig) -> None:
    key = {"authorization": "Bearer key-a"}
    with httpx.Client(base_url=rig.base, headers=key) as http:
        upload = {"file": ("in.jsonl", _lines(1))}
        wrong = http.post("/v1/files", files=upload, data={"purpose": "fine-tune"})
        assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "purpose"
        extra = http.post("/v1/files", files=upload, data={"purpose": "batch", "x": "1"})
        assert extra.status_code == 400 and extra.json()["error"]["param"] == "x"
        no_file = http.post("/v1/files", data={"purpose": "batch"})
        assert no_file.status_code == 400  # not multipart: refused, named
        file_id = http.post("/v1/files", files=upload, data={"purpose": "batch"}).json()["id"]
        body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions"}
        for field, value in (("completion_window", "1h"), ("endpoint", "/v1/responses")):
            sent = body | {"completion_window": "24h"} | {field: value}
            answer = http.post("/v1/batches", json=sent)
            assert answer.status_code == 400 and answer.json()["error"]["param"] == field
        unknown = http.post("/v1/batches", json=body | {"completion_window": "24h", "z": 1})
        assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "z"
        assert http.get("/v1/batches?limit=0").json()["error"]["param"] == "limit"
        assert http.get("/v1/batches?cursor=1").json()["error"]["param"] == "cursor"
        assert http.get("/v1/files/../../etc").status_code == 404
        assert http.put("/v1/batches").status_code == 405


def test_a_cancelled_batch_stops_and_keeps_its_partial_output(rig: Rig) -> None:
    rig.fake.behaviour.token_delay_s = 0.2  # ~0.6 s a line, one at a time
    rig.gateway._batches.runner._concurrency = 1  # type: ignore[union-attr]
    rig.gateway._batches.runner._batch_slots = None  # type: ignore[union-attr]
    client = rig.client()
    batch = _submit(client, _lines(30))
    deadline = time.monotonic() + 20
    while not rig.fake.stats.requests and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)
    with pytest.raises(openai.ConflictError):  # the runner still reads it
        client.files.delete(batch.input_file_id)
    assert client.batches.cancel(batch.id).status == "cancelling"
    done = _wait(client, batch.id, {"cancelled"})
    assert 0 < done.request_counts.completed < 30
    assert done.cancelled_at is not None
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)


def test_a_restarted_runner_resumes_after_the_journaled_lines(tmp_path: Path) -> None:
    """The journal is the truth: a new runner (a restarted gateway) runs only what it lacks."""
    store = FolderBatchStore(tmp_path)
    from servefleet.api.batches import BatchCreateRequest
    from servefleet.gateway.batch_api import BatchApi

    calls: list[str] = []

    async def call(tenant: str, path: str, body: bytes) -> tuple[int, bytes, str]:
        content = json.loads(body)["messages"][0]["content"]
        calls.append(content)
        if content == "line 2" and calls.count("line 2") == 1:
            return 503, b'{"error": {"code": "overloaded", "message": "later"}}', "r"
        return 200, json.dumps({"echo": content}).encode(), "r"

    async def scenario() -> Any:
        first = BatchRunner(store, call, concurrency=1, retry_s=0.01)
        api = BatchApi(store, first, 1 << 20)
        file = store.put_file("a", "in.jsonl", "batch", _lines(5))
        request = BatchCreateRequest(
            input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        batch = api.create("a", request)
        # Two lines journaled, as if the gateway then died.
        for index in (0, 1):
            store.append_result(batch, {"index": index, "status": 200, "request_id": "r",
                                        "body": {"echo": f"line {index}"},
                                        "custom_id": f"req-{index}"})  # fmt: skip
        with (tmp_path / "tenants/a/batches" / f"{batch.id}.jsonl").open("ab") as journal:
            journal.write(b'{"index": 2, "sta')  # torn by the crash
        await BatchRunner(store, call, concurrency=1, retry_s=0.01).advance(batch)
        return store.batch("a", batch.id)

    done = asyncio.run(scenario())
    assert done.status == "completed" and done.request_counts.completed == 5
    assert sorted(set(calls)) == ["line 2", "line 3", "line 4"]  # 0 and 1 were journaled
    assert calls.count("line 2") == 2  # turned away once for now, then answered
    output = store.file_content("a", done.output_file_id).decode().split("\n")  # type: ignore[arg-type,union-attr]
    assert [json.loads(x)["custom_id"] for x in output if x] == [f"req-{i}" for i in range(5)]


def test_the_api_is_not_found_where_it_is_not_enabled() -> None:
    with ExitStack() as stack:
        base = stack.enter_context(serve_in_thread(Gateway(_config(None))))
        answer = httpx.get(base + "/v1/batches", headers={"authorization": "Bearer key-a"})
        assert answer.status_code == 404 and "not enabled" in answer.json()["error"]["message"]


@pytest.mark.parametrize(
    ("status", "code", "again"),
    [
        (429, "rate_limit_exceeded", True),
        (503, "overloaded", True),
        (503, "budget_unavailable", True),
        (502, "upstream_unreachable", True),  # the replica stopped before it answered
        (503, "insufficient_quota", False),
        (502, "upstream_error", False),  # the replica answered with an error: final
        (400, "invalid_request_error", False),
        (404, "model_not_found", False),
    ],
)
def test_which_answers_send_a_line_back_to_wait(status: int, code: str, again: bool) -> None:
    body = json.dumps({"error": {"message": "m", "type": "t", "param": None, "code": code}})
    assert is_not_now(status, body.encode()) is again


def test_an_upload_over_the_cap_is_a_413_naming_the_file_and_stores_nothing(
    tmp_path: Path,
) -> None:
    """A tenant cannot fill the store with one upload: past `batch.max_file_bytes` the
    upload is refused while it streams in, and nothing of it is listed or left behind."""
    config = _config(tmp_path / "batches")
    assert config.batch is not None
    config = config.model_copy(
        update={"batch": config.batch.model_copy(update={"max_file_bytes": 4096})}
    )
    with serve_in_thread(Gateway(config)) as base:
        key = {"authorization": "Bearer key-a"}
        with httpx.Client(base_url=base, headers=key) as http:
            small = http.post(
                "/v1/files", files={"file": ("ok.jsonl", _lines(2))}, data={"purpose": "batch"}
            )
            assert small.status_code == 200, small.text
            big = {"file": ("big.jsonl", _lines(200))}
            assert len(_lines(200)) > 4096
            refused = http.post("/v1/files", files=big, data={"purpose": "batch"})
            assert refused.status_code == 413 and refused.json()["error"]["param"] == "file"
            listed = http.get("/v1/files").json()["data"]
            assert [f["filename"] for f in listed] == ["ok.jsonl"]
    stored = [p for p in (tmp_path / "batches").rglob("*") if p.is_file()]
    assert not any(b"line 199" in p.read_bytes() for p in stored)


def test_the_runner_marks_the_batch_it_runs_in_its_demand(tmp_path: Path) -> None:
    """Its counts are current (it journals each line), so the autoscaler prefers them over
    other replicas' views of the same batch (`servefleet.api.batch_demand`)."""
    from servefleet.api.batches import BatchCreateRequest
    from servefleet.gateway.batch_api import BatchApi
    from servefleet.gateway.batch_demand import OpenWork

    store = FolderBatchStore(tmp_path)
    published: list[list[OpenWork]] = []
    running_seen: list[bool] = []

    async def call(tenant: str, path: str, body: bytes) -> tuple[int, bytes, str]:
        running_seen.append(all(w.running for w in published[-1]))
        return 200, b'{"ok": true}', "r"

    async def scenario() -> None:
        runner = BatchRunner(store, call, concurrency=1, on_work=published.append)
        api = BatchApi(store, runner, 1 << 20)
        file = store.put_file("a", "in.jsonl", "batch", _lines(3))
        request = BatchCreateRequest(
            input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        await runner.advance(api.create("a", request))

    asyncio.run(scenario())
    assert running_seen == [True, True, True]
    assert not any(w.running for w in published[-1])  # let go once it finished
