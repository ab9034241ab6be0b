"""The engine thread: take requests, `schedule → run → update`, stream results back.

The HTTP server never waits on the model: requests and aborts reach this thread
through a queue, and each step's outputs go back to the asyncio loop in one
thread-safe callback. The thread also keeps the heartbeat `/health` reads.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from servefleet.api.chargeback import UNATTRIBUTED
from servefleet.api.ewma import Ewma
from servefleet.api.seeds import new_seed
from servefleet.engine.kv_events import KVEventLog, KVEventSink
from servefleet.engine.lora.adapter import LoraAdapter
from servefleet.engine.lora.usage import AdapterUsage
from servefleet.engine.metrics import EngineMetrics
from servefleet.engine.output_processor import OutputProcessor
from servefleet.engine.parallel.group import GroupLostError
from servefleet.engine.runner import ModelRunner
from servefleet.engine.sampler import TokenLogprobs
from servefleet.engine.sampling_params import SamplingParams
from servefleet.engine.scheduler import Scheduler
from servefleet.engine.sequence import FinishReason, Sequence
from servefleet.engine.step_cost import StepCostModel
from servefleet.text.tokenizer import Tokenizer

log = logging.getLogger("servefleet.engine")
PROMPT_RATE_TOKENS = 64  # a step this large is mostly prompt: its rate is the prefill rate


class EngineDeadError(RuntimeError):
    """The engine loop stopped; in-flight requests cannot complete."""


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    n: int = 1
    arrival_time: float = field(default_factory=time.monotonic)
    resume_token_ids: list[int] = field(default_factory=list)  # already delivered (n == 1)
    lora: LoraAdapter | None = None  # the adapter it asked for (held by the caller)
    tenant: str = UNATTRIBUTED  # who its steps are billed to (`servefleet.api.chargeback`)
    cache_salt: str | None = None  # whose prefixes it may share (`servefleet.api.cache_salt`)


@dataclass
class SequenceOutput:
    """What one step produced for one choice of a request."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0


class _EngineCall:
    """A function to run on the engine thread between steps (it owns the model)."""

    def __init__(self, fn: Callable[[], Any], loop: asyncio.AbstractEventLoop) -> None:
        self.fn = fn
        self.loop = loop
        self.future: asyncio.Future[Any] = loop.create_future()

    def run(self) -> None:
        try:
            result = self.fn()
        except Exception as exc:  # handed to the caller
            self.loop.call_soon_threadsafe(_settle, self.future, None, exc)
        else:
            self.loop.call_soon_threadsafe(_settle, self.future, result, None)


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class _RequestSink:
    """Where a request's outputs land on the asyncio side."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[list[SequenceOutput] | BaseException] = asyncio.Queue()


@dataclass
class _Tracked:
    seq: Sequence
    index: int
    sink: _RequestSink
    processor: OutputProcessor
    last_token_time: float | None = None


class Engine:
    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        tokenizer: Tokenizer,
        metrics: EngineMetrics,
        stall_timeout: float = 120.0,
        step_cost: StepCostModel | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.stall_timeout = stall_timeout
        # New requests arrive as (request, sink); aborts as the request id.
        self._inbox: queue.SimpleQueue[tuple[EngineRequest, _RequestSink] | str | _EngineCall] = (
            queue.SimpleQueue()
        )
        self._wakeup = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._tracked: dict[int, _Tracked] = {}  # seq_id -> state, engine thread only
        self._by_request: dict[str, list[Sequence]] = {}  # engine thread only
        self.adapter_usage = AdapterUsage()  # what the adapter registry must not evict
        self.heartbeat = time.monotonic()
        self.in_step_since: float | None = None
        self.fatal_error: BaseException | None = None
        self.num_in_flight = 0  # requests submitted and not yet finished (asyncio side)
        self.num_in_flight_seqs = 0  # their sequences (n per request)
        self.prompt_rate = Ewma(0.0)  # tokens/s of steps of PROMPT_RATE_TOKENS+ (kv_puller)
        self.step_time = Ewma(0.0)  # seconds a step takes: how long an Engine.call may wait
        # What each kind of row costs, from every step (the scheduler's chunk budget reads it).
        self.step_cost = step_cost or StepCostModel()
        metrics.export_step_cost(self.step_cost, scheduler.chunk_budget)
        # KV cache events: the pool records, the loop publishes only what has been written.
        self.kv_events = KVEventLog()
        self._kv_sink = KVEventSink()
        scheduler.kv_cache.pool.events = self._kv_sink
        metrics.num_requests_waiting.set_function(lambda: len(self.scheduler.waiting))
        metrics.num_requests_running.set_function(lambda: len(self.scheduler.running))
        metrics.kv_cache_usage.set_function(lambda: self.scheduler.kv_cache.usage)
        metrics.kv_blocks_total.set_function(lambda: self.scheduler.kv_cache.num_blocks)

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        """Run the loop on a thread of its own (tests, embedding)."""
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def run(self) -> None:
        """Run the loop on the calling thread until request_stop().

        The server process runs it on its main thread: the C kernels' OpenMP teams run
        measurably slower when started from a secondary thread (~10 ms of a 60 ms step).
        """
        self._thread = threading.current_thread()
        self._run()

    def request_stop(self) -> None:
        self._stop.set()
        self._wakeup.set()

    def stop(self, timeout: float = 10.0) -> None:
        self.request_stop()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def is_healthy(self) -> tuple[bool, str]:
        if self.fatal_error is not None:
            return False, f"engine loop died: {self.fatal_error!r}"
        if self._thread is None or not self._thread.is_alive():
            return False, "engine loop is not running"
        now = time.monotonic()
        if self.in_step_since is not None and now - self.in_step_since > self.stall_timeout:
            return False, f"engine step stalled for {now - self.in_step_since:.0f}s"
        if now - self.heartbeat > self.stall_timeout:
            return False, f"no engine heartbeat for {now - self.heartbeat:.0f}s"
        return True, "ok"

    @property
    def num_waiting(self) -> int:
        """Sequences accepted but not yet running, including those not yet seen by the loop
        (a request with n choices adds n: the queue bound counts what the scheduler holds)."""
        running = len(self.scheduler.running)
        return max(len(self.scheduler.waiting), self.num_in_flight_seqs - running)

    # ---- asyncio side -----------------------------------------------------------------------
    def generate(self, request: EngineRequest) -> AsyncIterator[list[SequenceOutput]]:
        """Queue the request now (so admission sees it at once); iterate for its outputs.

        Each item holds one step's outputs for this request; iteration ends when all its
        choices finish. Closing the iterator early aborts the request.
        """
        if self.fatal_error is not None:
            raise EngineDeadError(str(self.fatal_error))
        sink = _RequestSink(asyncio.get_running_loop())
        self.num_in_flight += 1
        self.num_in_flight_seqs += request.n
        self._inbox.put((request, sink))
        self._wakeup.set()
        return self._outputs(request, sink)

    async def _outputs(
        self, request: EngineRequest, sink: _RequestSink
    ) -> AsyncIterator[list[SequenceOutput]]:
        remaining = request.n
        try:
            while remaining:
                item = await sink.queue.get()
                if isinstance(item, BaseException):
                    raise item
                remaining -= sum(1 for o in item if o.finished)
                yield item
        finally:
            self.num_in_flight -= 1
            self.num_in_flight_seqs -= request.n
            if remaining:
                self.abort(request.request_id)

    async def call(self, fn: Callable[[], Any]) -> Any:
        """fn() run on the engine thread between two steps (embeddings use the model)."""
        if self.fatal_error is not None:
            raise EngineDeadError(str(self.fatal_error))
        item = _EngineCall(fn, asyncio.get_running_loop())
        self._inbox.put(item)
        self._wakeup.set()
        return await item.future

    def abort(self, request_id: str) -> None:
        self._inbox.put(request_id)
        self._wakeup.set()

    # ---- engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.heartbeat = time.monotonic()
                self._drain_inbox()
                self.publish_kv_events()  # what calls published was written before
                if not self.scheduler.num_unfinished:
                    self._wakeup.wait(1.0)
                    self._wakeup.clear()
                    self.runner.idle()  # a split model's ranks hear from rank 0 while idle
                    continue
                self._step()
        except BaseException as exc:  # the loop is dead: fail everything, /health tells
            if isinstance(exc, GroupLostError):  # a peer rank's fault: one line (the caller's)
                log.debug("engine loop lost its group: %s", exc)
            else:
                log.exception("engine loop died")
            self.fatal_error = exc
            self._fail_all(EngineDeadError(f"engine loop died: {exc!r}"))

    def _drain_inbox(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, tuple):
                self._add(*item)
            elif isinstance(item, _EngineCall):
                item.run()
            else:
                for seq in self._by_request.pop(item, []):
                    if not seq.is_finished:
                        self.scheduler.abort(seq)
                        self._record_finish(seq)
                    self._untrack(seq)

    def publish_kv_events(self) -> None:
        """Log what the pool recorded since the last call (engine thread, between or after
        steps: never between a schedule and its execute)."""
        batch = self._kv_sink.take()
        if batch is not None:
            self.kv_events.append(batch)

    def kv_snapshot(self) -> tuple[int, list[tuple[int, int]]]:
        """(seq, every cached (hash, parent)): the state batches after seq build on. Run
        through `call`, i.e. between steps."""
        self.publish_kv_events()
        return self.kv_events.seq, self.scheduler.kv_cache.pool.cached_hashes()

    def _add(self, request: EngineRequest, sink: _RequestSink) -> None:
        seqs = []
        # Every request gets a seed, so its sampled output is a pure function of (seed,
        # prompt, delivered tokens): reproducible in any batch and resumable elsewhere.
        base_seed = request.params.seed
        if base_seed is None:
            base_seed = new_seed()
        for index in range(request.n):
            params = _with_seed(request.params, base_seed + index)
            seq = Sequence(
                prompt_token_ids=list(request.prompt_token_ids),
                params=params,
                arrival_time=request.arrival_time,
                priority=request.priority,
                request_id=request.request_id,
                output_token_ids=list(request.resume_token_ids),
                lora=request.lora,
                tenant=request.tenant,
                cache_salt=request.cache_salt,
            )
            self._tracked[seq.seq_id] = _Tracked(
                seq, index, sink, OutputProcessor(self.tokenizer, seq)
            )
            self.scheduler.add(seq)
            seqs.append(seq)
            self.adapter_usage.add(seq.lora)
        self._by_request[request.request_id] = seqs

    def _step(self) -> None:
        started = time.monotonic()
        self.in_step_since = started
        out = self.scheduler.schedule()
        if out.preempted:
            self.metrics.preemptions.inc(len(out.preempted))
        if out.is_empty:
            self.in_step_since = None
            time.sleep(0.001)
            return
        self.metrics.chargeback.begin_step(started)
        for chunk in out.chunks:
            seq = chunk.seq
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = started
                self.metrics.queue_time.observe(started - seq.arrival_time)
                m = self.metrics
                m.prompt_tokens.inc(seq.num_prompt_tokens)
                m.prefix_queries.inc(seq.num_prompt_tokens)
                m.prefix_hits.inc(seq.num_cached_tokens)
        result = self.runner.execute(out)
        # Blocks published at schedule time hold their KV only now: announce them after.
        self.publish_kv_events()
        num_before = [s.num_output_tokens for s in result.sampled_seqs]
        self.scheduler.update(out, result.token_by_seq_id())
        now = time.monotonic()
        self.in_step_since = None
        self.metrics.chargeback.end_step(out, now)
        self.metrics.step_seconds.observe(now - started)
        self.step_time.update(now - started)
        self.step_cost.observe(out.step_shape, now - started)
        self.metrics.step_tokens.observe(out.num_batched_tokens)
        if out.num_batched_tokens >= PROMPT_RATE_TOKENS:
            self.prompt_rate.update(out.num_batched_tokens / max(now - started, 1e-6))
        if self.scheduler.speculator is not None:
            self.metrics.record_spec_decode(self.scheduler.speculator.take_stats())
        self._deliver(result.sampled_seqs, num_before, result.logprobs, now)

    def _deliver(
        self,
        seqs: list[Sequence],
        num_before: list[int],
        logprobs: list[list[TokenLogprobs]],
        now: float,
    ) -> None:
        """Hand each sequence's new tokens (one, or more with speculation) to its request."""
        batches: dict[_RequestSink, list[SequenceOutput]] = {}
        m = self.metrics
        for seq, before, lps in zip(seqs, num_before, logprobs, strict=True):
            tracked = self._tracked.get(seq.seq_id)
            if tracked is None:
                continue
            tokens = seq.output_token_ids[before:]
            text = ""
            for i, token in enumerate(tokens):
                piece, hit_stop = tracked.processor.add_token(token)
                text += piece
                if hit_stop:
                    if not seq.is_finished:
                        self.scheduler.finish(seq, FinishReason.STOP)
                    _drop_output_tail(seq, len(tokens) - i - 1)
                    tokens = tokens[: i + 1]
                    break
            if tracked.last_token_time is None:
                m.ttft.observe(now - seq.arrival_time)
            else:
                m.itl.observe(now - tracked.last_token_time)
            tracked.last_token_time = now
            m.generation_tokens.inc(len(tokens))
            if seq.lora is not None:
                m.lora.tokens(seq.lora.name, len(tokens))
            done = seq.is_finished
            if done:
                text += tracked.processor.finish()
                self._record_finish(seq)
                m.e2e.observe(now - seq.arrival_time)
                self._untrack(seq)
                siblings = self._by_request.get(seq.request_id, [])
                if all(s.is_finished for s in siblings):
                    self._by_request.pop(seq.request_id, None)
            out = SequenceOutput(
                index=tracked.index,
                text=text,
                token_ids=tokens,
                logprobs=lps[: len(tokens)],
                finished=done,
                finish_reason=seq.finish_reason.value if done and seq.finish_reason else None,
                num_prompt_tokens=seq.num_prompt_tokens,
                num_output_tokens=seq.num_output_tokens,
                num_cached_tokens=seq.num_cached_tokens,
            )
            batches.setdefault(tracked.sink, []).append(out)
        by_loop: dict[
            asyncio.AbstractEventLoop, list[tuple[_RequestSink, list[SequenceOutput]]]
        ] = {}
        for sink, outs in batches.items():
            by_loop.setdefault(sink.loop, []).append((sink, outs))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_dispatch, items)

    def _untrack(self, seq: Sequence) -> None:
        if self._tracked.pop(seq.seq_id, None) is not None:
            self.adapter_usage.remove(seq.lora)

    def _record_finish(self, seq: Sequence) -> None:
        self.metrics.finished(seq.finish_reason.value if seq.finish_reason else "unknown")

    def _fail_all(self, error: BaseException) -> None:
        sinks = {t.sink for t in self._tracked.values()}
        for tracked in list(self._tracked.values()):
            if not tracked.seq.is_finished:
                self.scheduler.abort(tracked.seq)
        self._tracked.clear()
        self._by_request.clear()
        self.adapter_usage.clear()
        for sink in sinks:
            if not sink.loop.is_closed():
                sink.loop.call_soon_threadsafe(sink.queue.put_nowait, error)


def _dispatch(items: list[tuple[_RequestSink, list[SequenceOutput]]]) -> None:
    for sink, outs in items:
        sink.queue.put_nowait(outs)


def _drop_output_tail(seq: Sequence, count: int) -> None:
    """Forget tokens a speculative step produced past a stop string (the sequence is
    finished): usage then counts what a plain run would have."""
    if count:
        del seq.output_token_ids[-count:]
        del seq.token_ids[-count:]


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    from dataclasses import replace

    return replace(params, seed=seed)
