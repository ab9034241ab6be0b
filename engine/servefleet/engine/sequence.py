"""One request's state as the scheduler and runner see it.

`num_computed_tokens` is the single counter behind chunked prefill, prefix-cache
hits and preemption: everything before it is in the KV cache, everything after
it still has to be run through the model.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from servefleet.api.chargeback import UNATTRIBUTED
from servefleet.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from xgrammar import GrammarMatcher

    from servefleet.engine.lora.adapter import LoraAdapter

_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


class Priority(enum.IntEnum):
    """Lower runs first: interactive traffic goes ahead of batch traffic."""

    INTERACTIVE = 0
    BATCH = 1


@dataclass(eq=False)
class Sequence:
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    priority: int = Priority.INTERACTIVE
    request_id: str = ""
    seq_id: int = field(default_factory=lambda: next(_ids))
    output_token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_published_blocks: int = 0  # leading blocks already offered to the prefix cache
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    grammar: GrammarMatcher | None = None  # where a structured output stands; None: free
    lora: LoraAdapter | None = None  # the adapter it runs under; None: the base model
    # Prefill and export (disaggregated P/D, `kv_prefill`): never samples; finished once
    # every prompt token's KV is written, so its blocks can be handed to a decode engine.
    prefill_only: bool = False
    tenant: str = UNATTRIBUTED  # billed for its steps (`servefleet.api.chargeback`)
    cache_salt: str | None = None  # shares prefixes only within its salt (`api.cache_salt`)

    def __post_init__(self) -> None:
        # A resumed request's delivered tokens (`servefleet.api.stream_resume`) are already
        # output: prefilled with the prompt, counted toward max_tokens, penalties and stops.
        self.token_ids: list[int] = [*self.prompt_token_ids, *self.output_token_ids]
        if self.params.compiled_grammar is not None and self.grammar is None:
            from xgrammar import GrammarMatcher

            self.grammar = GrammarMatcher(self.params.compiled_grammar)
            for token_id in self.output_token_ids:
                self.grammar.accept_token(token_id)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)

    def sort_key(self) -> tuple[int, float, int]:
        """Waiting order: priority, then arrival (preempted sequences keep theirs)."""
        return (self.priority, self.arrival_time, self.seq_id)
