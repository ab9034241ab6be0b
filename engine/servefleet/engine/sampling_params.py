"""Per-request sampling settings, validated once at the API boundary."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from servefleet.api.max_tokens import COMPLETIONS_DEFAULT_MAX_TOKENS

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar


@dataclass(frozen=True)
class SamplingParams:
    # Requests always set it (`servefleet.api.max_tokens`); this default serves sequences
    # built inside the engine (warm-up) and tests.
    max_tokens: int = COMPLETIONS_DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None  # number of top alternatives per token; None: off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    extra_eos_token_ids: tuple[int, ...] = field(default=())
    # Structured output: each sequence gets its own matcher over this grammar (compiled
    # once per distinct constraint by `structured.grammars`); None: free text.
    compiled_grammar: CompiledGrammar | None = field(default=None, compare=False)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to the logits

    @property
    def greedy(self) -> bool:
        return self.temperature <= 1e-5

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def changes_logits(self) -> bool:
        """True when `sampler.request_logits` changes the row (so a greedy row's token is
        not the raw argmax): the one place a new logits-changing parameter is declared."""
        return self.needs_penalties or bool(self.logit_bias)
