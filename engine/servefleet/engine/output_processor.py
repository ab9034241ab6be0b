"""Token ids to text for one sequence: incremental detokenizing and stop strings.

Text that could still turn out to be the start of a stop string is held back,
so a streamed answer never shows a stop string it later retracts.
"""

from __future__ import annotations

from servefleet.engine.sequence import Sequence
from servefleet.text.detokenizer import IncrementalDetokenizer
from servefleet.text.tokenizer import Tokenizer


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, seq: Sequence) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer, seq.prompt_token_ids)
        self.stop = seq.params.stop
        self.include_stop = seq.params.include_stop_str_in_output
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        self.text = ""
        self.emitted = 0  # characters of self.text already handed out
        # A resumed sequence's delivered tokens went out from another replica: replay them so
        # the held-back text and an unfinished character stand exactly where they stood there.
        for token_id in seq.output_token_ids:
            self.add_token(token_id)

    def add_token(self, token_id: int) -> tuple[str, bool]:
        """Feed one token; return (text to emit now, whether a stop string was hit)."""
        before = len(self.text)
        self.text += self.detokenizer.feed(token_id)
        if self.stop:
            start = max(0, before - self.max_stop_len + 1)
            hits = [(self.text.find(s, start), s) for s in self.stop]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                index, stop = min(hits)
                self.text = self.text[: index + (len(stop) if self.include_stop else 0)]
                return self._emit(len(self.text)), True
            return self._emit(len(self.text) - self._partial_stop_suffix()), False
        return self._emit(len(self.text)), False

    def finish(self) -> str:
        """Everything not yet emitted: held-back text and an unfinished character."""
        self.text += self.detokenizer.flush()
        return self._emit(len(self.text))

    def _partial_stop_suffix(self) -> int:
        """Length of the longest suffix of the text that begins some stop string."""
        longest = 0
        tail = self.text[-self.max_stop_len :]
        for stop in self.stop:
            for k in range(min(len(stop) - 1, len(tail)), longest, -1):
                if tail.endswith(stop[:k]):
                    longest = k
                    break
        return longest

    def _emit(self, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        chunk = self.text[self.emitted : upto]
        self.emitted = upto
        return chunk
