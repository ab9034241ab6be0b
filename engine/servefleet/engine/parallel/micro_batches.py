"""A step's plan cut into micro-batches of whole sequences, so pipeline stages overlap.

With --pipeline-micro-batches M a step is cut into up to M micro-batches (M = P, the
stages, fills the pipeline): stage s runs micro-batch m while
stage s + 1 runs m - 1 (GPipe's schedule, inside one step; the scheduler still sees one
step). A cut falls only between sequences (a decode row, or a whole prompt chunk), so
each micro-batch is a smaller step of its own: its rows' attention reads only its own
sequences' KV, and every rank cuts the same plan the same way. The cuts balance tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

from servefleet.engine.attention import AttentionMetadata, PrefillSpan
from servefleet.engine.parallel.plan import StepPlan


@dataclass
class MicroBatch:
    first: int  # the step's token rows [first, end) this micro-batch holds
    end: int
    plan: StepPlan  # those rows as a step of their own (rows and logit rows from 0)


def _units(meta: AttentionMetadata, tokens: int) -> list[int]:
    """Where a cut may fall: the end row of every decode row and prompt chunk."""
    ends = list(range(1, meta.num_decodes + 1))
    ends += [span.end for span in meta.prefills]
    assert not ends or ends[-1] == tokens, "plan rows: decodes, then prompt chunks, in order"
    return ends


def cut_points(meta: AttentionMetadata, tokens: int, parts: int) -> list[int]:
    """Row boundaries [0, ..., tokens] of up to `parts` micro-batches, by token balance."""
    ends = _units(meta, tokens)
    cuts = [0]
    for k in range(1, min(parts, len(ends))):
        target = k * tokens / parts
        best = min((e for e in ends if e > cuts[-1]), key=lambda e: abs(e - target))
        if best < tokens:
            cuts.append(best)
    return [*cuts, tokens]


def micro_batches(plan: StepPlan, parts: int) -> list[MicroBatch]:
    """`plan` as up to `parts` micro-batches (one, unchanged, when it cannot be cut)."""
    tokens = plan.ids.numel()
    cuts = cut_points(plan.meta, tokens, parts) if parts > 1 else [0, tokens]
    if len(cuts) == 2:
        return [MicroBatch(0, tokens, plan)]
    return [MicroBatch(a, b, _slice(plan, a, b)) for a, b in pairwise(cuts)]


def _slice(plan: StepPlan, first: int, end: int) -> StepPlan:
    meta = plan.meta
    sub = AttentionMetadata(slot_mapping=meta.slot_mapping[first:end], block_size=meta.block_size)
    decodes = max(0, min(end, meta.num_decodes) - first)
    if decodes:
        assert meta.decode_block_tables is not None and meta.decode_context_lens is not None
        sub.num_decodes = decodes
        sub.decode_block_tables = meta.decode_block_tables[first : first + decodes]
        sub.decode_context_lens = meta.decode_context_lens[first : first + decodes]
    sub.prefills = [
        PrefillSpan(s.start - first, s.end - first, s.num_cached, s.block_table)
        for s in meta.prefills
        if first <= s.start and s.end <= end
    ]
    rows = [r - first for r in plan.logit_rows if first <= r < end]
    return StepPlan(plan.ids[first:end], plan.positions[first:end], sub, rows)
