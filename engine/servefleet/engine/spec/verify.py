"""Verification: the accepted prefix of a proposal, from one forward pass's logits.

Row i of a sequence's rows holds the target's logits for output position j + i (j: its
tokens so far). Each row is sampled with the counter-based draw of its own position, the
proposal taken as already output, and the proposal is accepted while the sampled token
equals it; the first mismatch (or the row after the last proposal) is the step's extra
token. For a deterministic proposer this is rejection sampling (accept with probability
p(proposal), else draw from p without it), and since every row samples exactly what a
plain step at that position would, greedy and seeded outputs are identical with and
without speculation.
"""

from __future__ import annotations

import torch

from servefleet.engine.sampler import (
    TokenLogprobs,
    choose_token,
    is_plain_greedy,
    token_logprobs,
)
from servefleet.engine.sequence import Sequence
from servefleet.engine.structured.masking import advance_grammars, apply_grammar_masks


def accept_prefix(
    logits: torch.Tensor, first_row: int, argmax: list[int], seq: Sequence, draft: list[int]
) -> list[int]:
    """Tokens of one sequence: the accepted proposals, then one sampled token."""
    tokens: list[int] = []
    greedy = is_plain_greedy(seq.params)
    for i in range(len(draft) + 1):
        row = first_row + i
        token = argmax[row] if greedy else choose_token(logits[row], seq, tokens)
        tokens.append(token)
        if i == len(draft) or token != draft[i]:
            break
    return tokens


def verify_drafts(
    logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]]
) -> tuple[list[list[int]], list[list[TokenLogprobs]]]:
    """logits: [sum(1 + len(draft)), vocab], each sequence's rows together, in order.

    Returns each sequence's new tokens and, where asked for, their logprobs.
    """
    first_rows = [0]
    for draft in drafts[:-1]:
        first_rows.append(first_rows[-1] + 1 + len(draft))
    if any(s.grammar is not None for s in seqs):  # constrained sequences never have drafts
        index = torch.tensor(first_rows)
        heads = logits.index_select(0, index)
        apply_grammar_masks(heads, seqs)
        logits.index_copy_(0, index, heads)
    argmax = logits.max(dim=-1).indices.tolist()
    tokens = [
        accept_prefix(logits, row, argmax, seq, draft)
        for row, seq, draft in zip(first_rows, seqs, drafts, strict=True)
    ]
    advance_grammars(seqs, [t[0] for t in tokens])
    logprobs: list[list[TokenLogprobs]] = []
    for row, seq, new in zip(first_rows, seqs, tokens, strict=True):
        k = seq.params.logprobs
        rows = range(row, row + len(new)) if k is not None else range(0)
        logprobs.append(token_logprobs(logits, list(rows), new, [k or 0] * len(rows)))
    return tokens, logprobs
