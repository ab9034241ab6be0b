"""How many prompt tokens a step may take while sequences decode (`--max-decode-step-ms`).

A prompt chunk shares its step with every running decode, so a large chunk is an ITL spike
for all of them. With a target, a step with decodes running takes only the prompt tokens
the step-cost model predicts fit in the target after the decodes' own cost, and at least
`min_chunk` (a KV block) so a long prompt always progresses. With no decode running the
scheduler asks for no allowance: the prompt gets the full token budget, TTFT unchanged.
"""

from __future__ import annotations

from servefleet.api.step_cost import DecodeStepTarget
from servefleet.engine.step_cost import StepCostModel


class PromptAllowance:
    """One step's prompt-token allowance: chunks take from it in scheduling order."""

    def __init__(self, seconds: float, max_tokens: int, min_chunk: int, model: StepCostModel):
        self.seconds_left = seconds
        self.tokens_left = max(max_tokens, 0)
        self.min_chunk = min_chunk
        self.model = model
        self.granted = 0

    def take(self, want: int, context: int) -> int:
        """Tokens of a chunk that wants `want` after `context` computed tokens (0: none
        this step). The step's first chunk gets at least `min_chunk`."""
        first = self.granted == 0
        fit = self.model.prompt_tokens_within(self.seconds_left, context, first)
        if first:
            fit = max(fit, self.min_chunk)
        n = max(min(want, fit, self.tokens_left), 0)
        if n:
            self.seconds_left -= self.model.chunk_seconds(n, context, first)
            self.tokens_left -= n
            self.granted += n
        return n


class ChunkBudget:
    """The scheduler's source of allowances; remembers the last one for the metrics."""

    def __init__(self, model: StepCostModel, target: DecodeStepTarget, min_chunk: int) -> None:
        self.model = model
        self.target = target
        self.min_chunk = max(min_chunk, 1)
        self.last_target_seconds = 0.0
        self.last_chunk_tokens = 0

    def allowance(self, decode_rows: int, max_tokens: int) -> PromptAllowance | None:
        """None (no limit) when off or with no decode running; `max_tokens`: what the step's
        token budget leaves after its decodes."""
        if self.target.is_off or decode_rows == 0:
            return None
        decode_step = self.model.decode_step(decode_rows)
        target = self.target.for_decode_step(decode_step)
        self.last_target_seconds = target
        return PromptAllowance(target - decode_step, max_tokens, self.min_chunk, self.model)

    def record(self, allowance: PromptAllowance | None) -> None:
        """After the step is scheduled: the chunk it took beside decodes (the metric)."""
        if allowance is not None and allowance.granted:
            self.last_chunk_tokens = allowance.granted


def chunk_budget_for(
    target: DecodeStepTarget, model: StepCostModel, min_chunk: int
) -> ChunkBudget | None:
    """`--max-decode-step-ms` as the scheduler takes it: None when off (today's chunks)."""
    return None if target.is_off else ChunkBudget(model, target, min_chunk)
