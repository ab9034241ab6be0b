"""The counter-based sampler: draws are a pure function of (seed, position) and follow
the target distribution (a chi-square test at a stated significance, not by eye)."""

from __future__ import annotations

import math

import torch

from servefleet.engine.sampler import choose_token, counter_uniform, sample, target_probs
from servefleet.engine.sampling_params import SamplingParams
from servefleet.engine.sequence import Sequence

# Significance of the goodness-of-fit tests: a correct sampler fails one in a thousand runs
# of a given seed set; the seeds below are fixed, so the outcome is too.
ALPHA = 1e-3
NUM_DRAWS = 20_000


def chi_square_df4_p_value(observed: list[int], expected: list[float]) -> float:
    """P(X >= statistic) for chi-square with 4 degrees of freedom (5 categories):
    exp(-x/2) * (1 + x/2), the closed form for even degrees of freedom."""
    assert len(observed) == len(expected) == 5
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected, strict=True))
    return math.exp(-stat / 2) * (1 + stat / 2)


def seq_with(params: SamplingParams, output: list[int] | None = None) -> Sequence:
    return Sequence([1, 2, 3], params, 0.0, output_token_ids=list(output or []))


def draw_counts(logits: torch.Tensor, params: SamplingParams, vocab: int) -> list[int]:
    """One draw per output position 0..NUM_DRAWS-1 of one seeded sequence."""
    seq = seq_with(params)
    counts = [0] * vocab
    for position in range(NUM_DRAWS):
        counts[choose_token(logits, seq, pending=[0] * position)] += 1
    return counts


def test_counter_uniform_is_a_pure_function_of_seed_and_position() -> None:
    draws = [counter_uniform(7, j) for j in range(1000)]
    assert draws == [counter_uniform(7, j) for j in range(1000)]
    assert all(0.0 <= u < 1.0 for u in draws)
    assert len(set(draws)) == 1000
    assert draws[:50] != [counter_uniform(8, j) for j in range(50)]
    assert abs(sum(draws) / len(draws) - 0.5) < 0.05


def test_draws_follow_the_target_distribution() -> None:
    probs = torch.tensor([0.05, 0.1, 0.2, 0.25, 0.4])
    logits = probs.log()
    params = SamplingParams(temperature=1.0, seed=2024)
    counts = draw_counts(logits, params, 5)
    expected = [float(p) * NUM_DRAWS for p in probs]
    assert chi_square_df4_p_value(counts, expected) > ALPHA, counts


def test_the_test_rejects_a_wrong_distribution() -> None:
    """The same statistic against a slightly different target: the test has power."""
    probs = torch.tensor([0.05, 0.1, 0.2, 0.25, 0.4])
    counts = draw_counts(probs.log(), SamplingParams(temperature=1.0, seed=2024), 5)
    wrong = [0.06, 0.1, 0.2, 0.24, 0.4]
    assert chi_square_df4_p_value(counts, [p * NUM_DRAWS for p in wrong]) < ALPHA


def test_draws_follow_the_filtered_distribution() -> None:
    """top_k and temperature: filtered tokens never come out, the rest keep their ratios."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0])
    params = SamplingParams(temperature=0.7, top_k=5, seed=99)
    target = target_probs(logits, params)
    assert torch.count_nonzero(target) == 5
    counts = draw_counts(logits, params, 7)
    assert counts[5] == counts[6] == 0
    expected = [float(p) * NUM_DRAWS for p in target[:5]]
    assert chi_square_df4_p_value(counts[:5], expected) > ALPHA, counts


def test_a_row_draws_the_same_token_whatever_the_batch() -> None:
    torch.manual_seed(0)
    vocab = 300
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=5)
    target = torch.randn(vocab)
    alone = [
        sample(target.clone()[None], [seq_with(params, [4] * j)]).token_ids[0] for j in range(30)
    ]
    for j in range(30):
        others = [seq_with(SamplingParams(temperature=1.0, seed=s)) for s in range(3)]
        batch = torch.randn(4, vocab) * 3
        batch[2] = target
        seqs = [others[0], others[1], seq_with(params, [4] * j), others[2]]
        torch.manual_seed(j)  # global RNG state must not matter either
        assert sample(batch, seqs).token_ids[2] == alone[j]
    assert len(set(alone)) > 5  # positions draw differently


def test_pending_tokens_count_as_output() -> None:
    """Verification samples position j with j-1 proposed tokens pending: the same token as
    a sequence that already output them (penalties included)."""
    params = SamplingParams(temperature=0.8, seed=3, frequency_penalty=0.5, presence_penalty=0.3)
    logits = torch.randn(64)
    for prefix in ([], [5], [5, 9, 9]):
        appended = seq_with(params, [7, *prefix])
        pending = seq_with(params, [7])
        assert choose_token(logits, appended) == choose_token(logits, pending, prefix)
