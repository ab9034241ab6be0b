"""Which decodes get proposals this step, and what acceptance says about the next ones.

Speculation is not free: every proposed token is one more row through the model. The
weights are read once per step whatever the number of rows, so at small batches the rows
are nearly free and a few accepted tokens multiply the output; at large batches the step
is already full and rows cost compute. So the speculator turns itself off for a step
with more running sequences than `disable_by_batch_size`, keeps the step within the rows
the batch-invariant decode matmuls take (`max_step_rows`), and turns proposals off per
request when its measured acceptance falls below `min_acceptance_rate`, for a cool-down
that doubles each time acceptance stays low.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from servefleet.api.speculative import SpeculativeConfig
from servefleet.engine.kv_cache import KVCacheManager
from servefleet.engine.sequence import Sequence
from servefleet.engine.spec.ngram import propose_ngram
from servefleet.engine.spec.stats import SpecDecodeStats

if TYPE_CHECKING:
    from servefleet.engine.scheduler import ScheduledChunk, SchedulerConfig, SchedulerOutput
    from servefleet.engine.spec.draft import DraftProposer

ACCEPTANCE_EMA_WEIGHT = 0.2  # weight of the latest verification in a request's acceptance rate
INITIAL_ACCEPTANCE_RATE = 0.5  # before any measurement: neither trusted nor written off
FIRST_COOL_DOWN_STEPS = 16
MAX_COOL_DOWN_STEPS = 512


@dataclass
class _Acceptance:
    rate: float = INITIAL_ACCEPTANCE_RATE
    cool_down: int = FIRST_COOL_DOWN_STEPS
    paused_until_step: int = 0


class Speculator:
    def __init__(
        self, config: SpeculativeConfig, max_step_rows: int, draft: DraftProposer | None = None
    ) -> None:
        if (config.method == "draft_model") != (draft is not None):
            raise ValueError("a draft proposer goes with method draft_model, and only with it")
        self.config = config
        self.draft = draft
        self.max_step_rows = max_step_rows
        self.step = 0
        self._acceptance: dict[int, _Acceptance] = {}  # by seq_id, running sequences only
        self._stats = SpecDecodeStats()

    def attach_drafts(
        self, out: SchedulerOutput, kv_cache: KVCacheManager, limits: SchedulerConfig
    ) -> None:
        """Give decodes of `out` proposals, within the row budget and the KV cache's room."""
        self.step += 1
        batch_limit = self.config.disable_by_batch_size
        if batch_limit is not None and len(out.decodes) + len(out.prefills) > batch_limit:
            return
        room = min(limits.max_num_batched_tokens, self.max_step_rows) - out.num_batched_tokens
        if self.draft is not None:
            self._attach_model_drafts(self.draft, out, kv_cache, limits, room)
            return
        for chunk in out.decodes:
            if room <= 0:
                return
            seq = chunk.seq
            if not chunk.samples or not self._proposes(seq):
                continue
            draft = propose_ngram(
                seq.token_ids,
                self._limit(seq, room, limits),
                self.config.prompt_lookup_min,
                self.config.prompt_lookup_max,
            )
            if self._attach(chunk, draft, kv_cache):
                room -= len(draft)

    def _attach_model_drafts(
        self,
        proposer: DraftProposer,
        out: SchedulerOutput,
        kv_cache: KVCacheManager,
        limits: SchedulerConfig,
        room: int,
    ) -> None:
        """A draft model always writes its full limit: rows are reserved before it runs,
        so every proposing decode goes through one batched draft pass per position."""
        wanted: list[tuple[ScheduledChunk, int]] = []
        for chunk in out.decodes:
            limit = self._limit(chunk.seq, room, limits)
            if limit > 0 and chunk.samples and self._proposes(chunk.seq):
                wanted.append((chunk, limit))
                room -= limit
        if not wanted:
            return
        drafts = proposer.propose([(chunk.seq, limit) for chunk, limit in wanted])
        for (chunk, _), draft in zip(wanted, drafts, strict=True):
            self._attach(chunk, draft, kv_cache)

    def _limit(self, seq: Sequence, room: int, limits: SchedulerConfig) -> int:
        """The step yields accepted proposals + 1 tokens: never more than the request or
        the context may still take."""
        return min(
            self.config.num_speculative_tokens,
            room,
            seq.params.max_tokens - seq.num_output_tokens - 1,
            limits.max_model_len - seq.num_tokens - 1,
        )

    @staticmethod
    def _attach(chunk: ScheduledChunk, draft: list[int], kv_cache: KVCacheManager) -> bool:
        if not draft or not kv_cache.allocate(
            chunk.seq, chunk.num_new_tokens, [], num_lookahead_tokens=len(draft)
        ):
            return False
        chunk.draft_token_ids = draft
        return True

    def _proposes(self, seq: Sequence) -> bool:
        if seq.grammar is not None:
            return False  # a proposal would have to pass the grammar first: not worth it
        state = self._acceptance.get(seq.seq_id)
        return state is None or state.paused_until_step <= self.step

    def record(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        """One verification's outcome: metrics, and the request's acceptance rate."""
        stats = self._stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafted
        stats.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            stats.accepted_per_position[position] = stats.accepted_per_position.get(position, 0) + 1
        state = self._acceptance.setdefault(seq.seq_id, _Acceptance())
        w = ACCEPTANCE_EMA_WEIGHT
        state.rate = (1 - w) * state.rate + w * (num_accepted / num_drafted)
        if state.rate >= self.config.min_acceptance_rate:
            state.cool_down = FIRST_COOL_DOWN_STEPS
            return
        state.paused_until_step = self.step + state.cool_down
        state.cool_down = min(2 * state.cool_down, MAX_COOL_DOWN_STEPS)
        state.rate = INITIAL_ACCEPTANCE_RATE  # after the pause, measure afresh

    def forget(self, seq: Sequence) -> None:
        self._acceptance.pop(seq.seq_id, None)
        if self.draft is not None:
            self.draft.forget(seq)

    def take_stats(self) -> SpecDecodeStats:
        stats, self._stats = self._stats, SpecDecodeStats()
        return stats
