"""Where a request whose prefix is cached somewhere should go: the cost model.

For each replica r with room, with `h_r` tokens of the prompt's leading blocks cached there
(from `KVIndex`), and the ready replica s holding the most, `H` tokens, the predicted time
to the first token of each option is:

    recompute(r) = q_r + (n - h_r) / tps_r               (go_to_holder when h_r = H)
    pull(r, s)   = max(q_r, rtt + (H - h_r) * B / bw_s + wait_s) + (n - H) / tps_r
    q_r          = outstanding_tokens_r / tps_r          (the work queued ahead on r)
    wait_s       = windows * step_s       when s is busy (0 when idle)

n is the prompt's tokens, tps_r the replica's measured prompt tokens/s (its events carry
the engine's EWMA; `DEFAULT_PROMPT_TPS` until one is measured), B its KV bytes per token
(its hello), bw_s the pull bandwidth the engines measured (`DEFAULT_PULL_BPS` until then),
rtt `PULL_RTT_S`. A busy source pins and unpins each window of `WINDOW_BLOCKS` blocks only
between two of its steps (`step_s`, its engine's EWMA), hence `wait_s`. The pull overlaps r's
own queue wait. The cheapest option wins; ties go to
the holder. A pull must move at least `MIN_PULL_BLOCKS` blocks and save at least
max(`MIN_GAIN_S`, half the recompute time of the pulled tokens): a guess that is wrong by
less than that is not worth a transfer. Its deadline is half the recompute time it saves
(at least `MIN_PULL_DEADLINE_S`), so a slow pull costs at most that. The engine has the
last word: it checks its own cache and recomputes whatever the pull does not bring by the
deadline.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from servefleet.api.gateway_config import GatewayDeployment
from servefleet.api.gateway_stats import ReplicaHealth
from servefleet.api.kv_transfer import WINDOW_BLOCKS
from servefleet.gateway.kv_index import KVIndex
from servefleet.gateway.routing import Replica

DEFAULT_PROMPT_TPS = 400.0  # a 135M model's prefill on two CPU cores, roughly
DEFAULT_PULL_BPS = 200e6  # loopback / pod network over HTTP, roughly
PULL_RTT_S = 0.01
MIN_PULL_BLOCKS = 4
MIN_GAIN_S = 0.05
MIN_PULL_DEADLINE_S = 0.25  # below this a pull's connection setup alone may not fit

Decision = Literal["local", "pull", "go_to_holder", "recompute", "pd"]


@dataclass(frozen=True, slots=True)
class Option:
    replica: Replica
    seconds: float
    decision: Decision
    source: Replica | None = None
    deadline_s: float | None = None


@dataclass(frozen=True, slots=True)
class ReplicaCost:
    """What the model needs to know of one replica."""

    held_tokens: int
    prompt_tps: float
    bytes_per_token: int
    pull_bps: float
    step_s: float = 0.0  # the replica's step time: a busy source's export waits for steps


def replica_cost(index: KVIndex, replica: Replica, runs: dict[str, int], bs: int) -> ReplicaCost:
    cache = index.replica(replica.endpoint)
    tps = cache.prompt_tps if cache is not None and cache.prompt_tps > 0 else DEFAULT_PROMPT_TPS
    bpt = cache.hello.bytes_per_token if cache is not None else 0
    bw = cache.pull_bps if cache is not None and cache.pull_bps > 0 else DEFAULT_PULL_BPS
    step = cache.step_s if cache is not None else 0.0
    return ReplicaCost(runs.get(replica.endpoint, 0) * bs, tps, bpt, bw, step)


def choose(
    candidates: Iterable[Replica],
    sources: Iterable[Replica],
    costs: dict[str, ReplicaCost],
    prompt_tokens: int,
    *,
    block_size: int,
    may_pull: bool,
    reserve: int = 0,
) -> Option | None:
    """The cheapest option among `candidates` (replicas with room), pulling only from one
    of `sources` (ready replicas); None when nobody holds a block (routing's affinity rule
    applies) or no candidate has room."""
    sources = list(sources)
    holder = max(sources, key=lambda r: costs[r.endpoint].held_tokens, default=None)
    top = 0 if holder is None else costs[holder.endpoint].held_tokens
    room = [r for r in candidates if r.has_room(reserve)]
    best_held = max((costs[r.endpoint].held_tokens for r in room), default=0)
    if max(top, best_held) == 0 or not room:
        return None
    n = prompt_tokens
    options: list[Option] = []
    for r in room:
        c = costs[r.endpoint]
        q = r.outstanding_tokens / c.prompt_tps
        recompute = q + max(0, n - c.held_tokens) / c.prompt_tps
        label: Decision = "go_to_holder" if c.held_tokens >= top else "recompute"
        options.append(Option(r, recompute, label))
        missing = top - c.held_tokens
        if not may_pull or holder is None or holder is r or not c.bytes_per_token:
            continue
        if missing < MIN_PULL_BLOCKS * block_size:
            continue
        source = costs[holder.endpoint]
        transfer = PULL_RTT_S + missing * c.bytes_per_token / source.pull_bps
        if holder.outstanding:  # it pins and unpins each window between its own steps
            windows = -(-missing // (WINDOW_BLOCKS * block_size))
            transfer += windows * source.step_s  # two waits of half a step on average
        pull = max(q, transfer) + max(0, n - top) / c.prompt_tps
        saved_compute = missing / c.prompt_tps
        if recompute - pull >= max(MIN_GAIN_S, 0.5 * saved_compute):
            deadline = max(MIN_PULL_DEADLINE_S, 0.5 * saved_compute)
            options.append(Option(r, pull, "pull", holder, deadline))
    order = {"go_to_holder": 0, "pull": 1, "recompute": 2, "local": 3}
    return min(
        options,
        key=lambda o: (o.seconds, order[o.decision], o.replica.outstanding, o.replica.endpoint),
    )


def route_by_contents(
    replicas: Iterable[Replica],
    index: KVIndex,
    hashes: tuple[int, ...],
    now: float,
    config: GatewayDeployment,
    reserve: int = 0,
) -> Option | None:
    """`choose` over a pool's routable replicas for a prompt of these block hashes (a
    batch request's: over their slots beyond `reserve`)."""
    block_size, pull_min_tokens = config.block_size, config.kv_pull_min_tokens
    if not hashes or not index.per_replica:
        return None
    runs = index.held_runs(hashes)
    if not runs:
        return None
    every = list(replicas)
    costs = {r.endpoint: replica_cost(index, r, runs, block_size) for r in every}
    n = len(hashes) * block_size
    may_pull = pull_min_tokens is not None and n >= pull_min_tokens
    return choose(
        [r for r in every if r.routable(now)],
        [r for r in every if r.state is ReplicaHealth.READY],
        costs,
        n,
        block_size=block_size,
        may_pull=may_pull,
        reserve=reserve,
    )
