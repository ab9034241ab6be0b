"""Exact prompt token counts at admission, from the model's own tokenizer and chat template.

Optional: a deployment names a model source (`tokenizer:` in its gateway config — a built-in
name, a GGUF file or a Hugging Face folder) and the gateway loads the tokenizer from it in a
worker thread after start, so startup is not held up and torch is never imported
(`servefleet.text` reads the GGUF metadata with `gguf` alone). Until it is loaded, or when the
model is not available on this machine, the fast character estimate (`prompt.PromptReader`)
is used; either way exact usage is settled at the end of the response.

Tokenizing costs about 2 µs a character and, for a 15 MB message, 2.5 GB of memory: on the
event loop one such request stalled every other request, `/health` included, for 30 s. So:
- a prompt whose length alone proves it longer than the model's context is refused before
  anything tokenizes it (`too_long`: each token stands for at most `longest_token_bytes`
  characters);
- counting runs on `CountingWorker`'s threads (the tokenizer releases the GIL), at most
  `MAX_PENDING` at a time, and only for prompts up to `EXACT_COUNT_MAX_CHARS`; anything else
  is estimated — never waited for.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from servefleet.api.kv_blocks import chain, root_hash
from servefleet.text.chat_template import ChatTemplate, ChatTemplateError
from servefleet.text.messages import template_messages
from servefleet.text.model_text import load_model_text
from servefleet.text.tokenizer import Tokenizer

ROOT = root_hash(None)  # the base model's unsalted chain

log = logging.getLogger("servefleet.gateway.tokens")

# Longest prompt counted exactly: ~2 s and ~20 MB of tokenizer memory here. A real prompt of
# a 128k-token context is ~0.5 M characters; past this the estimate is reserved and usage is
# settled exactly anyway.
EXACT_COUNT_MAX_CHARS = 1_000_000
COUNTING_THREADS = 2
MAX_PENDING = 8  # counts running or waiting for a thread; more are estimated

T = TypeVar("T")


class CountingWorker:
    """A few threads that count tokens; a caller finding them all taken gets None at once."""

    def __init__(self, threads: int = COUNTING_THREADS, max_pending: int = MAX_PENDING) -> None:
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="token-count")
        self._max_pending = max_pending
        self._pending = 0
        self._lock = threading.Lock()

    @property
    def pending(self) -> int:
        return self._pending

    async def run(self, work: Callable[[], T | None]) -> T | None:
        """`work()` on a worker thread, or None when the worker is full or `work` fails. A
        caller that goes away does not free its place before the thread is done."""
        with self._lock:
            if self._pending >= self._max_pending:
                return None
            self._pending += 1

        def counted() -> T | None:
            try:
                return work()
            except Exception:  # a tokenizer failure must not fail the request: estimate
                log.exception("counting prompt tokens failed; the estimate is used")
                return None
            finally:
                self._release()

        try:
            future = self._executor.submit(counted)
        except RuntimeError:  # shut down
            self._release()
            return None
        return await asyncio.wrap_future(future)

    def _release(self) -> None:
        with self._lock:
            self._pending -= 1


_WORKER: CountingWorker | None = None


def counting_worker() -> CountingWorker:
    """The gateway's one counting worker (shared by every deployment: the cores are)."""
    global _WORKER
    if _WORKER is None:
        _WORKER = CountingWorker()
    return _WORKER


@dataclass(frozen=True, slots=True)
class Counted:
    """An exact prompt count and, when asked for, the hashes of its full KV blocks: the
    engine's own chain (`servefleet.api.kv_blocks`, base model root), so the gateway can
    ask its index which replica holds them."""

    tokens: int
    block_hashes: tuple[int, ...] = ()

    @classmethod
    def of(cls, ids: Sequence[int], block_size: int | None, root: int = ROOT) -> Counted:
        """`root`: the chain's start, salted as the engine will (`servefleet.api.cache_salt`)."""
        if block_size is None:
            return cls(len(ids))
        return cls(len(ids), tuple(chain(root, ids, block_size)))


class PromptTokenCounter:
    """Counts what the engine will count: the rendered chat template, tokenized."""

    def __init__(
        self, tokenizer: Tokenizer, template: ChatTemplate, context_length: int | None = None
    ) -> None:
        self.tokenizer = tokenizer
        self.template = template
        self.context_length = context_length  # the model's own; a deployment may set less
        self.longest_token_chars = tokenizer.longest_token_bytes

    def at_least(self, chars: int) -> int:
        """Tokens a text of `chars` characters has at the very least (no tokenizing)."""
        return math.ceil(chars / self.longest_token_chars)

    def chat_ids(self, messages: Sequence[Mapping[str, Any]]) -> list[int] | None:
        """Token ids of the rendered conversation (validated messages), as the engine
        tokenizes it; None when the template refuses them here: the engine will say why."""
        try:
            text = self.template.render(template_messages(messages), add_generation_prompt=True)
        except ChatTemplateError:
            return None
        return self.tokenizer.encode(text, add_special_tokens=False)

    def chat(self, messages: Sequence[Mapping[str, Any]]) -> int | None:
        ids = self.chat_ids(messages)
        return None if ids is None else len(ids)

    def completion(self, prompt: Any) -> int | None:
        if isinstance(prompt, str):
            return len(self.tokenizer.encode(prompt))
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            return sum(len(self.tokenizer.encode(p)) for p in prompt)
        return None  # token ids are counted exactly without a tokenizer

    def chat_counted(
        self, messages: Sequence[Mapping[str, Any]], block_size: int | None, root: int = ROOT
    ) -> Counted | None:
        """The count, and the prompt's KV block hashes when `block_size` is given."""
        ids = self.chat_ids(messages)
        return None if ids is None else Counted.of(ids, block_size, root)

    def completion_counted(
        self, prompt: Any, block_size: int | None, root: int = ROOT
    ) -> Counted | None:
        """A single prompt (text or token ids) is hashed too; a list of texts only counted."""
        if isinstance(prompt, str):
            return Counted.of(self.tokenizer.encode(prompt), block_size, root)
        if isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
            return Counted.of(prompt, block_size, root)
        count = self.completion(prompt)
        return None if count is None else Counted(count)

    async def count(self, work: Callable[[], T | None], chars: int) -> T | None:
        """`work` (a `chat` or `completion` call) on the counting worker; None (estimate) for
        a text over `EXACT_COUNT_MAX_CHARS` or when the worker is busy."""
        if chars > EXACT_COUNT_MAX_CHARS:
            return None
        return await counting_worker().run(work)


def load_token_counter(source: str) -> PromptTokenCounter:
    """The counter for a model source; raises ValueError when it is not available here."""
    text = load_model_text(source)
    return PromptTokenCounter(text.tokenizer, text.chat_template, text.context_length)
