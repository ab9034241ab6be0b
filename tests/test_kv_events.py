"""KV cache events without a model: the pool's sink, its normalisation, the ring's resume."""

from __future__ import annotations

import asyncio

from servefleet.api.kv_events import event_id, parse_event_id
from servefleet.engine.block_pool import BlockPool
from servefleet.engine.kv_events import KVEventLog, KVEventSink, PendingBatch


def _pool(n: int = 4) -> tuple[BlockPool, KVEventSink]:
    pool = BlockPool(n)
    pool.events = sink = KVEventSink()
    return pool, sink


def test_the_pool_records_stored_removed_and_cleared() -> None:
    pool, sink = _pool(2)
    a, b = pool.allocate(2)
    assert pool.cache_block(a, 11, 1)
    assert pool.cache_block(b, 12, 11)
    assert not pool.cache_block(pool.blocks[0], 11, 1)  # already published: nothing new
    batch = sink.take()
    assert batch == PendingBatch([(11, 1), (12, 11)], [], False)
    assert sink.take() is None
    pool.free([b, a])
    pool.allocate(1)  # evicts the least recently freed: 12 (freed first)
    assert sink.take() == PendingBatch([], [12], False)
    pool.reset_prefix_cache()
    assert sink.take() == PendingBatch([], [], True)


def test_a_block_stored_and_evicted_in_one_batch_is_never_announced() -> None:
    pool, sink = _pool(1)
    (a,) = pool.allocate(1)
    pool.cache_block(a, 7, 1)
    pool.free([a])
    pool.allocate(1)  # evicts 7 before anyone heard of it
    assert sink.take() is None


def test_removed_then_stored_again_applies_in_order() -> None:
    sink = KVEventSink()
    sink.on_removed(5)
    sink.on_stored(5, 1)
    batch = sink.take()
    assert batch is not None and batch.removed == [5] and batch.stored == [(5, 1)]
    held = {5}
    held -= set(batch.removed)
    held |= {h for h, _ in batch.stored}
    assert held == {5}


def test_cleared_drops_what_came_before_it() -> None:
    sink = KVEventSink()
    sink.on_stored(1, 0)
    sink.on_removed(2)
    sink.on_cleared()
    sink.on_stored(3, 0)
    assert sink.take() == PendingBatch([(3, 0)], [], True)


def test_the_ring_resumes_and_says_when_it_moved_past() -> None:
    log = KVEventLog(ring_steps=3)
    for h in range(1, 6):
        log.append(PendingBatch([(h, 0)], [], False))
    assert log.seq == 5
    got = log.since(3)
    assert got is not None and [b.seq for b in got] == [4, 5]
    assert [b.seq for b in log.since(2) or []] == [3, 4, 5]
    assert log.since(1) is None  # batch 2 is gone: a snapshot is needed
    assert log.since(5) == []
    assert log.since(9) is None  # an id from the future (another run)


def test_subscribers_are_bounded_and_woken() -> None:
    async def go() -> None:
        log = KVEventLog(max_subscribers=1)
        sub = log.subscribe()
        try:
            log.subscribe()
        except Exception as exc:
            assert "already open" in str(exc)
        else:
            raise AssertionError("a second subscriber was let in")
        log.append(PendingBatch([(1, 0)], [], False))
        await asyncio.wait_for(sub.wake.wait(), 1.0)
        log.unsubscribe(sub)
        assert log.subscribers == 0

    asyncio.run(go())


def test_event_ids_round_trip() -> None:
    assert parse_event_id(event_id("ab12", 7)) == ("ab12", 7)
    assert parse_event_id(None) is None
    assert parse_event_id("garbage") is None
    assert parse_event_id("ab-x") is None
