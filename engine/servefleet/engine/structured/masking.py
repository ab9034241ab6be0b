"""Token bitmasks on the logits of constrained rows, and matchers advanced per token.

Only rows whose sequence has a grammar are touched: a step with no constrained sequence
does no work here beyond one scan of the batch, and the unconstrained rows of a mixed batch
are neither masked nor copied (`bench/servefleet/bench/grammar_masks.py` measures both).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import torch

from servefleet.engine.sequence import Sequence

if TYPE_CHECKING:
    import xgrammar as xgr

# xgrammar (and the transformers it imports: seconds of CPU) loads at the first constrained
# step, not with the engine: a start-up imports only what every request needs.
_batch_matcher: xgr.BatchGrammarMatcher | None = None


def _filler() -> xgr.BatchGrammarMatcher:
    global _batch_matcher
    if _batch_matcher is None:
        import xgrammar as xgr

        _batch_matcher = xgr.BatchGrammarMatcher()
    return _batch_matcher


def apply_grammar_masks(logits: torch.Tensor, seqs: Seq[Sequence]) -> None:
    """Set the logits of tokens a row's grammar forbids to -inf, in place (float32 [N, V])."""
    rows = [i for i, s in enumerate(seqs) if s.grammar is not None]
    if not rows:
        return
    import xgrammar as xgr

    matchers = [m for s in seqs if (m := s.grammar) is not None]
    bitmask = xgr.allocate_token_bitmask(len(seqs), logits.shape[-1])
    if len(rows) == 1:
        matchers[0].fill_next_token_bitmask(bitmask, rows[0])
    else:
        _filler().batch_fill_next_token_bitmask(matchers, bitmask, indices=rows)
    xgr.apply_token_bitmask_inplace(logits, bitmask, indices=rows)


def advance_grammars(seqs: Seq[Sequence], token_ids: Seq[int]) -> None:
    """Feed each constrained sequence's sampled token to its matcher."""
    for seq, token in zip(seqs, token_ids, strict=True):
        grammar = seq.grammar
        if grammar is not None and not grammar.is_terminated():
            # A masked draw is always accepted; a stop token also ends the grammar.
            grammar.accept_token(token)


def grammar_finished(seq: Sequence) -> bool:
    """True once the sequence's grammar has accepted a stop token: nothing may follow."""
    return seq.grammar is not None and seq.grammar.is_terminated()
