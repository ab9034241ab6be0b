"""Streaming load for fault scenarios: closed-loop clients that classify every request.

Each request is a streamed chat completion read with httpx (not an SDK: a scenario must be able
to stop reading, read slowly or leave mid-stream). Every request ends in exactly one outcome,
and a request that takes longer than its deadline is `hung` — the one outcome a fault may never
cause, together with `failed`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import httpx

from servefleet.api.stream_resume import SEED_HEADER
from servefleet.bench.fault_stack import MODEL, api_key


class Outcome(StrEnum):
    OK = "ok"  # 200 and a stream that ended with [DONE]
    REFUSED = "refused"  # 429/503 with Retry-After: a truthful no
    REFUSED_BARE = "refused_without_retry_after"
    ERROR_EVENT = "error_event"  # 200, then an error event in the stream
    FAILED = "failed"  # anything else: 5xx, a cut stream, a connection error
    HUNG = "hung"  # no end within the request's deadline
    LEFT = "left"  # the client went away on purpose


@dataclass
class RequestRecord:
    tenant: str
    outcome: Outcome
    status: int = 0
    started: float = 0.0
    seconds: float = 0.0
    retry_after_s: float | None = None
    tokens_delivered: int = 0  # content chunks received (one token each from our engine)
    usage_completion_tokens: int | None = None
    text: str = ""
    detail: str = ""
    number: int = 0  # which request of the run (its prompt), to compare with a reference
    seed: int | None = None  # the seed the gateway says the stream was sampled with


@dataclass
class RequestSpec:
    """One request's shape and how its client behaves while reading."""

    prompt: str = "Count from one to twenty in words."
    max_tokens: int = 16
    temperature: float = 0.0
    seed: int | None = None  # the client's own seed (sampled output it can reproduce)
    prompts: int | None = None  # distinct prompts cycled through (None: one per request)
    leave_after_tokens: int | None = None  # disconnect after this many content chunks
    read_delay_s: float = 0.0  # a slow reader: pause between chunks
    deadline_s: float = 120.0

    def body(self, number: int) -> dict[str, Any]:
        """Request `number` of a run: its own prompt, as users' prompts differ (a retry sends
        the same body again, which is how a gateway can know it for one)."""
        if self.prompts:
            number %= self.prompts
        body: dict[str, Any] = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"{self.prompt} (request {number})"}],
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.seed is not None:
            body["seed"] = self.seed
        return body


def _int_or_none(value: str | None) -> int | None:
    """A header's integer (seeds are signed), or None when absent or not one."""
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after")
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


async def _read_stream(response: httpx.Response, spec: RequestSpec, record: RequestRecord) -> None:
    done = False
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            done = True
            break
        chunk = json.loads(data)
        if "error" in chunk:
            record.outcome, record.detail = Outcome.ERROR_EVENT, json.dumps(chunk["error"])[:300]
            return
        if chunk.get("usage"):
            record.usage_completion_tokens = chunk["usage"].get("completion_tokens")
        for choice in chunk.get("choices") or []:
            content = (choice.get("delta") or {}).get("content")
            if content:
                record.tokens_delivered += 1
                record.text += content
        if (
            spec.leave_after_tokens is not None
            and record.tokens_delivered >= spec.leave_after_tokens
        ):
            record.outcome = Outcome.LEFT
            return
        if spec.read_delay_s:
            await asyncio.sleep(spec.read_delay_s)
    record.outcome = Outcome.OK if done else Outcome.FAILED
    if not done:
        record.detail = "stream ended without [DONE]"


async def send(
    client: httpx.AsyncClient, url: str, tenant: str, spec: RequestSpec, number: int = 0
) -> RequestRecord:
    """One streamed request, classified; never raises for what the server does."""
    record = RequestRecord(
        tenant=tenant, outcome=Outcome.FAILED, started=time.monotonic(), number=number
    )
    headers = {"authorization": f"Bearer {api_key(tenant)}"}
    try:
        async with asyncio.timeout(spec.deadline_s):
            async with client.stream(
                "POST", url + "/v1/chat/completions", json=spec.body(number), headers=headers
            ) as response:
                record.status = response.status_code
                record.seed = _int_or_none(response.headers.get(SEED_HEADER))
                if response.status_code in (429, 503):
                    record.retry_after_s = _retry_after(response)
                    bare = record.retry_after_s is None
                    record.outcome = Outcome.REFUSED_BARE if bare else Outcome.REFUSED
                    await response.aread()
                elif response.status_code != 200:
                    record.detail = (await response.aread()).decode(errors="replace")[:300]
                else:
                    await _read_stream(response, spec, record)
    except TimeoutError:
        record.outcome = Outcome.HUNG
    except httpx.HTTPError as exc:
        record.outcome, record.detail = Outcome.FAILED, f"{type(exc).__name__}: {exc}"[:300]
    record.seconds = time.monotonic() - record.started
    return record


@dataclass
class LoadResult:
    records: list[RequestRecord] = field(default_factory=list)
    retries_at_retry_after: int = 0
    retries_admitted: int = 0

    def counts(self) -> dict[str, int]:
        found = Counter(r.outcome.value for r in self.records)
        return {outcome.value: found.get(outcome.value, 0) for outcome in Outcome}

    def tokens_delivered(self, tenant: str | None = None) -> int:
        """Completion tokens clients received: the stream's own `usage` where it ended, else
        the content chunks counted (a stream left or cut before its usage chunk)."""
        return sum(
            r.tokens_delivered if r.usage_completion_tokens is None else r.usage_completion_tokens
            for r in self.records
            if tenant in (None, r.tenant)
        )

    def summary(self) -> dict[str, Any]:
        return {
            "requests": len(self.records),
            "outcomes": self.counts(),
            "tokens_delivered": self.tokens_delivered(),
            "retries_at_retry_after": self.retries_at_retry_after,
            "retries_admitted": self.retries_admitted,
        }


async def closed_loop(
    url: str,
    tenant: str,
    clients: int,
    duration_s: float,
    spec: RequestSpec,
    *,
    retry_at_retry_after: bool = False,
    fallback_url: str | None = None,
) -> LoadResult:
    """`clients` clients, each sending one request after another for `duration_s`.

    A refused client sleeps the Retry-After it was given; with `retry_at_retry_after` it then
    sends the same request once more, and whether that retry is admitted is what makes a
    Retry-After truthful. A client whose
    request failed moves to `fallback_url` (another gateway replica), as a client behind a load
    balancer would."""
    result = LoadResult()
    stop_at = time.monotonic() + duration_s
    limits = httpx.Limits(max_connections=clients * 2, max_keepalive_connections=clients)
    numbers = itertools.count()
    async with httpx.AsyncClient(timeout=httpx.Timeout(spec.deadline_s), limits=limits) as client:

        async def one_client() -> None:
            target = url
            while time.monotonic() < stop_at:
                number = next(numbers)
                record = await send(client, target, tenant, spec, number)
                result.records.append(record)
                if record.outcome is Outcome.FAILED and fallback_url:
                    target = fallback_url
                if record.outcome is Outcome.REFUSED:  # a well-behaved client waits as told
                    await asyncio.sleep(record.retry_after_s or 0.0)
                    if retry_at_retry_after:
                        retry = await send(client, target, tenant, spec, number)
                        result.records.append(retry)
                        result.retries_at_retry_after += 1
                        result.retries_admitted += retry.outcome is Outcome.OK

        await asyncio.gather(*(one_client() for _ in range(clients)))
    return result


async def burst(url: str, tenant: str, count: int, spec: RequestSpec) -> LoadResult:
    """`count` requests sent at the same moment, each once (no retries)."""
    limits = httpx.Limits(max_connections=count, max_keepalive_connections=count)
    async with httpx.AsyncClient(timeout=httpx.Timeout(spec.deadline_s), limits=limits) as client:
        records = await asyncio.gather(
            *(send(client, url, tenant, spec, number) for number in range(count))
        )
    return LoadResult(records=list(records))
