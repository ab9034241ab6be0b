"""The batch signal end to end: open batches' lines per deployment and the line rate their
deadlines need (gateway), summed over gateways, and the replicas the autoscaler buys for it
only when the pool it has would miss a deadline."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from servefleet.api.batch_demand import BatchDue, lines_per_second_needed, merge_batch_due
from servefleet.api.gateway_stats import DeploymentStats
from servefleet.api.llmdeployment import LLMDeploymentSpec
from servefleet.autoscaler.gateway_fleet import sum_deployment_stats
from servefleet.autoscaler.policy import Reason, decide
from servefleet.autoscaler.signals import Observation, ReplicaLoad, ReplicaState
from servefleet.autoscaler.spec import targets_from_spec
from servefleet.autoscaler.targets import ScalingTargets
from servefleet.bench.fake_upstream import FakeBehaviour, FakeOpenAI
from servefleet.bench.processes import serve_in_thread
from servefleet.gateway.app import Gateway
from servefleet.gateway.batch_demand import OpenWork, due_by_pool
from servefleet.gateway.batch_runner import BatchRunner
from servefleet.gateway.batch_store_folder import FolderBatchStore
from tests.test_gateway_batches import MODEL, Rig, _config, _lines, _submit, _wait


def test_the_needed_rate_meets_every_deadline_earliest_first() -> None:
    now = 1000.0
    assert lines_per_second_needed([(100, now + 100)], now) == 1.0
    # 50 due in 50 s, then 100 more by 100 s: 150 lines in 100 s, but also 50 in the first 50.
    assert lines_per_second_needed([(100, now + 100), (50, now + 50)], now) == 1.5
    assert lines_per_second_needed([(90, now + 30), (10, now + 1000)], now) == 3.0
    # A batch past its deadline expires on its own: no replica helps it.
    assert lines_per_second_needed([(500, now - 1), (10, now + 10)], now) == 1.0
    assert lines_per_second_needed([], now) == 0.0


def test_lines_go_to_the_deployment_their_tenant_and_model_route_to() -> None:
    works = [
        OpenWork("b1", "a", 500.0, Counter({"m": 3, "other": 2, "unknown": 9}), running=True),
        OpenWork("b2", "b", 900.0, Counter({"m": 4, "gone": 0})),
        OpenWork("b3", "slow", 400.0, Counter({"m": 1000})),  # 1 request/s for the 300 s left
    ]
    routes = {
        ("a", "m"): ("d1", None),
        ("a", "other"): ("d2", None),
        ("b", "m"): ("d1", None),
        ("slow", "m"): ("d1", 1.0),
    }
    due = due_by_pool(works, lambda tenant, model: routes.get((tenant, model)), 100.0)
    assert due == {
        "d1": [
            BatchDue(batch_id="b1", lines=3, expires_at=500.0, running=True),
            BatchDue(batch_id="b2", lines=4, expires_at=900.0),
            BatchDue(batch_id="b3", lines=300, expires_at=400.0),
        ],
        "d2": [BatchDue(batch_id="b1", lines=2, expires_at=500.0, running=True)],
    }


@pytest.fixture
def slow_rig(tmp_path: Path) -> Iterator[Rig]:
    with ExitStack() as stack:
        fake = FakeOpenAI(FakeBehaviour(completion_tokens=3, first_token_delay_s=0.15))
        url = stack.enter_context(serve_in_thread(fake))
        gateway = Gateway(_config(tmp_path / "batches"))
        gateway.set_replicas("d", [url], ready=[url])
        yield Rig(gateway, stack.enter_context(serve_in_thread(gateway)), fake, tmp_path)


def test_a_running_batch_is_in_its_deployments_stats_until_it_closes(slow_rig: Rig) -> None:
    client = slow_rig.client()
    batch = _submit(client, _lines(40))
    stats = slow_rig.gateway.pools["d"].stats()
    assert 0 < stats.batch_lines_left <= 40  # in the signal at once, shrinking as lines end
    (due,) = stats.batch_due
    assert due.batch_id == batch.id and due.lines == stats.batch_lines_left
    window = batch.expires_at - batch.created_at  # 24 h
    expected = stats.batch_lines_left / window
    assert stats.batch_lines_per_second_needed == pytest.approx(expected, rel=0.01)
    _wait(client, batch.id, {"completed"})
    after = slow_rig.gateway.pools["d"].stats()
    assert (after.batch_lines_left, after.batch_lines_per_second_needed) == (0, 0.0)
    assert after.batch_due == []


def test_a_restarted_runner_counts_the_open_batches_before_their_turn(slow_rig: Rig) -> None:
    client = slow_rig.client()
    batch = _submit(client, _lines(40))
    published: list[list[OpenWork]] = []
    store = FolderBatchStore(slow_rig.store / "batches")  # the same store, as after a restart

    async def never(tenant: str, path: str, body: bytes) -> tuple[int, bytes, str]:
        raise AssertionError("noting runs no line")

    runner = BatchRunner(store, never, on_work=published.append)
    asyncio.run(runner._note_unseen(store.open_batches()))
    (work,) = published[-1]
    assert work.tenant == "a" and work.expires_at == batch.expires_at
    assert 0 < work.left[MODEL] <= 40
    _wait(client, batch.id, {"completed"})


def test_lines_run_as_many_at_once_as_the_pool_leaves_batch_slots(slow_rig: Rig) -> None:
    """line_concurrency (4) is a floor: one replica of 16 slots, one kept for interactive
    requests, takes 15 lines at once; a second replica (bought for a deadline) 30."""
    pool = slow_rig.gateway.pools["d"]
    assert pool.batch_slots() == 15
    client = slow_rig.client()
    _wait(client, _submit(client, _lines(45)).id, {"completed"})
    assert slow_rig.fake.stats.max_active == 15


def test_gateways_add_up_their_batches() -> None:
    """Gateways that list no batches (older ones) add up their figures as they are."""
    one = DeploymentStats(name="d", batch_lines_left=10, batch_lines_per_second_needed=0.5)
    two = DeploymentStats(name="d", batch_lines_left=30, batch_lines_per_second_needed=1.0)
    both = sum_deployment_stats([{"d": one}, {"d": two}])["d"]
    assert (both.batch_lines_left, both.batch_lines_per_second_needed) == (40, 1.5)


def test_replicas_over_one_store_count_each_batch_once() -> None:
    """Two gateways over one bucket both list both batches: b1 counts as its runner (gateway
    one) says, b2 (run by nobody yet) as the fresher of the two views, never twice."""
    now = time.time()
    b1, b2 = now + 100.0, now + 1000.0
    one = DeploymentStats(name="d", batch_due=[
        BatchDue(batch_id="b1", lines=20, expires_at=b1, running=True),
        BatchDue(batch_id="b2", lines=300, expires_at=b2),
    ])  # fmt: skip
    two = DeploymentStats(name="d", batch_due=[
        BatchDue(batch_id="b1", lines=90, expires_at=b1),  # read before one ran most of it
        BatchDue(batch_id="b2", lines=250, expires_at=b2),
    ])  # fmt: skip
    both = sum_deployment_stats([{"d": one}, {"d": two}])["d"]
    assert both.batch_lines_left == 20 + 250
    assert [(d.batch_id, d.lines) for d in both.batch_due] == [("b1", 20), ("b2", 250)]
    expected = lines_per_second_needed([(20, b1), (250, b2)], now)
    assert both.batch_lines_per_second_needed == pytest.approx(expected, rel=0.01)
    own_store = DeploymentStats(
        name="d", batch_due=[BatchDue(batch_id="b3", lines=5, expires_at=b1)]
    )
    three = sum_deployment_stats([{"d": one}, {"d": two}, {"d": own_store}])["d"]
    assert three.batch_lines_left == 20 + 250 + 5  # a store of its own: its batches add


def test_merge_prefers_the_running_replica_then_the_fewest_lines() -> None:
    running = BatchDue(batch_id="b", lines=50, expires_at=1.0, running=True)
    fewer = BatchDue(batch_id="b", lines=10, expires_at=1.0)
    assert merge_batch_due([[fewer], [running]]) == [running]
    assert merge_batch_due([[running], [fewer]]) == [running]
    assert merge_batch_due([[BatchDue(batch_id="b", lines=30, expires_at=1.0)], [fewer]]) == [fewer]


def _targets(**extra: object) -> ScalingTargets:
    base: dict[str, object] = {
        "min_replicas": 1,
        "max_replicas": 8,
        "target_per_replica": 4,
        "batch_slots_per_replica": 3,
        "scale_down_delay_s": 60,
    }
    return ScalingTargets.model_validate(base | extra)


def _observe(
    replicas: int, rate: float, service_s: float | None = 2.0, at: float = 0.0
) -> Observation:
    ready = tuple(ReplicaLoad(name=f"r{i}", state=ReplicaState.READY) for i in range(replicas))
    return Observation(
        replicas=ready, batch_lines_per_s_needed=rate, mean_service_s=service_s, observed_at=at
    )


def test_replicas_are_bought_only_when_a_deadline_would_be_missed() -> None:
    targets = _targets()
    # 1 replica x 3 batch slots / 2 s per line = 1.5 lines/s (1.2 with the safety margin).
    enough = decide(_observe(1, rate=1.0), targets, now=0.0)
    assert enough.desired == 1 and enough.reason is not Reason.BATCH_DEADLINE
    short = decide(_observe(1, rate=4.0), targets, now=0.0)  # 4 x 2 x 1.25 / 3 = 3.33
    assert (short.desired, short.reason) == (4, Reason.BATCH_DEADLINE)
    assert "4.00 lines/s" in short.message and "3 batch slots" in short.message
    capped = decide(_observe(1, rate=100.0), targets, now=0.0)
    assert capped.desired == 8  # never past maxReplicas
    unknown = decide(_observe(1, rate=4.0, service_s=None), targets, now=0.0)
    assert unknown.desired == 1  # no service time measured yet: nothing to size by


def test_the_pool_is_held_while_a_batch_needs_it_and_shrinks_after() -> None:
    targets = _targets()
    state = None
    for t in range(0, 200, 10):  # idle interactive traffic, a batch needing 4 replicas
        decision = decide(_observe(4, rate=4.0, at=t), targets, now=float(t), state=state)
        state = decision.state
        assert (decision.desired, decision.reason) == (4, Reason.BATCH_DEADLINE)
    for t in range(200, 400, 10):  # the batch is done
        decision = decide(_observe(4, rate=0.0, at=t), targets, now=float(t), state=state)
        state = decision.state
        if decision.desired < 4:
            break
    assert decision.desired == 3 and decision.reason is Reason.SCALE_DOWN
    assert t >= 190 + 60  # the scale-down delay after the batch last asked, as for any demand


def test_batch_slots_come_from_the_spec_as_the_gateway_counts_them() -> None:
    model = {"name": "m", "source": {"builtin": "smollm2-135m-instruct"}}
    spec = LLMDeploymentSpec.model_validate(
        {"model": model, "pool": {"perReplicaConcurrency": 8}, "admission": {}}
    )
    assert targets_from_spec(spec).batch_slots_per_replica == 7  # one slot reserved
    spec = LLMDeploymentSpec.model_validate(
        {
            "model": model,
            "pool": {"perReplicaConcurrency": 2},
            "admission": {"interactiveReservedSlots": 5},
        }
    )
    assert targets_from_spec(spec).batch_slots_per_replica == 1  # batch keeps one
