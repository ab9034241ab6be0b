"""Draft-model speculation on tiny random models, through the scheduler and runner (no
engine thread): the config's spelling, the vocabulary check, exact greedy outputs with
KV roll-back and no leaks, and the target distribution kept under sampling."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from pydantic import ValidationError

from servefleet.api.speculative import SpeculativeConfig
from servefleet.engine.attention import AttentionMetadata, PrefillSpan
from servefleet.engine.config import EngineSettingsError
from servefleet.engine.kv_cache import KVCacheManager
from servefleet.engine.model.config import ModelConfig
from servefleet.engine.model.kv_layout import allocate_kv_cache
from servefleet.engine.model.llama import LlamaForCausalLM
from servefleet.engine.model.loader import LoadedModel
from servefleet.engine.runner import ModelRunner
from servefleet.engine.sampling_params import SamplingParams
from servefleet.engine.scheduler import Scheduler, SchedulerConfig
from servefleet.engine.sequence import Sequence
from servefleet.engine.spec.draft import DraftProposer
from servefleet.engine.spec.draft_setup import build_draft_proposer, check_same_vocabulary
from servefleet.engine.spec.speculator import Speculator
from tests.test_sampler import ALPHA, chi_square_df4_p_value

TINY = ModelConfig(
    architecture="llama", vocab_size=40, hidden_size=64, intermediate_size=96, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256,
)  # fmt: skip
BS = 4
NUM_BLOCKS = 4096
CPU = torch.device("cpu")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def random_model(
    seed: int, scale: float = 0.3, like: LlamaForCausalLM | None = None
) -> LlamaForCausalLM:
    """Random weights; with `like`, that model's weights plus noise (a draft that mostly,
    not always, agrees with it)."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(TINY)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if like is None:
                p.normal_(0, scale)
                if "norm" in name:
                    p.fill_(1.0)
            else:
                p.copy_(dict(like.named_parameters())[name] + torch.randn_like(p) * scale)
    model._build_rope()
    return model.eval()


def loaded(model: LlamaForCausalLM, tokenizer: object = None) -> LoadedModel:
    return LoadedModel(model, model.config, tokenizer, None, "tiny")  # type: ignore[arg-type]


def draft_config(**overrides: object) -> SpeculativeConfig:
    keys = {"method": "draft_model", "model": "tiny", "num_speculative_tokens": 3}
    return SpeculativeConfig.model_validate(
        keys | {"disable_by_batch_size": None, "min_acceptance_rate": 0.0} | overrides
    )


def make_scheduler(
    target: LlamaForCausalLM,
    draft: LlamaForCausalLM | None,
    config: SpeculativeConfig,
    sample_proposals: bool = True,
) -> tuple[Scheduler, ModelRunner]:
    speculator = None
    if draft is not None:
        caches = allocate_kv_cache(TINY, NUM_BLOCKS, BS, torch.float32, CPU)
        manager = KVCacheManager(NUM_BLOCKS, BS, False)
        proposer = DraftProposer(draft, caches, manager, CPU, sample_proposals=sample_proposals)
        speculator = Speculator(config, 4096, proposer)
    kv = allocate_kv_cache(TINY, NUM_BLOCKS, BS, torch.float32, CPU)
    scheduler = Scheduler(
        SchedulerConfig(512, 4096, 256), KVCacheManager(NUM_BLOCKS, BS), [], speculator
    )
    return scheduler, ModelRunner(target, kv, BS, CPU)


def run(scheduler: Scheduler, runner: ModelRunner, seqs: list[Sequence]) -> list[list[int]]:
    """The engine loop's schedule -> execute -> update, to the end of every sequence."""
    for seq in seqs:
        scheduler.add(seq)
    while scheduler.num_unfinished:
        out = scheduler.schedule()
        scheduler.update(out, runner.execute(out).token_by_seq_id())
    return [s.output_token_ids for s in seqs]


def prompts(count: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, 40, (3 + 5 * i % 17,), generator=gen).tolist() for i in range(count)]


def test_the_config_takes_vllms_draft_model_spelling() -> None:
    spelled = {"method": "draft_model", "model": "d.gguf", "num_speculative_tokens": 4}
    assert SpeculativeConfig.model_validate(spelled).model == "d.gguf"
    implied = SpeculativeConfig.model_validate({"model": "d.gguf", "num_speculative_tokens": 4})
    assert implied.method == "draft_model"
    with pytest.raises(ValidationError, match="needs `model`"):
        SpeculativeConfig.model_validate({"method": "draft_model", "num_speculative_tokens": 2})
    with pytest.raises(ValidationError, match="applies to method draft_model"):
        SpeculativeConfig.model_validate(
            {"method": "ngram", "model": "d.gguf", "num_speculative_tokens": 2}
        )
    with pytest.raises(ValueError, match="draft proposer"):
        Speculator(draft_config(), 64)


def test_a_draft_of_another_vocabulary_is_refused(smollm2) -> None:
    tiny = loaded(random_model(0), smollm2.tokenizer)
    with pytest.raises(EngineSettingsError, match=r"40 token ids.*49152.*share a tokenizer"):
        check_same_vocabulary(tiny, smollm2)
    with pytest.raises(EngineSettingsError, match=r"49152 token ids.*40"):
        build_draft_proposer(smollm2, tiny, 8, BS, torch.float32)


@pytest.mark.parametrize("noise", [0.0, 0.05])
def test_greedy_outputs_are_exact_alone_and_batched_and_blocks_come_back(noise: float) -> None:
    """noise 0: the target is its own draft, so (nearly) every proposal is accepted;
    noise 0.05: a draft that is sometimes wrong, so roll-back runs too."""
    target = random_model(1)
    draft = target if noise == 0.0 else random_model(2, noise, like=target)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    texts = prompts(6)
    plain = run(
        *make_scheduler(target, None, draft_config()), [Sequence(p, greedy, 0.0) for p in texts]
    )
    for batched in (False, True):
        scheduler, runner = make_scheduler(target, draft, draft_config())
        seqs = [Sequence(p, greedy, float(i)) for i, p in enumerate(texts)]
        out = (
            run(scheduler, runner, seqs)
            if batched
            else [run(scheduler, runner, [s])[0] for s in seqs]
        )
        assert out == plain
        assert scheduler.speculator is not None and scheduler.speculator.draft is not None
        stats = scheduler.speculator.take_stats()
        rate = stats.num_accepted_tokens / stats.num_draft_tokens
        if noise == 0.0:
            assert rate > 0.95, rate
        else:
            assert 0.05 < rate < 0.95, rate  # both accepting and rolling back
        scheduler.kv_cache.check_all_free()
        scheduler.speculator.draft.check_all_free()


def test_seeded_sampling_with_argmax_proposals_equals_a_plain_run() -> None:
    """The default (`draft_proposals: argmax`) keeps a seeded answer a pure function of
    (seed, position): alone, batched and without speculation alike, which is what lets the
    gateway continue a sampled stream on another replica token for token."""
    assert draft_config().draft_proposals == "argmax"
    target = random_model(1)
    draft = random_model(2, 0.05, like=target)
    texts = prompts(5)

    def seqs() -> list[Sequence]:
        return [
            Sequence(p, SamplingParams(max_tokens=20, temperature=0.9, seed=7 + i), float(i))
            for i, p in enumerate(texts)
        ]

    plain = run(*make_scheduler(target, None, draft_config()), seqs())
    for batched in (False, True):
        scheduler, runner = make_scheduler(target, draft, draft_config(), False)
        todo = seqs()
        out = (
            run(scheduler, runner, todo)
            if batched
            else [run(scheduler, runner, [s])[0] for s in todo]
        )
        assert out == plain
        assert scheduler.speculator is not None
        assert scheduler.speculator.take_stats().num_draft_tokens > 0  # it did speculate


def next_token_probs(model: LlamaForCausalLM, token_lists: list[list[int]]) -> torch.Tensor:
    """Softmax of the last position's logits of each list, each its own prefill span."""
    width = max(len(t) for t in token_lists)
    per_seq = -(-width // BS)
    kv = allocate_kv_cache(TINY, per_seq * len(token_lists), BS, torch.float32, CPU)
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    spans: list[PrefillSpan] = []
    last: list[int] = []
    for i, tokens in enumerate(token_lists):
        table = torch.arange(i * per_seq, (i + 1) * per_seq)
        spans.append(PrefillSpan(len(ids), len(ids) + len(tokens), 0, table))
        for p, token in enumerate(tokens):
            ids.append(token)
            pos.append(p)
            slots.append(int(table[p // BS]) * BS + p % BS)
        last.append(len(ids) - 1)
    meta = AttentionMetadata(torch.tensor(slots), BS, prefills=spans)
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.tensor(pos), kv, meta)
        return torch.softmax(model.compute_logits(hidden[last]), dim=-1)


@pytest.mark.parametrize("sample_proposals", [True, False], ids=["sampled", "argmax"])
def test_sampling_with_a_draft_keeps_the_target_distribution(sample_proposals: bool) -> None:
    """Temperature 1, a draft that agrees only partly, proposing draws from its own q
    (speculative sampling) or its argmax (a point mass): the second output token's marginal
    over many seeds matches the target's exact one (sum over the first token), chi-square
    at ALPHA over 5 buckets of the vocabulary."""
    target = random_model(4, scale=0.6)
    draft = random_model(5, 0.3, like=target)
    prompt = [7, 1, 30, 12]
    first = next_token_probs(target, [prompt])[0]
    second = next_token_probs(target, [[*prompt, t] for t in range(TINY.vocab_size)])
    marginal = first @ second  # P(second output token = j)
    draws = 4_000
    params = [
        SamplingParams(max_tokens=4, temperature=1.0, seed=s, ignore_eos=True) for s in range(draws)
    ]
    config = draft_config(num_speculative_tokens=2)
    scheduler, runner = make_scheduler(target, draft, config, sample_proposals)
    outputs = run(scheduler, runner, [Sequence(prompt, p, 0.0) for p in params])
    counts = [0] * 5
    for tokens in outputs:
        counts[tokens[1] % 5] += 1
    expected = [float(marginal[b::5].sum()) * draws for b in range(5)]
    assert chi_square_df4_p_value(counts, expected) > ALPHA, (counts, expected)
    assert scheduler.speculator is not None
    stats = scheduler.speculator.take_stats()
    assert stats.num_drafts >= draws and stats.num_accepted_tokens > 50, stats


def acceptance(scheduler: Scheduler) -> float:
    assert scheduler.speculator is not None
    stats = scheduler.speculator.take_stats()
    return stats.num_accepted_tokens / stats.num_draft_tokens


def test_sampled_self_draft_is_accepted_almost_always_and_outputs_repeat() -> None:
    """Temperature 1, the target as its own draft: q == p up to rounding, so sampled
    proposals are (nearly) all accepted, where argmax proposals are accepted with
    probability p(argmax) only. Seeded outputs repeat alone and batched, and every block of
    both caches comes back."""
    target = random_model(4, scale=0.6)
    sampled = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    texts = prompts(6)
    rates, outputs = {}, []
    for sample_proposals, batched in ((False, True), (True, True), (True, False)):
        scheduler, runner = make_scheduler(target, target, draft_config(), sample_proposals)
        seqs = [Sequence(p, replace(sampled, seed=i), 0.0) for i, p in enumerate(texts)]
        if batched:
            out = run(scheduler, runner, seqs)
        else:
            out = [run(scheduler, runner, [s])[0] for s in seqs]
        rates[sample_proposals] = acceptance(scheduler)
        if sample_proposals:
            outputs.append(out)
        scheduler.kv_cache.check_all_free()
        assert scheduler.speculator is not None and scheduler.speculator.draft is not None
        scheduler.speculator.draft.check_all_free()
    assert rates[True] > 0.97 and rates[False] < rates[True] - 0.2, rates
    assert outputs[0] == outputs[1]
