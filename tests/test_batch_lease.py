"""Batch runners in several gateway replicas over one store and one Redis: each batch is run by
the replica holding its lease, every line computed once; a dead holder's batch is taken over
after the lease's TTL; a holder that lost its lease takes no new line; without Redis no runner
runs a line (a real redis-server, as in the limit tests)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as redis_asyncio

from servefleet.api.batches import Batch, BatchCreateRequest
from servefleet.api.gateway_config import GatewayConfig, RedisConfig
from servefleet.bench.processes import free_port
from servefleet.gateway.app import Gateway
from servefleet.gateway.batch_api import BatchApi
from servefleet.gateway.batch_demand import OpenWork
from servefleet.gateway.batch_lease import LocalLease, RedisBatchLease
from servefleet.gateway.batch_runner import BatchRunner, LineCaller
from servefleet.gateway.batch_store_folder import FolderBatchStore
from tests.support.redis_server import start_redis

Call = tuple[str, int]  # (runner, line number; unique across a test's batches)


def _client(port: int) -> Any:
    return redis_asyncio.Redis.from_url(
        f"redis://127.0.0.1:{port}/0", socket_timeout=0.5, socket_connect_timeout=0.5
    )


def _lease(port: int, ttl_s: float) -> RedisBatchLease:
    return RedisBatchLease(_client(port), ttl_s=ttl_s)


def _submit(store: FolderBatchStore, lines: int, first: int = 0) -> Batch:
    text = "".join(
        json.dumps(
            {
                "custom_id": f"req-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"model": "m", "messages": [{"role": "user", "content": str(first + i)}]},
            }
        )
        + "\n"
        for i in range(lines)
    ).encode()
    file = store.put_file("a", "in.jsonl", "batch", text)
    request = BatchCreateRequest(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    return BatchApi(store, BatchRunner(store, _never), 1 << 20).create("a", request)


async def _never(tenant: str, path: str, body: bytes) -> tuple[int, bytes, str]:
    raise AssertionError("the API's own runner is not started")


def _caller(
    name: str, calls: list[Call], before: Callable[[int], Awaitable[None]] | None = None
) -> LineCaller:
    """A LineCaller that records every line it computes (by runner)."""

    async def call(tenant: str, path: str, body: bytes) -> tuple[int, bytes, str]:
        index = int(json.loads(body)["messages"][0]["content"])
        calls.append((name, index))
        if before is not None:
            await before(index)
        return 200, json.dumps({"line": index}).encode(), f"r-{name}-{index}"

    return call


async def _until(check: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "not reached before the deadline"
        await asyncio.sleep(0.02)


def _outputs(store: FolderBatchStore) -> list[str]:
    return [f.filename for f in store.files("a") if f.purpose == "batch_output"]


async def _stop(*tasks: asyncio.Task[None]) -> None:
    for task in tasks:
        task.cancel()
    _, running = await asyncio.wait(tasks, timeout=20)
    assert not running, "a runner did not stop when cancelled"


async def test_two_runners_compute_every_line_once_and_finish_each_batch_once(
    tmp_path: Path, redis_port: int
) -> None:
    store = FolderBatchStore(tmp_path)
    batches = [_submit(store, 8, first) for first in (0, 8, 16)]
    calls: dict[str, list[Call]] = {"one": [], "two": []}
    published: dict[str, list[OpenWork]] = {}
    runners = [
        BatchRunner(
            store,
            _caller(name, calls[name]),
            concurrency=2,
            poll_s=0.05,
            lease=_lease(redis_port, ttl_s=1.0),
            on_work=lambda works, name=name: published.__setitem__(name, works),  # type: ignore[misc]
        )
        for name in calls
    ]
    tasks = [asyncio.create_task(r.run()) for r in runners]
    try:
        await _until(lambda: all(_status(store, b) == "completed" for b in batches))
        # Each replica's batch signal drops the batches, also those the other one finished.
        await _until(lambda: len(published) == 2 and not any(published.values()))
    finally:
        await _stop(*tasks)
    computed = Counter(number for found in calls.values() for _, number in found)
    # Each batch's 8 lines ran once, on whichever replica held that batch.
    assert computed == Counter(range(24))
    for batch in batches:
        done = store.batch("a", batch.id)
        assert done is not None and done.request_counts.completed == 8
    assert len(_outputs(store)) == 3  # one output file per batch: each finished once


def _status(store: FolderBatchStore, batch: Batch) -> str:
    current = store.batch("a", batch.id)
    return current.status if current is not None else "missing"


async def test_a_dead_holders_batch_is_taken_over_after_the_ttl(
    tmp_path: Path, redis_port: int
) -> None:
    store = FolderBatchStore(tmp_path)
    batch = _submit(store, 6)
    calls: list[Call] = []
    stuck: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    def hang_on_line_3(name: str) -> Callable[[int], Awaitable[None]]:
        async def before(index: int) -> None:
            if index == 3 and not stuck.done():
                stuck.set_result(name)
                await asyncio.Event().wait()  # in flight when this gateway dies

        return before

    tasks = {
        name: asyncio.create_task(
            BatchRunner(
                store,
                _caller(name, calls, hang_on_line_3(name)),
                concurrency=1,
                poll_s=0.05,
                lease=_lease(redis_port, ttl_s=0.5),
            ).run()
        )
        for name in ("one", "two")
    }
    holder = await asyncio.wait_for(stuck, 20)
    heir = "two" if holder == "one" else "one"
    await _stop(tasks[holder])  # dies: its lease is not released, only left to expire
    try:
        await _until(lambda: _status(store, batch) == "completed")
    finally:
        await _stop(tasks[heir])
    # Only the holder ran lines while it lived; the heir resumed after the journaled lines,
    # so only the line in flight at the death ran twice.
    assert [c for c in calls if c[0] == holder] == [(holder, i) for i in range(4)]
    assert [c for c in calls if c[0] == heir] == [(heir, i) for i in (3, 4, 5)]
    done = store.batch("a", batch.id)
    assert done is not None and done.request_counts.completed == 6
    assert len(_outputs(store)) == 1


async def test_a_runner_that_lost_its_lease_takes_no_new_line(
    tmp_path: Path, redis_port: int
) -> None:
    store = FolderBatchStore(tmp_path)
    batch = _submit(store, 6)
    calls: list[Call] = []
    in_flight, go_on = asyncio.Event(), asyncio.Event()
    renewals: list[bool] = []

    class Watched(RedisBatchLease):
        async def renew(self, batch_id: str) -> bool:
            ours = await super().renew(batch_id)
            renewals.append(ours)
            return ours

    async def hold_line_2(index: int) -> None:
        if index == 2:
            in_flight.set()
            await go_on.wait()

    lease = Watched(_client(redis_port), ttl_s=0.6)
    runner = BatchRunner(store, _caller("one", calls, hold_line_2), concurrency=1, lease=lease)
    advancing = asyncio.create_task(runner.advance(batch))
    await asyncio.wait_for(in_flight.wait(), 20)
    other = _client(redis_port)
    await other.set(lease.key(batch.id), "another-replica", px=60_000)  # taken over
    await _until(lambda: False in renewals)
    go_on.set()
    await asyncio.wait_for(advancing, 20)
    assert [index for _, index in calls] == [0, 1, 2]  # no line after the loss
    assert sorted(r["index"] for r in store.results(batch)) == [0, 1, 2]  # line 2 journaled
    current = store.batch("a", batch.id)
    assert current is not None and current.status == "in_progress"  # not finished here
    assert current.output_file_id is None
    assert await other.get(lease.key(batch.id)) == b"another-replica"  # not released by us
    await other.aclose()


async def test_without_redis_no_runner_runs_a_line_until_it_is_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="servefleet.gateway.batches")
    store = FolderBatchStore(tmp_path)
    batch = _submit(store, 3)
    calls: list[Call] = []
    port = free_port()  # nothing listens yet
    runner = BatchRunner(store, _caller("one", calls), poll_s=0.05, lease=_lease(port, ttl_s=0.5))
    task = asyncio.create_task(runner.run())
    try:
        await _until(lambda: runner.paused)
        await asyncio.sleep(0.3)  # a few more scans, all paused
        assert calls == []
        paused = [r for r in caplog.records if "batch_lease_unavailable" in r.getMessage()]
        assert len(paused) == 1  # logged once, not on every scan
        proc = start_redis(port)
        try:
            await _until(lambda: _status(store, batch) == "completed")
        finally:
            proc.terminate()
            proc.wait(timeout=10)
    finally:
        await _stop(task)
    assert sorted(index for _, index in calls) == [0, 1, 2]
    assert not runner.paused
    assert any("batch_lease_available" in r.getMessage() for r in caplog.records)


async def test_a_stopping_gateway_releases_its_leases_and_uses_redis_only_when_configured(
    tmp_path: Path, redis_port: int
) -> None:
    from servefleet.api.batches import BatchConfig

    batch_config = BatchConfig(store_dir=str(tmp_path))
    alone = Gateway(GatewayConfig(batch=batch_config))
    assert alone._batches is not None and isinstance(alone._batches.runner.lease, LocalLease)
    url = f"redis://127.0.0.1:{redis_port}/0"
    shared = Gateway(GatewayConfig(batch=batch_config, redis=RedisConfig(url=url)))
    assert shared._batches is not None
    lease = shared._batches.runner.lease
    assert isinstance(lease, RedisBatchLease)
    assert lease.key("batch_x") == "servefleet:limits:batch-lease:batch_x"

    async def hang(tenant: str, path: str, body: bytes) -> tuple[int, bytes, str]:
        await asyncio.Event().wait()  # in flight when the gateway stops
        raise AssertionError

    shared._batches.runner._call = hang
    await shared.start()
    batch = _submit(store := FolderBatchStore(tmp_path), 2)
    await _until(lambda: bool(shared._batches and shared._batches.runner._holds))
    other = _client(redis_port)
    assert await other.get(lease.key(batch.id)) == lease.owner.encode()
    await shared.stop()
    assert await other.get(lease.key(batch.id)) is None  # released, not left to expire
    assert _status(store, batch) == "in_progress"
    await other.aclose()
