"""Fault scenarios on the engines: one is killed mid-stream, one is scaled down, every one is
replaced (a rolling update), all under load.

The gateway continues a broken stream on another replica from the token ids the client already
has (`servefleet.api.stream_resume`), so a kill must cost nothing: every stream ends, and its
text is the text an uninterrupted run of the same request gives. The references are asked of
an engine directly, after the load. Requests without a seed of their own are sampled with the
seed the gateway gives them and tells the client (`SEED_HEADER`); their reference is the same
request with that seed, asked for each such stream that ran across a kill and for a few more.
"""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import time
from collections.abc import Callable
from typing import Any

import httpx

from servefleet.bench.fault_common import (
    ENGINE_RUNNING,
    Scale,
    ScenarioResult,
    charged_tokens,
    no_losses,
    poll,
    settle,
)
from servefleet.bench.fault_load import (
    LoadResult,
    Outcome,
    RequestRecord,
    RequestSpec,
    closed_loop,
    send,
)
from servefleet.bench.fault_stack import TENANTS, Part, Stack, metric_sum, scrape
from servefleet.bench.fault_stack import wait_for_replicas as _wait_for_replicas
from servefleet.bench.fault_stack import wait_ready as _wait_ready
from servefleet.gateway.metrics import PREFIX

STREAM_CONTINUATIONS = PREFIX + "stream_continuations_total"
PROMPTS = 6  # distinct prompts per kind of request: the references to compute
SAMPLED = 0.8
CLIENT_SEED = 1234
GATEWAY_SEEDED_REFERENCES = 12  # gateway-seeded streams rerun, those across a kill first

# (tenant, spec, clients): greedy, sampled with the client's seed, sampled with the gateway's.
MIX: tuple[tuple[str, RequestSpec, int], ...] = (
    (TENANTS[0], RequestSpec(max_tokens=48, prompts=PROMPTS), 5),
    (
        TENANTS[1],
        RequestSpec(
            prompt="Write a short poem about the sea.",
            max_tokens=48,
            temperature=SAMPLED,
            seed=CLIENT_SEED,
            prompts=PROMPTS,
        ),
        5,
    ),
    (
        TENANTS[1],
        RequestSpec(prompt="Name some fruits.", max_tokens=48, temperature=SAMPLED),
        4,
    ),
)


def _losses(result: ScenarioResult, load: LoadResult) -> None:
    """`no_losses`, with what the first few lost requests were told (to find the cause)."""
    no_losses(result, load)
    lost = [r for r in load.records if r.outcome in (Outcome.FAILED, Outcome.ERROR_EVENT)]
    if lost:
        result.figures["lost"] = [f"{r.outcome.value} {r.status}: {r.detail}" for r in lost[:5]]


def _continuations(stack: Stack) -> float:
    return sum(metric_sum(scrape(g.internal_url), STREAM_CONTINUATIONS) for g in stack.gateways)


async def _mixed_load(url: str, seconds: float) -> list[LoadResult]:
    return list(
        await asyncio.gather(
            *(closed_loop(url, tenant, clients, seconds, spec) for tenant, spec, clients in MIX)
        )
    )


def _gateway_seeded(kind: int) -> bool:
    spec = MIX[kind][1]
    return bool(spec.temperature) and spec.seed is None


def _key(kind: int, record: RequestRecord) -> tuple[int, int]:
    """Which reference a stream is compared with: its prompt's, or (gateway-seeded) its own."""
    prompts = MIX[kind][1].prompts
    return (kind, record.number % prompts if prompts else record.number)


def _seeded_streams(loads: list[LoadResult]) -> list[tuple[int, RequestRecord]]:
    """(kind, record) of every completed stream sampled with the gateway's seed."""
    return [
        (kind, record)
        for kind, load in enumerate(loads)
        if _gateway_seeded(kind)
        for record in load.records
        if record.outcome is Outcome.OK
    ]


def _across(record: RequestRecord, kills: list[float]) -> bool:
    """The stream was running when an engine was killed (it may have been continued)."""
    return any(record.started <= t <= record.started + record.seconds for t in kills)


def _wanted(loads: list[LoadResult], kills: list[float]) -> dict[tuple[int, int], RequestSpec]:
    """The reference runs to make: every prompt of the greedy and client-seeded kinds, and the
    gateway-seeded streams that ran across a kill (then others), each with its seed."""
    wanted: dict[tuple[int, int], RequestSpec] = {}
    for kind, (_, spec, _) in enumerate(MIX):
        if not _gateway_seeded(kind) and spec.prompts:
            wanted.update({(kind, n): spec for n in range(spec.prompts)})
    seeded = [(kind, r) for kind, r in _seeded_streams(loads) if r.seed is not None]
    seeded.sort(key=lambda kind_record: not _across(kind_record[1], kills))
    for kind, record in seeded[:GATEWAY_SEEDED_REFERENCES]:
        wanted[_key(kind, record)] = dataclasses.replace(MIX[kind][1], seed=record.seed)
    return wanted


async def _references(
    engine: Part, wanted: dict[tuple[int, int], RequestSpec], at_once: int
) -> dict[tuple[int, int], str]:
    """(kind in MIX, prompt or request number) -> the text of an uninterrupted run; `at_once`
    at a time, as the load ran them batched (a batch does not change a sequence's tokens)."""
    found: dict[tuple[int, int], str] = {}
    slots = asyncio.Semaphore(at_once)
    async with httpx.AsyncClient(timeout=120) as client:

        async def one(key: tuple[int, int], spec: RequestSpec) -> None:
            async with slots:
                record = await send(client, engine.url, MIX[key[0]][0], spec, key[1])
            if record.outcome is Outcome.OK:
                found[key] = record.text

        await asyncio.gather(*(one(key, spec) for key, spec in wanted.items()))
    return found


def _compare(
    result: ScenarioResult,
    loads: list[LoadResult],
    wanted: dict[tuple[int, int], RequestSpec],
    references: dict[tuple[int, int], str],
) -> None:
    """Every completed stream that has a reference carries exactly its text."""
    compared = differ = seeded = 0
    for kind, load in enumerate(loads):
        for record in load.records:
            reference = references.get(_key(kind, record))
            if record.outcome is not Outcome.OK or reference is None:
                continue
            compared += 1
            seeded += _gateway_seeded(kind)
            if record.text != reference:
                differ += 1
                if differ <= 3:
                    result.violations.append(
                        f"text differs from the reference: {record.text!r} != {reference!r}"
                    )
    unseeded = [r for _, r in _seeded_streams(loads) if r.seed is None]
    result.figures.update(
        streams_compared=compared, streams_differing=differ, gateway_seeded_compared=seeded
    )
    result.require(len(references) == len(wanted), f"{len(references)} of {len(wanted)} references")
    result.require(compared > seeded, "no greedy or client-seeded stream was compared")
    result.require(seeded > 0, "no gateway-seeded stream was compared with its reference")
    result.require(not unseeded, f"{len(unseeded)} gateway-seeded streams without a seed header")
    result.require(differ == 0, f"{differ} of {compared} streams differ from their reference")


def _rejoin(stack: Stack, engine: Part, deadline: float) -> None:
    _wait_ready(engine, deadline)
    for gateway in stack.gateways:
        _wait_for_replicas(gateway, stack.engines, deadline)


def _kill_mid_stream(engine: Part) -> dict[str, Any]:
    """SIGKILL `engine` once it is generating (bounded wait); what it was running then."""
    poll(lambda: metric_sum(scrape(engine.url), ENGINE_RUNNING) > 0, timeout_s=10, interval_s=0.1)
    running = metric_sum(scrape(engine.url), ENGINE_RUNNING)
    engine.signal(signal.SIGKILL)
    assert engine.proc is not None
    engine.proc.wait(timeout=30)
    return {"engine": engine.name, "sequences_running_at_kill": running}


def engine_kill(stack: Stack, scale: Scale) -> ScenarioResult:
    """An engine is SIGKILLed mid-stream (twice in the long run, each time started again):
    every stream still ends, with the text an uninterrupted run gives, and is charged once."""
    result = ScenarioResult("engine_kill")
    gateway = stack.gateways[0]
    rounds = 2 if scale.seconds >= 240 else 1  # a restart takes a minute on two busy cores
    settle(stack)
    charged_before, continued_before = charged_tokens(stack), _continuations(stack)
    kills: list[dict[str, Any]] = []
    kill_times: list[float] = []  # monotonic, to find the streams that ran across a kill

    async def fault() -> None:
        for round_ in range(rounds):
            await asyncio.sleep(scale.seconds / (2 * rounds))
            victim = stack.engines[round_ % len(stack.engines)]
            kills.append(await asyncio.to_thread(_kill_mid_stream, victim))
            kill_times.append(time.monotonic())
            started = time.monotonic()
            victim.start()
            deadline = started + stack.shape.ready_timeout_s
            await asyncio.to_thread(_rejoin, stack, victim, deadline)
            kills[-1]["seconds_to_rejoin"] = round(time.monotonic() - started, 1)

    async def run() -> list[LoadResult]:
        loads, _ = await asyncio.gather(_mixed_load(gateway.url, scale.seconds), fault())
        return loads

    loads = asyncio.run(run())
    _account(stack, result, loads, charged_before)
    result.figures.update(
        kills=kills, continued_after_fault=_continuations(stack) - continued_before
    )
    result.require(len(kills) == rounds, f"{len(kills)} of {rounds} kills happened")
    wanted = _wanted(loads, kill_times)
    across = sum(_across(r, kill_times) for _, r in _seeded_streams(loads))
    result.figures["gateway_seeded_across_kill"] = across
    references = _references(stack.engines[0], wanted, stack.shape.max_num_seqs)
    _compare(result, loads, wanted, asyncio.run(references))
    return result


def _retire(stack: Stack, engine: Part) -> float | None:
    """Scale `engine` down as the local plane does: out of the gateways' replica list and
    SIGTERM at once; seconds until it exited (None: not within its drain timeout)."""
    stack.engines.remove(engine)
    stack.publish_engines()
    engine.signal(signal.SIGTERM)
    exited = poll(lambda: not engine.alive(), timeout_s=60)
    engine.stop()
    return exited


def _add_engine(stack: Stack, index: int) -> float:
    """Start a new engine and, once ready, add it to every gateway; seconds it took."""
    started = time.monotonic()
    engine = stack.spare_engine(index)
    engine.start()
    _wait_ready(engine, started + stack.shape.ready_timeout_s)
    stack.engines.append(engine)
    stack.publish_engines()
    for gateway in stack.gateways:
        _wait_for_replicas(gateway, stack.engines, time.monotonic() + 30)
    return round(time.monotonic() - started, 1)


def _under_load(
    stack: Stack, scale: Scale, name: str, change: Callable[[], dict[str, Any]]
) -> tuple[ScenarioResult, dict[str, Any]]:
    """Mixed load on the first gateway while `change()` (blocking) runs in a thread from a
    quarter of the way in; the load lasts at least until the change is done."""
    result = ScenarioResult(name)
    settle(stack)
    charged_before = charged_tokens(stack)
    figures: dict[str, Any] = {}
    done = asyncio.Event()

    async def fault() -> None:
        await asyncio.sleep(scale.seconds / 4)
        figures.update(await asyncio.to_thread(change))
        done.set()

    async def load_until_done() -> list[LoadResult]:
        loads = await _mixed_load(stack.gateways[0].url, scale.seconds)
        while not done.is_set():  # the change outlasted the load: keep it loaded
            loads += await _mixed_load(stack.gateways[0].url, min(10.0, scale.seconds))
        return loads

    async def run() -> list[LoadResult]:
        loads, _ = await asyncio.gather(load_until_done(), fault())
        return loads

    loads = asyncio.run(run())
    result.figures.update(figures)
    _account(stack, result, loads, charged_before)
    return result, figures


def _account(
    stack: Stack, result: ScenarioResult, loads: list[LoadResult], charged_before: float
) -> None:
    """After the load: what was lost, and every token charged once (charged = delivered)."""
    merged = LoadResult(records=[r for load in loads for r in load.records])
    _losses(result, merged)
    settle(stack)
    charged, delivered = charged_tokens(stack) - charged_before, merged.tokens_delivered()
    result.figures.update(charged=charged, delivered=delivered)
    result.require(charged == delivered, f"charged {charged:g} tokens, delivered {delivered}")


_next_index = iter(range(100, 10_000))  # engine log names of replacements: engine-100, ...


def scale_down_drain(stack: Stack, scale: Scale) -> ScenarioResult:
    """An engine is scaled down under load (out of the replica list, SIGTERM): it finishes
    what it holds and exits, and no request fails; a new one is added back afterwards."""

    def change() -> dict[str, Any]:
        return {"seconds_to_exit": _retire(stack, stack.engines[-1])}

    result, figures = _under_load(stack, scale, "scale_down_drain", change)
    result.require(figures.get("seconds_to_exit") is not None, "the drained engine did not exit")
    result.figures["seconds_to_add_back"] = _add_engine(stack, next(_next_index))
    return result


def rolling_update(stack: Stack, scale: Scale) -> ScenarioResult:
    """Every engine replaced one at a time under load (start the new one, add it when ready,
    then scale the old one down): no request fails, and the stack ends on the new engines."""
    old = list(stack.engines)

    def change() -> dict[str, Any]:
        steps = []
        for engine in old:
            added = _add_engine(stack, next(_next_index))
            steps.append({"seconds_to_add": added, "seconds_to_exit": _retire(stack, engine)})
        return {"steps": steps}

    result, figures = _under_load(stack, scale, "rolling_update", change)
    exits = [s["seconds_to_exit"] for s in figures.get("steps", [])]
    result.require(len(exits) == len(old), f"{len(exits)} of {len(old)} engines replaced")
    result.require(all(e is not None for e in exits), f"an old engine did not exit: {exits}")
    left = {e.name for e in old} & {e.name for e in stack.engines}
    result.require(not left, f"old engines still in the stack: {sorted(left)}")
    return result
