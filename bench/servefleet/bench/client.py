"""A closed-loop streaming client for any OpenAI-compatible server.

It runs on one asyncio loop with one pooled `httpx.AsyncClient` because the server under test
usually shares the machine's cores: per chunk the client only parses one small JSON line and
stores a timestamp, and all statistics are computed after the run.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict, Field

from servefleet.bench.workloads import Prompt


class Endpoint(StrEnum):
    COMPLETIONS = "completions"
    CHAT = "chat"


class ClientConfig(BaseModel):
    model_config = ConfigDict(frozen=True)

    url: str = Field(description="server base URL, with or without a trailing /v1")
    model: str
    endpoint: Endpoint = Endpoint.COMPLETIONS
    concurrency: int = Field(ge=1)
    output_tokens: int = Field(ge=1)
    api_key: str | None = None
    request_timeout_s: float = Field(default=300.0, gt=0)
    total_timeout_s: float = Field(default=3600.0, gt=0)


@dataclass
class RequestResult:
    """What one request observed; all times are `time.perf_counter()` seconds."""

    index: int
    start: float
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    usage_prompt_tokens: int | None = None
    usage_completion_tokens: int | None = None
    prompt_tokens_sent: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def output_tokens(self) -> int:
        """Tokens from `usage` when the server sent it, else the count of content chunks."""
        if self.usage_completion_tokens is not None:
            return self.usage_completion_tokens
        return len(self.chunk_times)

    @property
    def input_tokens(self) -> int:
        if self.usage_prompt_tokens is not None:
            return self.usage_prompt_tokens
        return self.prompt_tokens_sent

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def latency(self) -> float:
        return self.end - self.start

    @property
    def itls(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in itertools.pairwise(t)]

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first: (e2e - ttft) / (tokens - 1)."""
        ttft = self.ttft
        n = self.output_tokens
        if ttft is None or n < 2:
            return None
        return (self.latency - ttft) / (n - 1)


class _StreamOptionsRejected(Exception):
    """The server refused `stream_options`; retry the request without it."""


def api_base(url: str) -> str:
    base = url.rstrip("/")
    return base if base.endswith("/v1") else base + "/v1"


class BenchClient:
    """Sends prompts with at most `concurrency` requests in flight and records timings."""

    def __init__(self, config: ClientConfig, http: httpx.AsyncClient) -> None:
        self._config = config
        self._http = http
        self._include_usage = True
        base = api_base(config.url)
        self._path = (
            f"{base}/chat/completions"
            if config.endpoint is Endpoint.CHAT
            else f"{base}/completions"
        )

    @property
    def include_usage(self) -> bool:
        return self._include_usage

    def _body(self, prompt: Prompt) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self._config.model,
            "max_tokens": self._config.output_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
        }
        if self._include_usage:
            body["stream_options"] = {"include_usage": True}
        if self._config.endpoint is Endpoint.CHAT:
            messages = []
            if prompt.system_text is not None:
                messages.append({"role": "system", "content": prompt.system_text})
            messages.append({"role": "user", "content": _text_or_ids(prompt)})
            body["messages"] = messages
        else:
            body["prompt"] = (
                prompt.token_ids
                if prompt.token_ids is not None
                else _join(prompt.system_text, prompt.text)
            )
        return body

    async def run(
        self, prompts: list[Prompt], on_result: Callable[[RequestResult], None] | None = None
    ) -> list[RequestResult]:
        """Send every prompt; results come back in prompt order, failures included.
        `on_result` sees each one as it finishes (progress)."""
        results: list[RequestResult | None] = [None] * len(prompts)
        next_index = iter(range(len(prompts)))

        async def worker() -> None:
            for i in next_index:
                results[i] = result = await self._one(i, prompts[i])
                if on_result is not None:
                    on_result(result)

        workers = [
            asyncio.create_task(worker())
            for _ in range(min(self._config.concurrency, len(prompts)))
        ]
        try:
            async with asyncio.timeout(self._config.total_timeout_s):
                await asyncio.gather(*workers)
        except TimeoutError:
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
        now = time.perf_counter()
        return [
            r
            if r is not None
            else RequestResult(index=i, start=now, end=now, error="total timeout reached")
            for i, r in enumerate(results)
        ]

    async def _one(self, index: int, prompt: Prompt) -> RequestResult:
        result = RequestResult(index=index, start=time.perf_counter())
        result.prompt_tokens_sent = prompt.num_tokens
        try:
            async with asyncio.timeout(self._config.request_timeout_s):
                try:
                    await self._stream(prompt, result)
                except _StreamOptionsRejected:
                    self._include_usage = False
                    result.chunk_times.clear()
                    result.start = time.perf_counter()
                    await self._stream(prompt, result)
        except TimeoutError:
            result.error = f"request timed out after {self._config.request_timeout_s:g}s"
        except httpx.HTTPError as exc:
            result.error = f"{type(exc).__name__}: {exc}"
        except ValueError as exc:  # malformed JSON in the stream
            result.error = f"bad stream: {exc}"
        result.end = time.perf_counter()
        return result

    async def _stream(self, prompt: Prompt, result: RequestResult) -> None:
        headers = {"Accept": "text/event-stream"}
        if self._config.api_key:
            headers["Authorization"] = f"Bearer {self._config.api_key}"
        sent_usage_option = self._include_usage
        async with self._http.stream(
            "POST", self._path, json=self._body(prompt), headers=headers
        ) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                if (
                    sent_usage_option
                    and 400 <= response.status_code < 500
                    and "stream_options" in text
                ):
                    raise _StreamOptionsRejected
                result.error = f"HTTP {response.status_code}: {text[:300]}"
                return
            chat = self._config.endpoint is Endpoint.CHAT
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                self._on_event(json.loads(data), chat, result)
        no_content = not result.chunk_times and result.usage_completion_tokens is None
        if result.error is None and no_content:
            result.error = "stream ended without any content"

    @staticmethod
    def _on_event(event: dict[str, Any], chat: bool, result: RequestResult) -> None:
        now = time.perf_counter()
        if "error" in event:
            err = event["error"]
            result.error = str(err.get("message", err) if isinstance(err, dict) else err)
            return
        choices = event.get("choices")
        if choices:
            choice = choices[0]
            content = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
            if content:
                result.chunk_times.append(now)
        usage = event.get("usage")
        if usage:
            result.usage_prompt_tokens = usage.get("prompt_tokens")
            result.usage_completion_tokens = usage.get("completion_tokens")


def _join(system_text: str | None, text: str | None) -> str:
    return " ".join(part for part in (system_text, text) if part)


def _text_or_ids(prompt: Prompt) -> str:
    if prompt.text is not None:
        return prompt.text
    raise ValueError("the chat endpoint needs text prompts")


def make_http_client(config: ClientConfig) -> httpx.AsyncClient:
    limits = httpx.Limits(
        max_connections=config.concurrency, max_keepalive_connections=config.concurrency
    )
    timeout = httpx.Timeout(config.request_timeout_s, connect=min(30.0, config.request_timeout_s))
    return httpx.AsyncClient(limits=limits, timeout=timeout, http2=False)
