"""Scheduler, KV-cache manager and block pool: pure Python, no model."""

from __future__ import annotations

import pytest

from servefleet.engine.block_pool import BlockPool, NoFreeBlocksError
from servefleet.engine.kv_cache import KVCacheManager
from servefleet.engine.sampling_params import SamplingParams
from servefleet.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from servefleet.engine.sequence import FinishReason, Priority, Sequence, SequenceStatus

BS = 4
EOS = 2


def make(
    num_blocks: int = 64,
    max_seqs: int = 8,
    budget: int = 64,
    caching: bool = True,
    max_model_len: int = 1024,
) -> Scheduler:
    kv = KVCacheManager(num_blocks, BS, caching)
    return Scheduler(SchedulerConfig(max_seqs, budget, max_model_len), kv, [EOS])


def seq(prompt: list[int], max_tokens: int = 4, t: float = 0.0, prio: int = 0) -> Sequence:
    return Sequence(list(prompt), SamplingParams(max_tokens=max_tokens), t, priority=prio)


def fake_step(s: Scheduler, out: SchedulerOutput, token: int = 9) -> list[Sequence]:
    """Pretend the model ran: every chunk that reaches the end of its tokens yields `token`."""
    sampled = {c.seq.seq_id: [token] for c in out.chunks if c.samples}
    return s.update(out, sampled)


def run_to_end(s: Scheduler, limit: int = 1000) -> list[SchedulerOutput]:
    steps = []
    for _ in range(limit):
        if not s.num_unfinished:
            return steps
        out = s.schedule()
        steps.append(out)
        fake_step(s, out)
    raise AssertionError("did not finish")


def test_block_pool_lru_eviction_and_refcounts() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.cache_block(a, 111)
    pool.cache_block(b, 222)
    pool.free([b, a])  # tail first: b is evicted before a
    assert pool.num_free_blocks == 4
    assert pool.lookup(111) is a and pool.lookup(222) is b
    fresh = pool.allocate(2)  # uncached blocks go out before cached ones
    assert a not in fresh and b not in fresh
    assert pool.lookup(111) is a
    (evicted,) = pool.allocate(1)
    assert evicted is b and pool.lookup(222) is None and pool.lookup(111) is a
    pool.touch([a])
    assert a.ref_count == 1 and pool.num_free_blocks == 0
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)
    pool.free([a, evicted, *fresh])
    pool.check_all_free()


def test_decodes_and_prefill_chunks_share_a_step_under_budget() -> None:
    s = make(budget=10)
    first = seq(range(3, 9), max_tokens=5)  # 6 prompt tokens
    s.add(first)
    out = s.schedule()
    assert [c.num_new_tokens for c in out.prefills] == [6]
    fake_step(s, out)
    second = seq(range(20, 40), max_tokens=2, t=1.0)  # 20 tokens: needs chunking
    s.add(second)
    out = s.schedule()
    assert [c.seq for c in out.decodes] == [first]
    assert [(c.seq, c.num_new_tokens) for c in out.prefills] == [(second, 9)]
    assert out.num_batched_tokens == 10
    assert not out.prefills[0].samples  # a partial chunk yields no token
    fake_step(s, out)
    assert second.num_output_tokens == 0 and second.num_computed_tokens == 9
    run_to_end(s)
    assert first.output_token_ids == [9] * 5 and second.output_token_ids == [9] * 2
    s.kv_cache.check_all_free()


def test_max_num_seqs_and_new_request_starts_next_step() -> None:
    s = make(max_seqs=2)
    seqs = [seq([5, 6, 7], max_tokens=3, t=i) for i in range(3)]
    for x in seqs:
        s.add(x)
    out = s.schedule()
    assert {c.seq for c in out.chunks} == set(seqs[:2])
    fake_step(s, out)
    fake_step(s, s.schedule())
    out = s.schedule()  # the first two finish at the end of this step...
    fake_step(s, out)
    assert seqs[0].is_finished and seqs[1].is_finished
    out = s.schedule()  # ...and their slots go to the waiting one at once
    assert [c.seq for c in out.chunks] == [seqs[2]]
    run_to_end(s)
    s.kv_cache.check_all_free()


def test_waiting_order_is_priority_then_arrival() -> None:
    s = make(max_seqs=1)
    batch_early = seq([5] * 3, t=0.0, prio=Priority.BATCH)
    inter_late = seq([6] * 3, t=5.0, prio=Priority.INTERACTIVE)
    inter_early = seq([7] * 3, t=1.0, prio=Priority.INTERACTIVE)
    for x in (batch_early, inter_late, inter_early):
        s.add(x)
    order = []
    while s.num_unfinished:
        out = s.schedule()
        for c in out.chunks:
            if c.seq not in order:
                order.append(c.seq)
        fake_step(s, out)
    assert order == [inter_early, inter_late, batch_early]


def test_prefix_cache_hits_share_blocks_and_leave_one_token() -> None:
    s = make()
    prompt = list(range(100, 113))  # 13 tokens: 3 full blocks of 4
    a = seq(prompt, max_tokens=1)
    s.add(a)
    run_to_end(s)
    b = seq(prompt, max_tokens=1, t=1.0)
    s.add(b)
    out = s.schedule()
    # 3 full blocks cached (12 tokens); the 13th token is computed.
    assert b.num_cached_tokens == 12
    assert [c.num_new_tokens for c in out.prefills] == [] and len(out.decodes) == 1
    fake_step(s, out)
    assert s.kv_cache.prefix_hits == 12 and s.kv_cache.prefix_queries == 26
    s.kv_cache.check_all_free()

    # Exactly block-aligned prompt: the last block must be recomputed, not hit.
    c = seq(prompt[:12], max_tokens=1, t=2.0)
    s.add(c)
    s.schedule()
    assert c.num_cached_tokens == 8


def test_prefix_caching_off_never_hits() -> None:
    s = make(caching=False)
    prompt = list(range(50, 70))
    for i in range(2):
        s.add(seq(prompt, t=i))
        run_to_end(s)
    assert s.kv_cache.prefix_hits == 0
    s.kv_cache.check_all_free()


def test_concurrent_identical_prompts_share_blocks_with_refcounts() -> None:
    s = make()
    prompt = list(range(200, 217))
    a = seq(prompt, max_tokens=3)
    s.add(a)
    fake_step(s, s.schedule())
    b = seq(prompt, max_tokens=3, t=1.0)
    s.add(b)
    fake_step(s, s.schedule())
    shared = set(a.block_table[:4]) & set(b.block_table[:4])
    assert len(shared) == 4
    assert all(s.kv_cache.pool.blocks[i].ref_count == 2 for i in shared)
    run_to_end(s)
    s.kv_cache.check_all_free()


def test_preemption_takes_lowest_priority_latest_and_resumes() -> None:
    # 5 blocks of 4 tokens: two sequences needing 3 blocks each cannot both fit.
    s = make(num_blocks=5, budget=64)
    old = seq([10, 11, 12, 13, 14], max_tokens=7, t=0.0, prio=Priority.BATCH)
    new = seq([20, 21, 22, 23, 24], max_tokens=7, t=1.0, prio=Priority.BATCH)
    urgent = seq([30, 31, 32], max_tokens=6, t=2.0, prio=Priority.INTERACTIVE)
    s.add(old)
    s.add(new)
    preempted: list[Sequence] = []
    steps = 0
    while s.num_unfinished:
        out = s.schedule()
        preempted += out.preempted
        fake_step(s, out)
        steps += 1
        if steps == 1:
            s.add(urgent)
        assert steps < 200
    # The interactive newcomer is never the victim; of the batch ones, the later arrival is.
    assert preempted and preempted[0] is new and urgent not in preempted
    assert new.num_preemptions >= 1
    assert old.output_token_ids == [9] * 7 and new.output_token_ids == [9] * 7
    assert urgent.is_finished
    assert s.num_preemptions == len(preempted)
    s.kv_cache.check_all_free()


def test_eos_stop_tokens_and_length() -> None:
    s = make()
    a = seq([5, 6], max_tokens=10)
    s.add(a)
    fake_step(s, s.schedule(), token=EOS)
    assert a.finish_reason is FinishReason.STOP
    b = Sequence([5, 6], SamplingParams(max_tokens=3, ignore_eos=True), 0.0)
    s.add(b)
    for _ in range(3):
        fake_step(s, s.schedule(), token=EOS)
    assert b.finish_reason is FinishReason.LENGTH and b.output_token_ids == [EOS] * 3
    c = Sequence([5, 6], SamplingParams(max_tokens=10, stop_token_ids=(77,)), 0.0)
    s.add(c)
    fake_step(s, s.schedule(), token=77)
    assert c.finish_reason is FinishReason.STOP
    s.kv_cache.check_all_free()


def test_max_model_len_finishes_with_length() -> None:
    s = make(max_model_len=8)
    a = seq([1, 3, 4, 5, 6], max_tokens=100)
    s.add(a)
    run_to_end(s)
    assert a.num_tokens == 8 and a.finish_reason is FinishReason.LENGTH


def test_abort_frees_blocks_waiting_and_running() -> None:
    s = make(max_seqs=1)
    running = seq(list(range(30)), max_tokens=50)
    waiting = seq(list(range(30)), max_tokens=50, t=1.0)
    s.add(running)
    s.add(waiting)
    fake_step(s, s.schedule())
    assert running.status is SequenceStatus.RUNNING and running.block_table
    s.abort(running)
    s.abort(waiting)
    assert running.finish_reason is FinishReason.ABORT and waiting.is_finished
    assert not s.num_unfinished
    s.kv_cache.check_all_free()


def test_aborted_during_step_is_not_updated() -> None:
    s = make()
    a = seq([5, 6, 7])
    s.add(a)
    out = s.schedule()
    s.abort(a)
    assert fake_step(s, out) == []
    assert a.output_token_ids == []
    s.kv_cache.check_all_free()


def test_a_prefill_only_sequence_never_samples_and_finishes_when_computed() -> None:
    s = make(budget=8)
    p = seq(list(range(10, 27)))  # 17 tokens: chunks of 8, 8, then 1 (still a prefill)
    p.prefill_only = True
    s.add(p)
    steps = run_to_end(s)
    assert [c.num_new_tokens for out in steps for c in out.prefills] == [8, 8, 1]
    assert all(not out.decodes for out in steps)
    assert p.output_token_ids == [] and p.num_computed_tokens == 17
    assert p.finish_reason is FinishReason.LENGTH
    # its full blocks stay cached: a later sequence with the same prompt hits them
    again = seq(list(range(10, 27)))
    assert len(s.kv_cache.find_cached_prefix(again)) == 4
    s.kv_cache.check_all_free()


def test_an_interactive_prompt_shares_no_step_with_a_batch_prompt() -> None:
    """A batch prompt mid-prefill sits out the steps of an interactive prompt (which would
    otherwise wait behind its chunks); batch decodes still ride along; afterwards the batch
    prompt resumes where it stopped."""
    s = make(budget=8)
    decoding = seq([1, 2, 3], max_tokens=20, t=0.0, prio=Priority.BATCH)
    s.add(decoding)
    fake_step(s, s.schedule())  # its prompt done, it now decodes
    long_batch = seq(list(range(10, 40)), t=1.0, prio=Priority.BATCH)
    s.add(long_batch)
    out = s.schedule()
    assert [c.seq for c in out.prefills] == [long_batch]
    fake_step(s, out)
    done_before = long_batch.num_computed_tokens
    urgent = seq(list(range(50, 62)), t=2.0, prio=Priority.INTERACTIVE)
    s.add(urgent)
    shapes = []
    while urgent.num_computed_tokens < urgent.num_tokens - 1 or not shapes:
        out = s.schedule()
        shapes.append(([c.seq for c in out.prefills], [c.seq for c in out.decodes]))
        fake_step(s, out)
    for prefills, decodes in shapes:
        assert prefills == [urgent] and decodes == [decoding]
    assert long_batch.num_computed_tokens == done_before  # held, not dropped
    out = s.schedule()  # the interactive one decodes now: the batch prompt goes on
    assert long_batch in [c.seq for c in out.prefills]
    assert {c.seq for c in out.decodes} == {decoding, urgent}


def test_a_waiting_batch_prompt_is_not_admitted_beside_an_interactive_prompt() -> None:
    s = make(budget=64)
    batch = seq([1, 2, 3, 4], t=0.0, prio=Priority.BATCH)
    urgent = seq([5, 6, 7], t=1.0, prio=Priority.INTERACTIVE)
    s.add(batch)
    s.add(urgent)
    out = s.schedule()
    assert [c.seq for c in out.prefills] == [urgent]
    fake_step(s, out)
    out = s.schedule()
    assert [c.seq for c in out.prefills] == [batch]
    assert [c.seq for c in out.decodes] == [urgent]


def test_prompts_of_equal_priority_share_steps_and_a_better_one_goes_alone() -> None:
    s = make(budget=64)
    a, b = seq([1, 2, 3], t=0.0, prio=5), seq([4, 5, 6], t=1.0, prio=5)
    s.add(a)
    s.add(b)
    assert {c.seq for c in s.schedule().prefills} == {a, b}
    s2 = make(budget=64)
    worse, better = seq([1, 2, 3], t=0.0, prio=5), seq([4, 5, 6], t=1.0, prio=-3)
    s2.add(worse)
    s2.add(better)
    assert [c.seq for c in s2.schedule().prefills] == [better]
