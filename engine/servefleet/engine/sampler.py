"""Token selection from logits: penalties, temperature, top-k/top-p, seeded draws.

Greedy rows share one argmax; only rows that sample pay for softmax and their
own generator, which is what makes a seeded request reproducible whatever else
is in the batch. Rows of constrained sequences get their grammar's token mask
first (`structured.masking`); the others are not touched by it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from servefleet.engine.sequence import Sequence
from servefleet.engine.structured.masking import advance_grammars, apply_grammar_masks


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def apply_penalties(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    params = seq.params
    if not seq.output_token_ids:
        return logits
    ids = torch.tensor(seq.output_token_ids, dtype=torch.long)
    counts = torch.bincount(ids, minlength=logits.shape[-1])[: logits.shape[-1]].to(logits.dtype)
    logits = logits - params.frequency_penalty * counts
    return logits - params.presence_penalty * (counts > 0).to(logits.dtype)


def apply_logit_bias(logits: torch.Tensor, bias: tuple[tuple[int, float], ...]) -> torch.Tensor:
    """OpenAI's logit_bias: added to the logits before penalties, temperature and top-k/p."""
    if not bias:
        return logits
    ids = torch.tensor([t for t, _ in bias], dtype=torch.long)
    values = torch.tensor([b for _, b in bias], dtype=logits.dtype)
    return logits.index_add(0, ids, values)


def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, -1).cumsum(-1)
        drop = cumulative - torch.softmax(sorted_logits, -1) >= top_p  # keep the first over p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(0, order, sorted_logits)
    return logits


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:
    """logits: float32 [N, vocab], one row per sequence in `seqs` (masked in place)."""
    apply_grammar_masks(logits, seqs)
    # max(dim).indices is argmax (first maximum on ties) at half the cost on CPU.
    token_ids = logits.max(dim=-1).indices.tolist()
    for row, seq in enumerate(seqs):
        params = seq.params
        if params.greedy and not params.needs_penalties and not params.logit_bias:
            continue
        row_logits = apply_logit_bias(logits[row], params.logit_bias)
        if params.needs_penalties:
            row_logits = apply_penalties(row_logits, seq)
        if params.greedy:
            token_ids[row] = int(torch.argmax(row_logits))
            continue
        row_logits = filter_top_k_top_p(row_logits / params.temperature, params.top_k, params.top_p)
        probs = torch.softmax(row_logits, -1)
        token_ids[row] = int(torch.multinomial(probs, 1, generator=seq.generator))
    advance_grammars(seqs, token_ids)
    logprobs: list[TokenLogprobs | None] = [None] * len(seqs)
    want = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    if want:
        all_lp = torch.log_softmax(logits[want], dim=-1)
        for j, row in enumerate(want):
            k = seqs[row].params.logprobs or 0
            tok = token_ids[row]
            top: list[tuple[int, float]] = []
            if k > 0:
                values, indices = torch.topk(all_lp[j], k)
                top = list(zip(indices.tolist(), values.tolist(), strict=True))
            logprobs[row] = TokenLogprobs(tok, float(all_lp[j, tok]), top)
    return SampleResult(token_ids, logprobs)
