"""Iteration-level scheduling: what runs in the next model step.

`schedule()` packs the decodes of running sequences and chunks of waiting
prompts under the token and sequence budgets, then lets the speculator (if any)
attach proposals to decodes; `update()` applies the step's sampled tokens. No
tensors here: the runner turns a `SchedulerOutput` into them.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from servefleet.engine.chunk_budget import ChunkBudget, PromptAllowance
from servefleet.engine.kv_cache import KVCacheManager
from servefleet.engine.sequence import FinishReason, Sequence, SequenceStatus
from servefleet.engine.spec.stats import SpecDecodeStats
from servefleet.engine.step_cost import StepShape


@dataclass(frozen=True)
class SchedulerConfig:
    """The step's budgets, taken from `EngineConfig` (whose defaults are the knob table's,
    `servefleet.api.engine_flags`) and the served context length: no defaults of its own."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int


@dataclass
class ScheduledChunk:
    seq: Sequence
    num_new_tokens: int
    num_computed_before: int
    # Speculative proposals for the positions after this decode's token: verified in the
    # same forward pass, one row each (decodes only).
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the known tokens, so it yields a token
        (never for a prefill-only sequence)."""
        if self.seq.prefill_only:
            return False
        return self.num_computed_before + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    decodes: list[ScheduledChunk] = field(default_factory=list)  # one token each
    prefills: list[ScheduledChunk] = field(default_factory=list)  # prompt chunks
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def chunks(self) -> list[ScheduledChunk]:
        return self.decodes + self.prefills

    @property
    def num_batched_tokens(self) -> int:
        """Rows of the forward pass: decodes with their proposals, then prompt chunks."""
        decode_rows = sum(1 + len(c.draft_token_ids) for c in self.decodes)
        return decode_rows + sum(c.num_new_tokens for c in self.prefills)

    @property
    def step_shape(self) -> StepShape:
        """What the step-cost model reads of this step."""
        decode_rows = sum(1 + len(c.draft_token_ids) for c in self.decodes)
        chunks = ((c.num_new_tokens, c.num_computed_before) for c in self.prefills)
        return StepShape.of(decode_rows, chunks)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills


class Speculator(Protocol):
    """What the scheduler asks of speculative decoding (`spec.speculator.Speculator`, which
    builds on this module's types, so it is named here by its shape, not imported)."""

    def attach_drafts(
        self, out: SchedulerOutput, kv_cache: KVCacheManager, limits: SchedulerConfig
    ) -> None: ...

    def record(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None: ...

    def forget(self, seq: Sequence) -> None: ...

    def take_stats(self) -> SpecDecodeStats: ...


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache: KVCacheManager,
        eos_token_ids: Iterable[int],
        speculator: Speculator | None = None,
        chunk_budget: ChunkBudget | None = None,
    ) -> None:
        self.config = config
        self.chunk_budget = chunk_budget  # None: prompt chunks up to the token budget
        self.kv_cache = kv_cache
        self.eos_token_ids = frozenset(eos_token_ids)
        self.speculator = speculator
        self.waiting: list[Sequence] = []  # sorted by Sequence.sort_key
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # ---- queue management -------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=Sequence.sort_key)

    def abort(self, seq: Sequence) -> None:
        self.finish(seq, FinishReason.ABORT)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv_cache.free(seq)
        if self.speculator is not None:
            self.speculator.forget(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---- scheduling ---------------------------------------------------------------------
    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop the KV, keep the tokens, go back to waiting."""
        self.running.remove(seq)
        self.kv_cache.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        # Running sequences first, best priority first, so preemption takes the tail:
        # the lowest-priority, latest-arrived sequence.
        self.running.sort(key=Sequence.sort_key)
        allowance = self._prompt_allowance()
        best = self._best_prompt_priority()
        scheduled: list[ScheduledChunk] = []
        budget = self._schedule_running(out, scheduled, allowance, best)
        # Then waiting prompts, unless this step already had to preempt.
        if not out.preempted:
            self._schedule_waiting(scheduled, budget, allowance, best)
        if self.chunk_budget is not None:
            self.chunk_budget.record(allowance)

        for chunk in scheduled:  # a prefill-only chunk is never a decode (no proposals)
            decode = chunk.num_new_tokens == 1 and not chunk.seq.prefill_only
            (out.decodes if decode else out.prefills).append(chunk)
        if self.speculator is not None and out.decodes:
            self.speculator.attach_drafts(out, self.kv_cache, self.config)
        return out

    def _best_prompt_priority(self) -> int | None:
        """The best (lowest) priority of the prompts waiting or mid-prefill. Prompts of a
        worse priority (batch beside interactive) sit out this step: neither started nor
        given chunks, their KV kept; decodes of every priority still ride along, one row
        each. So an interactive request's time to first token is its own prefill plus, at
        most, the one step that was running when it arrived."""
        best = self.waiting[0].priority if self.waiting else None  # sorted: priority first
        for seq in self.running:
            if not _decodes_next(seq) and (best is None or seq.priority < best):
                best = seq.priority
        return best

    def _prompt_allowance(self) -> PromptAllowance | None:
        """With `chunk_budget`, the step's prompt tokens beside the running decodes, which
        keep their rows: prompt tokens get only what the token budget leaves after them."""
        if self.chunk_budget is None:
            return None
        decodes = sum(1 for seq in self.running if _decodes_next(seq))
        limit = self.config.max_num_batched_tokens - decodes
        return self.chunk_budget.allowance(decodes, limit)

    def _schedule_running(
        self,
        out: SchedulerOutput,
        scheduled: list[ScheduledChunk],
        allowance: PromptAllowance | None,
        best_prompt: int | None,
    ) -> int:
        """Schedule running sequences (preempting from the tail when KV runs out); return
        the token budget left. Prompts of a priority worse than `best_prompt` wait."""
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if best_prompt is not None and seq.priority > best_prompt and not _decodes_next(seq):
                i += 1
                continue
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if allowance is not None and not _decodes_next(seq):
                num_new = allowance.take(num_new, seq.num_computed_tokens)
                if not num_new:  # a prompt past this step's allowance waits for the next
                    i += 1
                    continue
            before = seq.num_computed_tokens
            while not self.kv_cache.allocate(seq, num_new, []):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                scheduled.append(ScheduledChunk(seq, num_new, before))
                budget -= num_new
                i += 1
        return budget

    def _schedule_waiting(
        self,
        scheduled: list[ScheduledChunk],
        budget: int,
        allowance: PromptAllowance | None,
        best_prompt: int | None,
    ) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if best_prompt is not None and seq.priority > best_prompt:
                break  # sorted by priority: only worse prompts are left
            cached = self.kv_cache.find_cached_prefix(seq)
            hit_tokens = len(cached) * self.kv_cache.block_size
            num_new = min(seq.num_tokens - seq.num_computed_tokens - hit_tokens, budget)
            if allowance is not None:
                num_new = allowance.take(num_new, seq.num_computed_tokens + hit_tokens)
                if not num_new:
                    break
            if not self.kv_cache.allocate(seq, num_new, cached):
                break
            self.kv_cache.record_lookup(seq, hit_tokens)
            self.waiting.pop(0)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledChunk(seq, num_new, seq.num_computed_tokens))
            budget -= num_new

    def update(self, out: SchedulerOutput, sampled: Mapping[int, list[int]]) -> list[Sequence]:
        """Advance computed counters, append sampled tokens (by seq_id); return newly finished.

        A decode with proposals yields the accepted proposals and one token more; its KV is
        valid up to the last accepted proposal, so `num_computed_tokens` stops there (the
        rejected positions are recomputed later) and the blocks reserved past the known
        tokens go back to the pool.
        """
        finished = []
        for chunk in out.chunks:
            seq = chunk.seq
            if seq.is_finished:
                continue  # aborted while the step ran
            tokens = sampled.get(seq.seq_id, [])
            accepted = max(len(tokens) - 1, 0)
            seq.num_computed_tokens = chunk.num_computed_before + chunk.num_new_tokens + accepted
            if seq.prefill_only and seq.num_computed_tokens >= seq.num_tokens:
                self.finish(seq, FinishReason.LENGTH)  # its KV is all written: nothing to sample
                finished.append(seq)
                continue
            if chunk.draft_token_ids and self.speculator is not None:
                self.speculator.record(seq, len(chunk.draft_token_ids), accepted)
            for token in tokens:
                seq.append_token(token)
                reason = self._finish_reason(seq, token)
                if reason is not None:
                    self.finish(seq, reason)
                    finished.append(seq)
                    break
            if chunk.draft_token_ids and not seq.is_finished:
                self.kv_cache.trim(seq)
        return finished

    def _finish_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        params = seq.params
        if not params.ignore_eos and token in self.eos_token_ids:
            return FinishReason.STOP
        if token in params.stop_token_ids:
            return FinishReason.STOP
        if seq.grammar is not None and seq.grammar.is_terminated():
            return FinishReason.STOP  # the structured output is complete
        if seq.num_output_tokens >= params.max_tokens:
            return FinishReason.LENGTH
        if seq.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None


def _decodes_next(seq: Sequence) -> bool:
    """The sequence's next chunk is one decode row (prompt fully computed)."""
    return seq.num_tokens - seq.num_computed_tokens == 1 and not seq.prefill_only
