"""Token selection from logits: penalties, temperature, top-k/top-p, counter-based draws.

A sampled token is a pure function of the row's logits and of (seed, output position):
the uniform behind output position j of a sequence is `counter_uniform(seed, j)`, so it
depends neither on what else is in the batch nor on how many draws came before. That is
what makes a seeded request reproducible in any batch, after preemption, when a stream
is resumed on another replica with its delivered tokens, and what lets speculative
decoding verify a proposal by sampling each position exactly as a plain step would.
Greedy rows share one argmax; rows of constrained sequences get their grammar's token
mask first (`structured.masking`); the others are not touched by it.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from servefleet.engine.sampling_params import SamplingParams
from servefleet.engine.sequence import Sequence
from servefleet.engine.structured.masking import advance_grammars, apply_grammar_masks

_MASK64 = (1 << 64) - 1


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def _splitmix64(value: int) -> int:
    """SplitMix64's finaliser: a bijective 64-bit mix with full avalanche."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def counter_uniform(seed: int, position: int) -> float:
    """The uniform in [0, 1) behind output position `position` of a request seeded `seed`."""
    mixed = _splitmix64(_splitmix64(seed & _MASK64) ^ (position & _MASK64))
    return (mixed >> 11) * 2.0**-53


def draw_token(probs: torch.Tensor, uniform: float) -> int:
    """Inverse CDF: the first token whose cumulative probability exceeds `uniform`.

    Float64 so that the 49k-entry running sum keeps every token's share; zero-probability
    tokens cannot be chosen (their step of the CDF is empty).
    """
    cdf = probs.to(torch.float64).cumsum(-1)
    target = torch.tensor([uniform * float(cdf[-1])], dtype=torch.float64)
    return int(torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[-1] - 1))


def apply_penalties(
    logits: torch.Tensor, output_ids: Seq[int], params: SamplingParams
) -> torch.Tensor:
    if not output_ids:
        return logits
    ids = torch.tensor(output_ids, dtype=torch.long)
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


def is_plain_greedy(params: SamplingParams) -> bool:
    """Rows whose token is the raw argmax: the batch's one argmax serves them."""
    return params.greedy and not params.changes_logits


# ---- the one logits chain: every path that samples for a request goes through these two,
# so a new sampling parameter cannot reach plain steps and miss speculative verification
# or the draft's proposals (as gpt-fast's `logits_to_probs` serves both).
def request_logits(row_logits: torch.Tensor, seq: Sequence, pending: Seq[int] = ()) -> torch.Tensor:
    """The row as the request shapes it before any choice: logit bias, then penalties over
    its output so far and `pending` (tokens taken as already output)."""
    params = seq.params
    row = apply_logit_bias(row_logits, params.logit_bias)
    if params.needs_penalties:
        row = apply_penalties(row, [*seq.output_token_ids, *pending], params)
    return row


def request_probs(row_logits: torch.Tensor, seq: Sequence, pending: Seq[int] = ()) -> torch.Tensor:
    """The distribution a sampled request draws output position len(output) + len(pending)
    from: `request_logits`, then temperature and top-k/top-p (`target_probs`)."""
    return target_probs(request_logits(row_logits, seq, pending), seq.params)


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k/top-p, then softmax: the tail of the chain."""
    filtered = filter_top_k_top_p(logits / params.temperature, params.top_k, params.top_p)
    return torch.softmax(filtered, -1)


def sampling_seed(seq: Sequence) -> int:
    """The request's seed; the engine gives every request one at admission, so the
    sequence id only seeds sequences built inside the engine (warm-up)."""
    return seq.params.seed if seq.params.seed is not None else seq.seq_id


def choose_token(row_logits: torch.Tensor, seq: Sequence, pending: Seq[int] = ()) -> int:
    """The token for output position len(seq.output_token_ids) + len(pending).

    `pending` are tokens taken as already output (speculative verification): they count
    toward penalties and move the draw's position, exactly as if they had been appended.
    Greedy: the argmax of `request_logits`; sampled: a draw from `request_probs`.
    """
    if seq.params.greedy:
        return int(torch.argmax(request_logits(row_logits, seq, pending)))
    position = seq.num_output_tokens + len(pending)
    uniform = counter_uniform(sampling_seed(seq), position)
    return draw_token(request_probs(row_logits, seq, pending), uniform)


def token_logprobs(
    logits: torch.Tensor, rows: Seq[int], token_ids: Seq[int], num_top: Seq[int]
) -> list[TokenLogprobs]:
    """Logprobs of the chosen tokens under the raw logits (vLLM's default), with top-k."""
    if not rows:
        return []
    all_lp = torch.log_softmax(logits[list(rows)], dim=-1)
    out = []
    for j, (tok, k) in enumerate(zip(token_ids, num_top, strict=True)):
        top: list[tuple[int, float]] = []
        if k > 0:
            values, indices = torch.topk(all_lp[j], k)
            top = list(zip(indices.tolist(), values.tolist(), strict=True))
        out.append(TokenLogprobs(tok, float(all_lp[j, tok]), top))
    return out


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:
    """logits: float32 [N, vocab], one row per sequence in `seqs` (masked in place)."""
    apply_grammar_masks(logits, seqs)
    # max(dim).indices is argmax (first maximum on ties) at half the cost on CPU.
    token_ids = logits.max(dim=-1).indices.tolist()
    for row, seq in enumerate(seqs):
        if not is_plain_greedy(seq.params):
            token_ids[row] = choose_token(logits[row], seq)
    advance_grammars(seqs, token_ids)
    logprobs: list[TokenLogprobs | None] = [None] * len(seqs)
    want = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    computed = token_logprobs(
        logits, want, [token_ids[i] for i in want], [seqs[i].params.logprobs or 0 for i in want]
    )
    for row, lp in zip(want, computed, strict=True):
        logprobs[row] = lp
    return SampleResult(token_ids, logprobs)
