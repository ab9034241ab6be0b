"""Mixed load for the `servefleet up` soak: chat and completions, streamed and whole, short and
long answers, clients that leave mid-stream, from two tenants, through a few closed-loop clients.

A leak shows only when every path a request can take runs many times over, so each client
walks the whole `MIX` in turn. Every request ends in one `fault_load.Outcome`; `hung` (stalled,
or no end within its deadline) and a 5xx are what the soak may never see.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

from servefleet.bench.fault_load import Outcome

REFUSED_SLEEP_CAP_S = 10.0  # a refused client waits its Retry-After, at most this long
STALL_S = 120.0  # no byte for this long: the request is hung
DEADLINE_S = 600.0  # nor may any request take longer than this


@dataclass(frozen=True)
class Kind:
    """One kind of request in the mix and how its client reads the answer."""

    name: str
    tenant: int  # index into the run's tenant keys
    chat: bool
    stream: bool
    max_tokens: int
    temperature: float = 0.0
    leave_after_tokens: int | None = None  # disconnect after this many content chunks

    def body(self, model: str, number: int) -> dict[str, Any]:
        """Request `number`: a prompt of its own (users' prompts differ; some share a prefix)."""
        text = f"Tell a story about lighthouse number {number}."
        body: dict[str, Any] = {
            "model": model,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "ignore_eos": True,  # long answers are as long as asked
            "stream": self.stream,
        }
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.chat:
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        return body


MIX: tuple[Kind, ...] = (
    Kind("chat_stream_short", 0, chat=True, stream=True, max_tokens=8),
    Kind("chat_whole_medium", 1, chat=True, stream=False, max_tokens=48),
    Kind("completion_stream_long", 0, chat=False, stream=True, max_tokens=160),
    Kind("completion_whole_short", 1, chat=False, stream=False, max_tokens=16),
    Kind("chat_stream_leaves", 1, chat=True, stream=True, max_tokens=200, leave_after_tokens=10),
    Kind("chat_stream_sampled", 0, chat=True, stream=True, max_tokens=96, temperature=0.8),
    Kind("completion_stream_leaves", 0, chat=False, stream=True, max_tokens=200,
         leave_after_tokens=5),
)  # fmt: skip


@dataclass
class Record:
    kind: str
    outcome: Outcome
    status: int = 0
    started: float = 0.0  # seconds since the load began
    seconds: float = 0.0
    tokens: int = 0
    detail: str = ""


@dataclass
class LoadLog:
    """Every request of the run, appended as it ends (the progress lines read it live)."""

    records: list[Record] = field(default_factory=list)

    def outcomes(self) -> dict[str, int]:
        found = Counter(r.outcome.value for r in self.records)
        return {outcome.value: found.get(outcome.value, 0) for outcome in Outcome}

    def by_kind(self) -> dict[str, dict[str, int]]:
        table: dict[str, Counter[str]] = {kind.name: Counter() for kind in MIX}
        for record in self.records:
            table[record.kind][record.outcome.value] += 1
        return {name: dict(counts) for name, counts in table.items()}

    def status_codes(self) -> dict[str, int]:
        return dict(sorted(Counter(str(r.status) for r in self.records).items()))

    def server_errors(self) -> int:
        return sum(1 for r in self.records if r.status >= 500)

    def first_problems(self, limit: int = 5) -> list[str]:
        bad = (Outcome.FAILED, Outcome.HUNG, Outcome.ERROR_EVENT, Outcome.REFUSED_BARE)
        return [
            f"{r.kind} {r.outcome.value} {r.status}: {r.detail}"
            for r in self.records
            if r.outcome in bad
        ][:limit]


def _content(choice: dict[str, Any], chat: bool) -> str:
    if chat:
        return str((choice.get("delta") or choice.get("message") or {}).get("content") or "")
    return str(choice.get("text") or "")


async def _read_stream(response: httpx.Response, kind: Kind, record: Record) -> None:
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            record.outcome = Outcome.OK
            return
        chunk = json.loads(data)
        if "error" in chunk:
            record.outcome, record.detail = Outcome.ERROR_EVENT, json.dumps(chunk["error"])[:300]
            return
        record.tokens += sum(1 for c in chunk.get("choices") or [] if _content(c, kind.chat))
        if kind.leave_after_tokens is not None and record.tokens >= kind.leave_after_tokens:
            record.outcome = Outcome.LEFT  # leaving the block closes the connection
            return
    record.detail = "stream ended without [DONE]"


async def _read_whole(response: httpx.Response, kind: Kind, record: Record) -> None:
    body = json.loads(await response.aread())
    choices = body.get("choices") or []
    if not choices or not _content(choices[0], kind.chat):
        record.detail = f"an answer without content: {json.dumps(body)[:200]}"
        return
    record.tokens = int((body.get("usage") or {}).get("completion_tokens") or 0)
    record.outcome = Outcome.OK


async def send(
    client: httpx.AsyncClient, base: str, key: str, model: str, kind: Kind, number: int
) -> tuple[Record, float | None]:
    """One request, classified (never raises for what the server does); and the Retry-After
    it was refused with, if any."""
    record = Record(kind=kind.name, outcome=Outcome.FAILED)
    path = "/v1/chat/completions" if kind.chat else "/v1/completions"
    headers = {"authorization": f"Bearer {key}"}
    retry_after = None
    try:
        async with client.stream(
            "POST", base + path, json=kind.body(model, number), headers=headers
        ) as response:
            record.status = response.status_code
            if response.status_code in (429, 503):
                retry_after = _seconds(response.headers.get("retry-after"))
                refused = retry_after is not None
                record.outcome = Outcome.REFUSED if refused else Outcome.REFUSED_BARE
                await response.aread()
            elif response.status_code != 200:
                record.detail = (await response.aread()).decode(errors="replace")[:300]
            elif kind.stream:
                await _read_stream(response, kind, record)
            else:
                await _read_whole(response, kind, record)
    except httpx.TimeoutException as exc:
        record.outcome, record.detail = Outcome.HUNG, type(exc).__name__
    except httpx.HTTPError as exc:
        record.detail = f"{type(exc).__name__}: {exc}"[:300]
    return record, retry_after


def _seconds(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


async def mixed_load(
    base: str, keys: list[str], model: str, clients: int, seconds: float, log: LoadLog
) -> None:
    """`clients` closed-loop clients for `seconds`, each walking `MIX` from its own offset.
    A request is `hung` when no byte came for `STALL_S` or it did not end within `DEADLINE_S`
    (its client then goes on): a slow answer on busy cores is not a hang, a stalled one is."""
    stop_at = time.monotonic() + seconds
    start = time.monotonic()
    numbers = itertools.count()
    limits = httpx.Limits(max_connections=clients * 2, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=httpx.Timeout(STALL_S), limits=limits) as client:

        async def one_client(offset: int) -> None:
            for step in itertools.count(offset):
                if time.monotonic() >= stop_at:
                    return
                kind, number = MIX[step % len(MIX)], next(numbers)
                began = time.monotonic()
                try:
                    async with asyncio.timeout(DEADLINE_S):
                        record, retry_after = await send(
                            client, base, keys[kind.tenant], model, kind, number
                        )
                except TimeoutError:
                    record, retry_after = Record(kind=kind.name, outcome=Outcome.HUNG), None
                record.started, record.seconds = began - start, time.monotonic() - began
                log.records.append(record)
                if retry_after is not None:  # a well-behaved client waits as told
                    await asyncio.sleep(min(retry_after, REFUSED_SLEEP_CAP_S))

        await asyncio.gather(*(one_client(i) for i in range(clients)))
