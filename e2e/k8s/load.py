"""Steady streaming load on the gateway, with every request's outcome kept.

A request counts as answered when it streams to `[DONE]` (200) or is refused with 429/503
and a Retry-After header; anything else (a cut stream, a timeout, another status) is a
failure with its reason, so a test can assert that none happened.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

REQUEST_TIMEOUT_S = 60.0


@dataclass
class Load:
    base_url: str  # http://host:port/v1
    api_key: str
    model: str
    concurrency: int
    max_tokens: int = 32
    outcomes: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    slowest_s: float = 0.0
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> Load:
        for i in range(self.concurrency):
            thread = threading.Thread(target=self._worker, name=f"load-{i}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> Load:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=REQUEST_TIMEOUT_S + 5)
        return self

    def answered(self) -> int:
        return sum(self.outcomes.values())

    def _record(self, outcome: str, seconds: float, failure: str | None = None) -> None:
        with self._lock:
            self.outcomes[outcome] += 1
            self.slowest_s = max(self.slowest_s, seconds)
            if failure:
                self.failures.append(failure)

    def _worker(self) -> None:
        body = {
            "model": self.model,
            "stream": True,
            "max_tokens": self.max_tokens,
            "messages": [{"role": "user", "content": "Count from one to twenty."}],
        }
        headers = {"Authorization": f"Bearer {self.api_key}"}
        with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
            while not self._stop.is_set():
                start = time.monotonic()
                outcome, failure = self._one(client, body, headers)
                self._record(outcome, time.monotonic() - start, failure)
                if outcome != "200":
                    time.sleep(0.5)

    def _one(
        self, client: httpx.Client, body: dict[str, object], headers: dict[str, str]
    ) -> tuple[str, str | None]:
        try:
            with client.stream(
                "POST", self.base_url + "/chat/completions", json=body, headers=headers
            ) as response:
                if response.status_code in (429, 503):
                    response.read()
                    if response.headers.get("retry-after"):
                        return str(response.status_code), None
                    return "failed", f"{response.status_code} without Retry-After"
                if response.status_code != 200:
                    text = response.read().decode(errors="replace")[:200]
                    return "failed", f"{response.status_code}: {text}"
                lines = list(response.iter_lines())
        except httpx.HTTPError as exc:
            return "failed", f"{type(exc).__name__}: {exc}"
        if "data: [DONE]" not in lines:
            return "failed", f"stream cut after {len(lines)} lines"
        return "200", None
