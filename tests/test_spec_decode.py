"""Speculative decoding without the model: the n-gram proposer, verification (exact and
distribution-preserving), KV roll-back and the adaptive policy."""

from __future__ import annotations

import random

import pytest
import torch
from pydantic import ValidationError

from servefleet.api.speculative import SpeculativeConfig
from servefleet.engine.kv_cache import KVCacheManager
from servefleet.engine.sampler import choose_token, draw_token, request_probs
from servefleet.engine.sampling_params import SamplingParams
from servefleet.engine.scheduler import Scheduler, SchedulerConfig
from servefleet.engine.sequence import Sequence
from servefleet.engine.spec.ngram import propose_ngram
from servefleet.engine.spec.speculator import Speculator
from servefleet.engine.spec.verify import (
    DRAFT_STREAM,
    Proposal,
    stream_uniform,
    verify_drafts,
)
from tests.test_sampler import ALPHA, chi_square_df4_p_value

BS = 4
EOS = 2


def ngram(**overrides: object) -> SpeculativeConfig:
    return SpeculativeConfig.model_validate(
        {"method": "ngram", "num_speculative_tokens": 3} | overrides
    )


def test_draft_model_is_not_a_key() -> None:
    with pytest.raises(ValidationError, match="draft_model"):
        SpeculativeConfig.model_validate(
            {"method": "ngram", "num_speculative_tokens": 2, "draft_model": "x"}
        )
    with pytest.raises(ValidationError, match="prompt_lookup_min"):
        ngram(prompt_lookup_min=5, prompt_lookup_max=3)


def test_ngram_proposes_what_followed_the_latest_match() -> None:
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 4, 6, 7, 8, 2, 3]
    # Longest suffix first: [2, 3] occurs at 1 and 6; the latest (6) is followed by 4, 6, 7.
    assert propose_ngram(tokens, 3, 1, 4) == [4, 6, 7]
    assert propose_ngram([*tokens, 4], 2, 2, 4) == [6, 7]  # [2, 3, 4] latest at 6
    assert propose_ngram([5, 6, 7], 3, 1, 3) == []  # 7 never occurred before
    assert propose_ngram([1, 1], 3, 1, 2) == [1]  # the proposal stops at the known tokens
    assert propose_ngram(tokens, 0, 1, 4) == []


def test_greedy_verification_accepts_the_argmax_prefix() -> None:
    vocab = 16
    logits = torch.full((4, vocab), -5.0)
    for row, best in enumerate([7, 8, 3, 11]):
        logits[row, best] = 5.0
    seq = Sequence([1, 2], SamplingParams(temperature=0.0), 0.0)
    tokens, _ = verify_drafts(logits.clone(), [seq], [[7, 8, 9]])
    assert tokens == [[7, 8, 3]]  # 9 rejected: the target's own token replaces it
    tokens, _ = verify_drafts(logits.clone(), [seq], [[7, 8, 3]])
    assert tokens == [[7, 8, 3, 11]]  # all accepted, plus the bonus token


def test_seeded_verification_equals_sampling_position_by_position() -> None:
    """Each emitted token is what a plain step at that position would have sampled."""
    torch.manual_seed(1)
    params = SamplingParams(temperature=1.0, top_k=6, seed=42, presence_penalty=0.4)
    for trial in range(40):
        logits = torch.randn(4, 12)
        seq = Sequence([1, 2, 3], params, 0.0, output_token_ids=[trial % 12])
        plain = []
        for row in range(4):
            plain.append(choose_token(logits[row], seq, plain))
        draft = [*plain[:2], (plain[2] + trial % 2) % 12]  # right, right, then right or wrong
        tokens, _ = verify_drafts(logits.clone(), [seq], [draft])
        accepted = 3 if draft[2] == plain[2] else 2
        assert tokens[0] == plain[: accepted + 1]


def test_verification_reports_each_accepted_tokens_logprob() -> None:
    logits = torch.randn(3, 10)
    best = logits.argmax(-1).tolist()
    seq = Sequence([1], SamplingParams(temperature=0.0, logprobs=2), 0.0)
    tokens, logprobs = verify_drafts(logits.clone(), [seq], [[best[0], best[1]]])
    assert tokens == [best]
    expected = torch.log_softmax(logits, -1)
    for row, item in enumerate(logprobs[0]):
        assert item.token_id == best[row]
        assert item.logprob == pytest.approx(float(expected[row, best[row]]))
        assert [t for t, _ in item.top] == expected[row].topk(2).indices.tolist()


def test_verification_keeps_the_target_distribution() -> None:
    """A deterministic proposal of token 3: the first emitted token still follows the target
    (accepted with probability p(3), else drawn from the rest), chi-square at ALPHA."""
    probs = torch.tensor([0.05, 0.1, 0.2, 0.25, 0.4])
    counts = [0] * 5
    draws = 20_000
    for seed in range(draws):
        seq = Sequence([1], SamplingParams(temperature=1.0, seed=seed), 0.0)
        logits = probs.log().repeat(2, 1)
        tokens, _ = verify_drafts(logits, [seq], [[3]])
        counts[tokens[0][0]] += 1
    assert chi_square_df4_p_value(counts, [float(p) * draws for p in probs]) > ALPHA, counts


def test_sampled_proposals_keep_the_target_distribution() -> None:
    """x ~ q, accepted with probability min(1, p(x)/q(x)), else redrawn from
    normalize(max(0, p - q)): over 4 000 seeds the first emitted token follows p (chi-square
    at ALPHA), and x is accepted with probability sum(min(p, q)), not p(x) of a point mass."""
    p_logits = torch.tensor([0.05, 0.1, 0.2, 0.25, 0.4]).log()
    q = torch.tensor([0.4, 0.3, 0.1, 0.1, 0.1])
    logits = torch.stack([p_logits, p_logits])
    counts, accepted = [0] * 5, 0
    draws = 4_000
    for seed in range(draws):
        seq = Sequence([1], SamplingParams(temperature=1.0, seed=seed), 0.0)
        proposal = Proposal([draw_token(q, stream_uniform(seq, DRAFT_STREAM, 0))])
        proposal.probs.append(q)
        tokens, _ = verify_drafts(logits.clone(), [seq], [proposal])
        counts[tokens[0][0]] += 1
        accepted += len(tokens[0]) == 2
    p = p_logits.exp()
    assert chi_square_df4_p_value(counts, [float(x) * draws for x in p]) > ALPHA, counts
    overlap = float(torch.minimum(p, q).sum())
    assert abs(accepted / draws - overlap) < 4 * (overlap * (1 - overlap) / draws) ** 0.5


def test_a_sampled_proposal_equal_to_the_target_is_always_accepted() -> None:
    """q == p: min(1, p/q) = 1 at every position, then the bonus token as a plain step."""
    torch.manual_seed(2)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, frequency_penalty=0.3)
    for trial in range(20):
        logits = torch.randn(4, 12)
        seq = Sequence([1, 2], params, 0.0, output_token_ids=[trial % 12])
        proposal = Proposal()
        for row in range(3):
            q = request_probs(logits[row], seq, proposal)
            proposal.probs.append(q)
            proposal.append(draw_token(q, stream_uniform(seq, DRAFT_STREAM, row)))
        tokens, _ = verify_drafts(logits.clone(), [seq], [proposal])
        assert tokens[0][:3] == proposal
        assert tokens[0][3] == choose_token(logits[3], seq, proposal)


def _scheduler(speculator: Speculator, num_blocks: int = 64) -> Scheduler:
    kv = KVCacheManager(num_blocks, BS, True)
    return Scheduler(SchedulerConfig(8, 64, 256), kv, [EOS], speculator)


def test_rejected_slots_roll_back_and_no_block_leaks() -> None:
    """Random acceptance over many steps: num_computed_tokens stops at the last accepted
    proposal, reserved blocks past the known tokens go back, and at the end every block
    is free."""
    rng = random.Random(0)
    scheduler = _scheduler(
        Speculator(ngram(disable_by_batch_size=None, min_acceptance_rate=0.0), 64)
    )
    for i in range(6):  # repetitive prompts, so the proposer always finds something
        prompt = [10 + (j % 5) for j in range(9 + i)]
        scheduler.add(Sequence(prompt, SamplingParams(max_tokens=40, ignore_eos=True), float(i)))
    drafted = 0
    for _ in range(400):
        if not scheduler.num_unfinished:
            break
        out = scheduler.schedule()
        sampled = {}
        for chunk in out.chunks:
            if not chunk.samples:
                continue
            keep = rng.randint(0, len(chunk.draft_token_ids))
            drafted += len(chunk.draft_token_ids)
            sampled[chunk.seq.seq_id] = [*chunk.draft_token_ids[:keep], 10 + rng.randint(0, 4)]
        scheduler.update(out, sampled)
        for seq in scheduler.running:
            assert seq.num_computed_tokens == seq.num_tokens - 1
            assert len(seq.block_table) <= scheduler.kv_cache.blocks_needed(seq.num_tokens)
    assert not scheduler.num_unfinished and drafted > 100
    scheduler.kv_cache.check_all_free()


def test_speculation_stops_for_large_batches_and_low_acceptance() -> None:
    speculator = Speculator(ngram(disable_by_batch_size=2, min_acceptance_rate=0.5), 64)
    scheduler = _scheduler(speculator)
    prompts = [[10, 11, 12, 10, 11, 12, 10, 11] for _ in range(3)]
    seqs = [Sequence(p, SamplingParams(max_tokens=200, ignore_eos=True), 0.0) for p in prompts]
    for seq in seqs:
        scheduler.add(seq)
    out = scheduler.schedule()  # three prefills
    scheduler.update(out, {s.seq_id: [12] for s in seqs})
    out = scheduler.schedule()
    assert all(not c.draft_token_ids for c in out.decodes)  # three > disable_by_batch_size
    scheduler.abort(seqs[2])
    scheduler.update(out, {s.seq_id: [10] for s in seqs[:2]})
    rounds_with_drafts = 0
    for _ in range(60):  # every proposal rejected: acceptance falls, proposals pause
        out = scheduler.schedule()
        rounds_with_drafts += any(c.draft_token_ids for c in out.decodes)
        scheduler.update(out, {c.seq.seq_id: [99] for c in out.decodes})
    assert 0 < rounds_with_drafts < 20
    stats = speculator.take_stats()
    assert stats.num_drafts > 0 and stats.num_accepted_tokens == 0


def test_proposals_respect_max_tokens_and_the_row_budget() -> None:
    speculator = Speculator(ngram(num_speculative_tokens=5, disable_by_batch_size=None), 6)
    scheduler = _scheduler(speculator)
    a = Sequence([10, 11, 10, 11, 10, 11, 10], SamplingParams(max_tokens=3, ignore_eos=True), 0.0)
    b = Sequence([10, 11, 12, 13, 14, 15, 16, 10], SamplingParams(max_tokens=50), 1.0)
    scheduler.add(a)
    scheduler.add(b)
    out = scheduler.schedule()
    scheduler.update(out, {a.seq_id: [11], b.seq_id: [11]})
    out = scheduler.schedule()
    drafts = {c.seq.seq_id: c.draft_token_ids for c in out.decodes}
    assert len(drafts[a.seq_id]) == 1  # two tokens left: one proposal + the step's own
    assert drafts[b.seq_id] == [12, 13, 14]  # six rows in all: 2 decodes + 1 + 3
    assert out.num_batched_tokens == 6
