"""Verification: the accepted prefix of a proposal, from one forward pass's logits.

Row i of a sequence's rows holds the target's logits for output position j + i (j: its
tokens so far). A point-mass proposal (greedy draft, n-gram) is accepted while the row's
own counter-based draw equals it; the first mismatch (or the row after the last proposal)
is the step's extra token. That is rejection sampling with a one-hot q (accept with
probability p(proposal), else draw from p without it), and since every row samples exactly
what a plain step would, greedy and seeded outputs are identical with and without it.

A sampled proposal x ~ q (a draft model at temperature > 0, `Proposal.probs`) goes through
standard speculative sampling (Leviathan et al.): accepted with probability
min(1, p(x) / q(x)), else replaced by a draw from normalize(max(0, p - q)); outputs follow p
exactly, and a draft close to the target is accepted far more often than its argmax would
be. Its uniforms are counter-based too, on streams of their own (`stream_uniform`): a seeded
request stays reproducible, though no longer token-identical to a run without speculation.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from servefleet.engine.sampler import (
    TokenLogprobs,
    choose_token,
    counter_uniform,
    draw_token,
    is_plain_greedy,
    request_probs,
    sampling_seed,
    token_logprobs,
)
from servefleet.engine.sequence import Sequence
from servefleet.engine.structured.masking import advance_grammars, apply_grammar_masks

# Seeds of the draws speculative sampling adds, apart from the target's own (stream 0).
DRAFT_STREAM = 0x5BD1E995D6E8FEB8  # the draft's proposal at a position
ACCEPT_STREAM = 0x2545F4914F6CDD1D  # accepting it
RESIDUAL_STREAM = 0x9FB21C651E98DF25  # the replacement after a rejection


class Proposal(list[int]):
    """Proposed tokens and, when the draft sampled them, the distributions q they were
    drawn from (one [vocab] row each); with no rows, a point mass (argmax, n-gram)."""

    __slots__ = ("probs",)

    def __init__(self, tokens: Iterable[int] = ()) -> None:
        super().__init__(tokens)
        self.probs: list[torch.Tensor] = []


def stream_uniform(seq: Sequence, stream: int, position: int) -> float:
    """The uniform of `stream` behind output position `position`: a pure function of the
    request's seed and the position, like the target's own draws."""
    return counter_uniform(sampling_seed(seq) ^ stream, position)


def _speculative_sample(
    logits: torch.Tensor, first_row: int, seq: Sequence, draft: Proposal
) -> list[int]:
    """Accept x with probability min(1, p(x)/q(x)); on the first rejection draw from
    normalize(max(0, p - q)) and stop; all accepted: one more token drawn from p."""
    tokens: list[int] = []
    for i, (proposal, q) in enumerate(zip(draft, draft.probs, strict=True)):
        p = request_probs(logits[first_row + i], seq, tokens)
        position = seq.num_output_tokens + i
        if stream_uniform(seq, ACCEPT_STREAM, position) * float(q[proposal]) < float(p[proposal]):
            tokens.append(proposal)
            continue
        residual = (p.double() - q.double()).clamp_(min=0.0)
        if float(residual.sum()) <= 0.0:  # p == q: a rejection of probability zero
            residual = p
        tokens.append(draw_token(residual, stream_uniform(seq, RESIDUAL_STREAM, position)))
        return tokens
    tokens.append(choose_token(logits[first_row + len(draft)], seq, tokens))
    return tokens


def accept_prefix(
    logits: torch.Tensor, first_row: int, argmax: list[int], seq: Sequence, draft: list[int]
) -> list[int]:
    """Tokens of one sequence: the accepted proposals, then one sampled token."""
    if isinstance(draft, Proposal) and draft.probs and not seq.params.greedy:
        return _speculative_sample(logits, first_row, seq, draft)
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
