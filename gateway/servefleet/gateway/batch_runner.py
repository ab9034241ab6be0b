"""Runs accepted batches: each line through the gateway's own admission as the `batch`
traffic class, so batch work takes only what interactive traffic leaves (the pool serves
interactive requests first and sheds batch ones first).

A line the pool or the limits turn away for now (429 rate limit, 503 overloaded or limits
unavailable, 502 a replica that could not be reached, e.g. one stopping) is not an answer: it
is tried again after `retry_s`, so a batch waits for spare capacity instead of failing.
Every other answer is final and journaled (`BatchStore`) before the next line is counted, so
a gateway restarted mid-batch resumes after the lines it has journaled. A line in flight when
the gateway dies runs again after the restart: a line is journaled, and so charged in the
report, once, but the engine may have computed it twice.
At the end (every line answered, the batch cancelled, or its window past) the output and error
files are written from the journal in input order and the batch is closed. Batches run earliest
deadline first; what each still has to answer, per model, is published (`on_work`) for the
autoscaler's batch signal (`batch_demand`).

Several gateway replicas over one store run each batch once: a runner runs a batch only while
it holds the batch's lease (`batch_lease`), and takes no new line of it once the lease is
lost. While Redis cannot say who holds what, no batch runs here (paused, logged once).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Collection
from dataclasses import replace
from typing import Any

from servefleet.api.batches import TERMINAL, Batch, BatchLine, output_line, parse_lines
from servefleet.gateway.batch_demand import OpenWork
from servefleet.gateway.batch_lease import (
    BatchLease,
    Holding,
    LeaseUnavailable,
    LocalLease,
    holding,
)
from servefleet.gateway.batch_store import BatchStore, StoreUnavailable

log = logging.getLogger("servefleet.gateway.batches")

# (tenant, path, body) -> (status, response body, request id)
LineCaller = Callable[[str, str, bytes], Awaitable[tuple[int, bytes, str]]]
# 502 upstream_unreachable: the replica went away (stopped, drained, died) before answering;
# the line itself is fine, and another replica, or this one back, answers it.
NOT_NOW_CODES = frozenset(
    {"rate_limit_exceeded", "overloaded", "budget_unavailable", "upstream_unreachable"}
)


def is_not_now(status: int, body: bytes) -> bool:
    """A refusal that says "later", not "no": the line is tried again."""
    if status not in (429, 502, 503):
        return False
    try:
        code = json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return status == 503
    return code in NOT_NOW_CODES or (status == 503 and code != "insufficient_quota")


class BatchRunner:
    """One task for every open batch of the store, earliest deadline first."""

    def __init__(
        self,
        store: BatchStore,
        call: LineCaller,
        *,
        concurrency: int = 4,
        retry_s: float = 2.0,
        poll_s: float = 1.0,
        clock: Callable[[], float] = time.time,
        on_work: Callable[[list[OpenWork]], None] | None = None,
        batch_slots: Callable[[], int] | None = None,
        lease: BatchLease | None = None,
    ) -> None:
        self.store = store
        self._call = call
        self._concurrency = concurrency
        self._retry_s = retry_s
        self._poll_s = poll_s
        self._clock = clock
        self._wake = asyncio.Event()
        self._on_work = on_work
        self._batch_slots = batch_slots  # slots the pools now leave batch requests, in all
        self._work: dict[str, OpenWork] = {}  # open batch id -> its lines left, per model
        self.lease: BatchLease = lease if lease is not None else LocalLease()
        self._holds: dict[str, Holding] = {}  # batch id -> the lease this runner holds on it
        self.paused = False  # Redis cannot say who runs which batch: none runs here

    def wake(self) -> None:
        """A batch was created or cancelled: look now, not at the next poll."""
        self._wake.set()

    def note(self, batch: Batch, lines: list[BatchLine], done: Collection[int] = ()) -> None:
        """What `batch` still has to answer, per model, from now on."""
        left = Counter(_model(line) for i, line in enumerate(lines) if i not in done)
        self._work[batch.id] = OpenWork(batch.id, batch.tenant, float(batch.expires_at), left)
        self._publish()

    def _publish(self) -> None:
        """Every open batch this replica knows, those it runs marked (their counts are
        current: the autoscaler prefers them over other replicas' older views)."""
        if self._on_work is not None:
            self._on_work(
                [replace(w, running=batch_id in self._holds) for batch_id, w in self._work.items()]
            )

    async def _note_unseen(self, batches: list[Batch]) -> None:
        """Open batches not noted yet (after a restart): read once, for the batch signal; and
        batches no longer open (another replica finished them) out of it."""
        listed = {batch.id for batch in batches}
        closed = [batch_id for batch_id in self._work if batch_id not in listed]
        for batch_id in closed:
            del self._work[batch_id]
        if closed:
            self._publish()
        for batch in batches:
            if batch.id not in self._work:
                lines, done = await self._pending(batch)
                self.note(batch, lines, done)

    async def _pending(self, batch: Batch) -> tuple[list[BatchLine], set[int]]:
        data = await asyncio.to_thread(self.store.file_content, batch.tenant, batch.input_file_id)
        lines, _ = parse_lines(data or b"", batch.endpoint)
        done = {r["index"] for r in await asyncio.to_thread(self.store.results, batch)}
        return lines, done

    async def run(self) -> None:
        while True:
            try:
                batches = await asyncio.to_thread(self.store.open_batches)
                batches.sort(key=lambda b: (b.expires_at, b.created_at))  # earliest deadline first
                await self._note_unseen(batches)
            except StoreUnavailable as exc:  # tried again on the next poll
                log.warning("batch_store_unavailable error=%s", exc)
                batches = []
            for batch in batches:
                try:
                    await self.advance(batch)
                except LeaseUnavailable as exc:
                    self._pause(exc)
                    break  # every batch waits for Redis: another replica may run it
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("batch_failed_to_advance id=%s", batch.id)
            # A cancel some library swallowed (a Redis call cut by the gateway stopping)
            # still stops the loop; and not wait_for: on 3.11 it can swallow one itself.
            if (task := asyncio.current_task()) is not None and task.cancelling():
                raise asyncio.CancelledError
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._poll_s):
                    await self._wake.wait()
            self._wake.clear()

    def _pause(self, exc: Exception) -> None:
        if not self.paused:
            log.warning(
                "batch_lease_unavailable error=%s: batches paused until Redis answers "
                "(another gateway replica might run them too)",
                exc,
            )
        self.paused = True

    async def advance(self, batch: Batch) -> None:
        """Run what is left of `batch` until it is answered, cancelled or expired, while this
        runner holds its lease; nothing when another replica holds it. Raises
        `LeaseUnavailable` when Redis cannot say."""
        async with holding(self.lease, batch.id) as hold:
            if self.paused:
                log.info("batch_lease_available: batches run again")
                self.paused = False
            if hold is None:
                return  # another replica runs it
            self._holds[batch.id] = hold  # cancelled: kept for `release_leases`
            self._publish()
            try:
                await self._advance_held(batch, hold)
            except Exception:
                self._let_go(batch.id)
                raise
            self._let_go(batch.id)

    def _let_go(self, batch_id: str) -> None:
        del self._holds[batch_id]
        self._publish()

    async def release_leases(self) -> None:
        """Give back the leases of batches left mid-run (a graceful stop: after the runner's
        task is cancelled), so another replica need not wait for them to expire."""
        holds, self._holds = self._holds, {}
        for hold in holds.values():
            with contextlib.suppress(LeaseUnavailable):
                await self.lease.release(hold.batch_id)

    async def _advance_held(self, batch: Batch, hold: Holding) -> None:
        current = await asyncio.to_thread(self.store.batch, batch.tenant, batch.id)
        if current is None or current.status in TERMINAL:
            return  # finished by the replica that held it before (our list was older)
        if await asyncio.to_thread(self._stopped, batch):
            await self._finish_held(batch, hold)
            return
        lines, done = await self._pending(batch)
        self.note(batch, lines, done)
        pending = deque((i, line) for i, line in enumerate(lines) if i not in done)

        async def worker() -> None:  # workers share one queue: each line is taken once
            while pending and hold.held:  # a lost lease: no new line, this one finishes
                index, line = pending.popleft()
                await self._run_line(batch, index, line, hold)

        tasks: list[asyncio.Task[None]] = []
        try:
            while True:
                # As many lines in flight as the pool has batch slots (replicas bought for
                # a deadline count at once); lines beyond them would only queue.
                while pending and hold.held and len(tasks) < self._lines_at_once():
                    tasks.append(asyncio.create_task(worker()))
                if not tasks:
                    break
                finished, running = await asyncio.wait(tasks, timeout=self._poll_s)
                for task in finished:
                    task.result()
                tasks = list(running)
                stopped = await asyncio.to_thread(self._stopped, batch)
                if tasks and stopped:
                    break
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        await self._finish_held(batch, hold)

    async def _finish_held(self, batch: Batch, hold: Holding) -> None:
        """Finish `batch` only while the lease is ours for a TTL more (renewed now), so two
        replicas never both write its output."""
        if await hold.confirm():
            await self.finish(batch)

    def _lines_at_once(self) -> int:
        slots = self._batch_slots() if self._batch_slots is not None else 0
        return max(self._concurrency, slots)

    def _stopped(self, batch: Batch) -> bool:
        current = self.store.batch(batch.tenant, batch.id)
        cancelled = current is not None and current.status == "cancelling"
        return cancelled or self._clock() >= batch.expires_at

    async def _run_line(self, batch: Batch, index: int, line: BatchLine, hold: Holding) -> None:
        body = json.dumps(line.body).encode()
        while True:
            status, answer, request_id = await self._call(batch.tenant, line.url, body)
            if not is_not_now(status, answer):
                break
            await asyncio.sleep(self._retry_s)
            if not hold.held:
                return  # not answered: the lease's new holder runs it
        try:
            parsed: Any = json.loads(answer)
        except ValueError:
            parsed = answer.decode(errors="replace")
        record = {"index": index, "status": status, "request_id": request_id, "body": parsed}
        record["custom_id"] = line.custom_id
        await asyncio.to_thread(self.store.append_result, batch, record)
        if (work := self._work.get(batch.id)) is not None:
            work.left[_model(line)] -= 1
            self._publish()

    async def finish(self, batch: Batch) -> None:
        """Write the output and error files from the journal and close the batch."""
        current = await asyncio.to_thread(self.store.batch, batch.tenant, batch.id) or batch
        now = int(self._clock())
        results = sorted(await asyncio.to_thread(self.store.results, current), key=_index)
        answered_all = len(results) >= current.request_counts.total
        if not answered_all and current.status != "cancelling" and now < current.expires_at:
            return  # a line failed to run: the next round tries again
        ok = [r for r in results if 200 <= r["status"] < 300]
        failed = [r for r in results if not 200 <= r["status"] < 300]
        current.finalizing_at = current.finalizing_at or now
        current.output_file_id = await self._write(current, ok, "output")
        current.error_file_id = await self._write(current, failed, "errors")
        current.request_counts.completed = len(ok)
        current.request_counts.failed = len(failed)
        if current.status == "cancelling":
            current.status, current.cancelled_at = "cancelled", now
        elif not answered_all:
            current.status, current.expired_at = "expired", now
        else:
            current.status, current.completed_at = "completed", now
        await asyncio.to_thread(self.store.save_batch, current)
        if self._work.pop(current.id, None) is not None:
            self._publish()
        log.info(
            "batch_%s id=%s tenant=%s completed=%d failed=%d",
            current.status,
            current.id,
            current.tenant,
            len(ok),
            len(failed),
        )

    async def _write(self, batch: Batch, records: list[dict[str, Any]], kind: str) -> str | None:
        if not records:
            return None
        text = b"".join(
            json.dumps(
                output_line(
                    "batch_req_" + secrets.token_hex(8),
                    r["custom_id"],
                    r["status"],
                    r["request_id"],
                    r["body"],
                )
            ).encode()
            + b"\n"
            for r in records
        )
        name = f"{batch.id}_{kind}.jsonl"
        file = await asyncio.to_thread(
            self.store.put_file, batch.tenant, name, "batch_output", text
        )
        return file.id


def _model(line: BatchLine) -> str:
    model = line.body.get("model")
    return model if isinstance(model, str) else ""


def _index(record: dict[str, Any]) -> int:
    return int(record["index"])
