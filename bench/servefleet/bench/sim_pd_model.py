"""Step-level model of a pool of engine replicas: colocated, or split into prefill and decode.

Every replica runs steps back to back while it has work; a step costs `a + b × tokens` (the
fit in `sim_pd_fit`). A *colocated* replica schedules like our engine: every running decode
gets one token, then the rest of the token budget goes to prompt chunks, first come first
served (chunked prefill), so a long prompt's chunks ride in the same steps as other streams'
decodes. A *prefill* replica runs prompt chunks only and samples the first token; the prompt's
KV then crosses to a *decode* replica (`kv_bytes_per_token × prompt tokens / bandwidth`),
the first token with it, and the decode replica joins the stream at its next step boundary.
Decode replicas run one token per stream per step and nothing else.

A token's inter-token gap is measured per stream (now minus its previous token), so the
figures say what a client would see; nothing in here sleeps.
"""

from __future__ import annotations

import heapq
import itertools
from array import array
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from .sim_pd_fit import StepCost

Role = Literal["colocated", "prefill", "decode"]


class PDWorkload(BaseModel):
    """Requests sorted by arrival: when, prompt tokens, output tokens (the first included)."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    name: str
    duration_s: float
    arrivals_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray


class PoolSpec(BaseModel):
    """`prefill` = 0: a colocated pool of `decode` replicas; otherwise P prefill + D decode."""

    model_config = ConfigDict(frozen=True)

    prefill: int = Field(default=0, ge=0)
    decode: int = Field(ge=1, description="colocated replicas, or decode replicas under P/D")
    max_num_seqs: int = Field(default=64, ge=1, description="running streams per replica")
    max_batched_tokens: int = Field(default=512, ge=1, description="token budget of a step")
    kv_bandwidth_bytes_s: float = Field(default=1.25e9, gt=0, description="P to D link")

    @property
    def disaggregated(self) -> bool:
        return self.prefill > 0

    @property
    def replicas(self) -> int:
        return self.prefill + self.decode


@dataclass
class _Replica:
    idx: int
    role: Role
    waiting: deque[int] = field(default_factory=deque)
    prefilling: list[int] = field(default_factory=list)
    decoding: list[int] = field(default_factory=list)
    busy: bool = False
    chunks: list[tuple[int, int]] = field(default_factory=list)
    decodes: list[int] = field(default_factory=list)
    step_start: float = 0.0

    @property
    def load(self) -> int:
        return len(self.waiting) + len(self.prefilling) + len(self.decoding)


@dataclass
class PDResult:
    """Per request times and gap counts; per step role, times and token mix."""

    ttft_s: np.ndarray
    finish_s: np.ndarray
    gaps: np.ndarray
    slow_gaps: np.ndarray
    max_gap_s: np.ndarray
    step_role: list[str] = field(default_factory=list)
    step_start_s: list[float] = field(default_factory=list)
    step_end_s: list[float] = field(default_factory=list)
    step_prefill_tokens: list[int] = field(default_factory=list)
    step_decode_tokens: list[int] = field(default_factory=list)
    all_gaps_s: array[float] = field(default_factory=lambda: array("d"))
    """Every inter-token gap of every stream, as its client saw it."""
    token_log: list[tuple[int, float, int]] = field(default_factory=list)
    """(request, time, step index or -1 when it came with the KV); only when asked for."""

    def itl_quantile(self, q: float) -> float:
        return float(np.quantile(self.all_gaps_s, q)) if len(self.all_gaps_s) else 0.0


_ARRIVE, _STEP_END, _KV_IN = 0, 1, 2


class _PoolSim:
    def __init__(
        self, work: PDWorkload, pool: PoolSpec, cost: StepCost, itl_slo_s: float, log: bool
    ) -> None:
        self.w, self.pool, self.cost, self.itl_slo_s, self.log = work, pool, cost, itl_slo_s, log
        n = work.arrivals_s.size
        self.prompt = work.prompt_tokens.astype(np.int64)
        self.output = work.output_tokens.astype(np.int64)
        self.done_prompt = np.zeros(n, dtype=np.int64)
        self.emitted = np.zeros(n, dtype=np.int64)
        self.last_token = np.zeros(n)
        nan = np.full(n, np.nan)
        self.r = PDResult(
            ttft_s=nan.copy(),
            finish_s=nan.copy(),
            gaps=np.zeros(n, dtype=np.int64),
            slow_gaps=np.zeros(n, dtype=np.int64),
            max_gap_s=np.zeros(n),
        )
        prefill: list[Role] = ["prefill"]
        decode: list[Role] = ["decode" if pool.disaggregated else "colocated"]
        roles = prefill * pool.prefill + decode * pool.decode
        self.replicas = [_Replica(i, role) for i, role in enumerate(roles)]
        self.events: list[tuple[float, int, int, int, int]] = []
        self.seq = itertools.count()

    def push(self, t: float, kind: int, a: int, b: int = 0) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, a, b))

    def least_loaded(self, role: Role) -> _Replica:
        pool = [r for r in self.replicas if r.role == role]
        if role == "prefill":  # by prompt tokens still to compute, as a prompt-token queue
            return min(pool, key=lambda r: sum(self.prompt[i] for i in r.waiting) + r.load)
        return min(pool, key=lambda r: r.load)

    def arrive(self, req: int, now: float) -> None:
        role: Role = "prefill" if self.pool.disaggregated else "colocated"
        target = self.least_loaded(role)
        target.waiting.append(req)
        self.kick(target, now)

    def kick(self, rep: _Replica, now: float) -> None:
        if not rep.busy and rep.load:
            self.start_step(rep, now)

    def start_step(self, rep: _Replica, now: float) -> None:
        limit = self.pool.max_num_seqs
        if rep.role == "decode":
            while rep.waiting and len(rep.decoding) < limit:
                rep.decoding.append(rep.waiting.popleft())
        else:
            while rep.waiting and len(rep.prefilling) + len(rep.decoding) < limit:
                rep.prefilling.append(rep.waiting.popleft())
        rep.decodes = list(rep.decoding) if rep.role != "prefill" else []
        budget = self.pool.max_batched_tokens - len(rep.decodes)
        rep.chunks = []
        for req in rep.prefilling:
            if budget <= 0:
                break
            take = int(min(budget, self.prompt[req] - self.done_prompt[req]))
            rep.chunks.append((req, take))
            budget -= take
        tokens = len(rep.decodes) + sum(t for _, t in rep.chunks)
        if tokens == 0:  # a prefill replica whose streams all left: nothing to run
            rep.busy = False
            return
        rep.busy, rep.step_start = True, now
        self.push(now + self.cost.step_s(tokens), _STEP_END, rep.idx)

    def emit(self, req: int, now: float, step: int) -> None:
        """One more token of `req` reaches its client at `now`."""
        if self.emitted[req] == 0:
            self.r.ttft_s[req] = now
        else:
            gap = now - self.last_token[req]
            self.r.gaps[req] += 1
            self.r.slow_gaps[req] += gap > self.itl_slo_s
            self.r.max_gap_s[req] = max(self.r.max_gap_s[req], gap)
            self.r.all_gaps_s.append(gap)
        self.emitted[req] += 1
        self.last_token[req] = now
        if self.log:
            self.r.token_log.append((req, now, step))
        if self.emitted[req] >= self.output[req]:
            self.r.finish_s[req] = now

    def end_step(self, rep: _Replica, now: float) -> None:
        r = self.r
        step = len(r.step_role)
        r.step_role.append(rep.role)
        r.step_start_s.append(rep.step_start)
        r.step_end_s.append(now)
        r.step_prefill_tokens.append(sum(t for _, t in rep.chunks))
        r.step_decode_tokens.append(len(rep.decodes))
        for req in rep.decodes:
            self.emit(req, now, step)
            if self.emitted[req] >= self.output[req]:
                rep.decoding.remove(req)
        for req, take in rep.chunks:
            self.done_prompt[req] += take
            if self.done_prompt[req] < self.prompt[req]:
                continue
            rep.prefilling.remove(req)
            if rep.role == "prefill":
                self.hand_over(req, now)
                continue
            self.emit(req, now, step)  # the step that ends a prompt samples its first token
            if self.emitted[req] < self.output[req]:
                rep.decoding.append(req)
        rep.busy = False
        self.kick(rep, now)

    def hand_over(self, req: int, now: float) -> None:
        """The prompt's KV (and its first token) crosses to the least-loaded decode replica."""
        target = self.least_loaded("decode")
        seconds = self.cost.kv_bytes_per_token * float(self.prompt[req])
        seconds /= self.pool.kv_bandwidth_bytes_s
        self.push(now + seconds, _KV_IN, req, target.idx)

    def kv_in(self, req: int, rep: _Replica, now: float) -> None:
        self.emit(req, now, -1)
        if self.emitted[req] < self.output[req]:
            rep.waiting.append(req)
            self.kick(rep, now)

    def run(self) -> PDResult:
        for i, t in enumerate(self.w.arrivals_s):
            self.push(float(t), _ARRIVE, i)
        while self.events:
            now, _, kind, a, b = heapq.heappop(self.events)
            if kind == _ARRIVE:
                self.arrive(a, now)
            elif kind == _STEP_END:
                self.end_step(self.replicas[a], now)
            else:
                self.kv_in(a, self.replicas[b], now)
        return self.r


def simulate_pool(
    work: PDWorkload,
    pool: PoolSpec,
    cost: StepCost,
    itl_slo_s: float = 0.2,
    log_tokens: bool = False,
) -> PDResult:
    """Replay `work` on `pool`; `log_tokens` keeps every token's time and step (tests)."""
    return _PoolSim(work, pool, cost, itl_slo_s, log_tokens).run()
