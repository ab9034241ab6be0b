"""A growing token stream to text deltas, never splitting a UTF-8 character.

`tokenizers`' own `DecodeStream` does the work in Rust: it decodes a short window of recent
tokens, emits what the newest token added, and holds back while the window ends in an
incomplete character (decoded as U+FFFD). The window starts inside the prompt so the first
generated token decodes with its context (SentencePiece's leading space survives). What is
added here is what `DecodeStream` lacks: `flush` for a stream that ends mid-character, and a
restart when a decoder rewrites text across tokens (`DecodeStream` then refuses the step).
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers.decoders import DecodeStream

from servefleet.text.tokenizer import Tokenizer

# Prompt tokens (and, later, emitted tokens) kept as decoding context.
CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """Turns a growing token stream into text deltas without splitting UTF-8 characters."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Iterable[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._context: list[int] = list(prompt_ids)[-CONTEXT_TOKENS:]  # text already handed out
        self._pending: list[int] = []  # fed since the last delta: an unfinished character
        self._stream = self._new_stream(self._context)

    def _new_stream(self, context: list[int]) -> DecodeStream:
        return DecodeStream(ids=context, skip_special_tokens=self.skip_special_tokens)

    def feed(self, token_id: int) -> str:
        """Add one token; return the newly completed text (possibly empty)."""
        self._pending.append(token_id)
        try:
            delta = self._stream.step(self.tokenizer.backend, token_id)
        except Exception:  # a decoder rewrote earlier text: decode again without context
            return self._restart()
        return self._settle(delta)

    def _settle(self, delta: str | None) -> str:
        """Hand out a step's text; the tokens behind it become context."""
        if not delta:
            return ""
        self._context = (self._context + self._pending)[-CONTEXT_TOKENS:]
        self._pending = []
        return delta

    def _restart(self) -> str:
        replay, self._pending, self._context = self._pending, [], []
        self._stream = self._new_stream([])
        text = ""
        for token_id in replay:
            self._pending.append(token_id)
            text += self._settle(self._stream.step(self.tokenizer.backend, token_id))
        return text

    def flush(self) -> str:
        """Whatever is still held back (e.g. a stream that ended mid-character)."""
        if not self._pending:
            return ""
        decode = self.tokenizer.decode
        before = decode(self._context, skip_special_tokens=self.skip_special_tokens)
        after = decode(self._context + self._pending, skip_special_tokens=self.skip_special_tokens)
        self._context = (self._context + self._pending)[-CONTEXT_TOKENS:]
        self._pending = []
        self._stream = self._new_stream(self._context)
        return after[len(before) :] if len(after) > len(before) else ""
