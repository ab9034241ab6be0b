"""What the gateway reads from a request body: a token estimate and a prefix-affinity key.

Prompt tokens are estimated from characters (`chars_per_token`) for the reservation when the
deployment names no tokenizer or it is not loaded yet (`token_counter` counts exactly
otherwise), and settled with the engine's exact usage when the response ends, so a wrong
estimate only moves tokens between reservation and refund. The affinity key hashes the first
`blocks` KV blocks' worth of prompt text (rounded down to whole blocks, so two prompts that
share a system prompt share a key even when their tails differ).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

from servefleet.text.messages import content_text

# Role markers and per-message framing the chat template adds (a rough, cheap constant).
PER_MESSAGE_TOKENS = 4


@dataclass(frozen=True, slots=True)
class PromptShape:
    estimated_tokens: int
    affinity_key: int | None
    chars: int = 0  # the longest single prompt's text (what a context-length bound reads)
    total_chars: int = 0  # every prompt's text (what counting them costs)


@dataclass(frozen=True, slots=True)
class PromptReader:
    chars_per_token: float = 4.0
    block_size: int = 16
    affinity_blocks: int = 4

    @property
    def block_chars(self) -> int:
        return max(1, int(self.block_size * self.chars_per_token))

    def chat(self, messages: list[dict[str, Any]]) -> PromptShape:
        """Messages validated by the request model (text parts only, see `servefleet.text`)."""
        parts: list[str] = []
        for message in messages:
            parts.append(str(message.get("role", "")))
            parts.append(content_text(message.get("content")))
        text = "\x1f".join(parts)
        tokens = math.ceil(len(text) / self.chars_per_token) + PER_MESSAGE_TOKENS * len(messages)
        chars = len(text) - (len(parts) - 1)  # roles and contents, all rendered into the prompt
        return PromptShape(tokens, self._key(text), chars, chars)

    def completion(self, prompt: Any) -> PromptShape:
        if isinstance(prompt, str):
            tokens = math.ceil(len(prompt) / self.chars_per_token)
            return PromptShape(tokens, self._key(prompt), len(prompt), len(prompt))
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            # Token ids: exact count, key over the first blocks of ids.
            n = self.block_size * self.affinity_blocks
            whole = (min(len(prompt), n) // self.block_size) * self.block_size
            key = _digest(",".join(map(str, prompt[:whole]))) if whole and n else None
            return PromptShape(len(prompt), key)
        if isinstance(prompt, list):
            shapes = [self.completion(p) for p in prompt]
            first = shapes[0].affinity_key if shapes else None
            longest = max((s.chars for s in shapes), default=0)
            total = sum(s.total_chars for s in shapes)
            return PromptShape(sum(s.estimated_tokens for s in shapes), first, longest, total)
        return PromptShape(0, None)

    def _key(self, text: str) -> int | None:
        if self.affinity_blocks == 0:
            return None
        block = self.block_chars
        whole = min(len(text) // block, self.affinity_blocks)
        if whole == 0:
            return None
        return _digest(text[: whole * block])


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
