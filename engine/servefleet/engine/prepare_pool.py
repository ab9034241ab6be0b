"""Request preparation off the event loop: a few threads, a bounded queue, a time budget.

Rendering the chat template, tokenizing and compiling a grammar cost time in proportion to
what a client sent, and the HTTP server's event loop must keep answering meanwhile (`/health`,
other tenants' streams). So a request with big inputs is prepared here:

- at most `workers` at once and `queue` more waiting; past that a 503 with Retry-After;
- each has `budget_s` from when it starts (not while it waits): a stage that ends past it, or
  a compile still running then (its child process is killed, `structured.compile_worker`),
  fails the request once with a 400 `request_too_complex` naming the field, logged with the
  request id. Nothing here retries it: the request, not the engine, is at fault.

Tokenizing releases the GIL (`Tokenizer.encode`) and so do xgrammar's calls; the template is
Python, but the caps (`servefleet.api.request_caps`, the context bound in `preparation`) keep
it to milliseconds per 100 KB. Small requests are prepared inline: a thread hop would cost
more than the work, and they never wait behind a big one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from servefleet.api.openai_errors import OpenAIError

log = logging.getLogger("servefleet.engine.prepare")

T = TypeVar("T")

PREPARE_WORKERS = 2
PREPARE_QUEUE = 16
# How much longer than its budget a stage that cannot be cut (a template, a tokenization) may
# keep the request waiting before it is answered anyway (its thread finishes in the back).
_GRACE_S = 2.0


class TooComplex(Exception):
    """Raised by preparation work that ran past its budget: the field and the stage."""

    def __init__(self, param: str, stage: str) -> None:
        super().__init__(f"{param}: {stage}")
        self.param = param
        self.stage = stage


class Budget:
    """When one request's preparation must be done. A wait that is not the request's doing
    (the grammar compiler's first start) pauses it."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds
        self._paused_at: float | None = None

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self._paused_at = started = time.monotonic()
        try:
            yield
        finally:
            self.deadline += time.monotonic() - started
            self._paused_at = None

    def remaining(self) -> float:
        now = self._paused_at if self._paused_at is not None else time.monotonic()
        return max(0.0, self.deadline - now)

    def check(self, param: str, stage: str) -> None:
        if self.remaining() <= 0:
            raise TooComplex(param, stage)


class Preparer:
    def __init__(
        self, budget_s: float, workers: int = PREPARE_WORKERS, queue: int = PREPARE_QUEUE
    ) -> None:
        self.budget_s = budget_s
        self.capacity = workers + queue
        self.pending = 0  # submitted and not finished (event-loop side only)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="prepare")

    async def run(
        self, work: Callable[[Budget], T], *, request_id: str, param: str, inline: bool = False
    ) -> T:
        """work(budget), inline or on a worker thread; TooComplex becomes the 400."""
        try:
            if inline:
                return work(Budget(self.budget_s))
            return await self._on_worker(work, param)
        except TooComplex as exc:
            raise self._too_complex(request_id, exc.param, exc.stage) from None

    async def _on_worker(self, work: Callable[[Budget], T], param: str) -> T:
        if self.pending >= self.capacity:
            raise OpenAIError(
                status=503,
                message="the engine is busy preparing other large requests; retry later",
                type="service_unavailable",
                code="prepare_queue_full",
                headers={"Retry-After": "2"},
            )
        loop = asyncio.get_running_loop()
        started: asyncio.Future[Budget | None] = loop.create_future()

        def job() -> T:
            budget = Budget(self.budget_s)  # from now: the queue's wait is not the request's
            loop.call_soon_threadsafe(_settle, started, budget)
            return work(budget)

        def finished(done: Future[T]) -> None:
            self.pending -= 1
            _settle(started, None)  # also when it never ran (the pool shut down)

        self.pending += 1
        future = self._pool.submit(job)
        future.add_done_callback(lambda f: _call_soon(loop, finished, f))
        result = asyncio.wrap_future(future)
        result.add_done_callback(_retrieve)  # a late failure is not "never retrieved"
        budget = await asyncio.shield(started)
        while budget is not None and not result.done():
            await asyncio.wait({result}, timeout=budget.remaining() + _GRACE_S)
            if not result.done() and budget.remaining() <= 0:
                raise TooComplex(param, "preparation")  # its thread finishes in the back
        return await result

    def _too_complex(self, request_id: str, param: str, stage: str) -> OpenAIError:
        log.warning(
            "request_too_complex: request_id=%s param=%s stage=%s budget_s=%.1f",
            request_id,
            param,
            stage,
            self.budget_s,
        )
        return OpenAIError(
            status=400,
            message=f"{param}: this request needs more than {self.budget_s:g} s to prepare "
            f"({stage}); send a smaller or simpler one",
            param=param,
            code="request_too_complex",
        )

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _settle(future: asyncio.Future[Budget | None], budget: Budget | None) -> None:
    if not future.done():
        future.set_result(budget)


def _retrieve(future: asyncio.Future[T]) -> None:
    if not future.cancelled():
        future.exception()


def _call_soon(
    loop: asyncio.AbstractEventLoop, fn: Callable[[Future[T]], None], arg: Future[T]
) -> None:
    with contextlib.suppress(RuntimeError):  # the loop closed meanwhile (shutdown)
        loop.call_soon_threadsafe(fn, arg)
