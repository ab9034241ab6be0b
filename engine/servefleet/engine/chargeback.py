"""The engine's side of chargeback: each step's wall time billed to its sequences' tenants.

The rule lives in `servefleet.api.chargeback` (weighted rows, measured prompt weight, idle =
the loop's time outside steps). This module keeps the running sums as Prometheus counters.
Replica seconds are read at the scrape by a collector registered *before* the idle counter, and
reading them first brings idle up to the same instant (unless a step is running: a step is
billed when it ends), so the only gap between busy + idle and replica seconds in a scrape is
the step in progress.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, Metric

from servefleet.api import chargeback as cb

if TYPE_CHECKING:
    from servefleet.engine.scheduler import SchedulerOutput
    from servefleet.engine.sequence import Sequence


class EngineChargeback:
    """Busy seconds per (tenant, model), idle seconds and replica seconds of one engine."""

    def __init__(
        self,
        registry: CollectorRegistry | None,
        base_model: str,
        clock: Callable[[], float] = time.monotonic,
        tenant_limit: int = cb.TENANT_SERIES_LIMIT,
    ) -> None:
        self.base_model = base_model
        self.cost = cb.StepCostModel()
        self._clock = clock
        self._lock = threading.Lock()
        self._start = self._mark = clock()
        self._in_step = False
        self._cap = cb.LabelCap(tenant_limit, fixed=(cb.UNATTRIBUTED,))
        self.busy: dict[tuple[str, str], float] = {}
        self.idle = 0.0
        registry = registry if registry is not None else CollectorRegistry()
        registry.register(_ReplicaSeconds(self))  # before the idle counter (see the module doc)
        labels = [cb.TENANT_LABEL, cb.MODEL_LABEL]
        self._busy = Counter(
            cb.ENGINE_BUSY_SECONDS,
            "Step wall time billed to each tenant and model.",
            labels,
            registry=registry,
        )
        self._tokens = Counter(
            cb.ENGINE_ATTRIBUTED_TOKENS,
            "Prompt tokens computed and decode rows run, per tenant and model.",
            [*labels, cb.KIND_LABEL],
            registry=registry,
        )
        self._idle = Counter(
            cb.ENGINE_IDLE_SECONDS, "Engine loop time outside steps.", registry=registry
        )

    # ---- the engine thread ----------------------------------------------------------------
    def begin_step(self, now: float) -> None:
        """A step starts: the time since the last mark was idle."""
        with self._lock:
            self._add_idle(now - self._mark)
            self._mark, self._in_step = now, True

    def end_step(self, out: SchedulerOutput, now: float) -> None:
        """A step ended: bill its time (since `begin_step`) to the sequences in it."""
        shares = [self._share(c.seq, 0, 1 + len(c.draft_token_ids)) for c in out.decodes]
        shares += [self._share(c.seq, c.num_new_tokens, 0) for c in out.prefills]
        with self._lock:
            seconds = max(0.0, now - self._mark)
            self._mark, self._in_step = now, False
            if not shares:
                self._add_idle(seconds)
                return
            for key, part in cb.split_step(seconds, shares, self.cost.prompt_weight).items():
                self.busy[key] = self.busy.get(key, 0.0) + part
                self._busy.labels(*key).inc(part)
            for s in shares:
                self._count(s.tenant, s.model, cb.PROMPT, s.prompt_tokens)
                self._count(s.tenant, s.model, cb.COMPLETION, s.decode_rows)
        prompt = sum(s.prompt_tokens for s in shares)
        self.cost.observe(seconds, prompt, sum(s.decode_rows for s in shares))

    def _share(self, seq: Sequence, prompt_tokens: int, decode_rows: int) -> cb.StepShare:
        model = seq.lora.name if seq.lora is not None else self.base_model
        return cb.StepShare(self._cap(seq.tenant), model, prompt_tokens, decode_rows)

    def _count(self, tenant: str, model: str, kind: str, n: int) -> None:
        if n:
            self._tokens.labels(tenant, model, kind).inc(n)

    def _add_idle(self, seconds: float) -> None:
        if seconds > 0:
            self.idle += seconds
            self._idle.inc(seconds)

    # ---- readers --------------------------------------------------------------------------
    def settle(self) -> tuple[float, float, float]:
        """(busy, idle, replica) seconds now: idle brought up to now unless a step runs."""
        with self._lock:
            now = self._clock()
            if not self._in_step:
                self._add_idle(now - self._mark)
                self._mark = now
            return sum(self.busy.values()), self.idle, now - self._start


class _ReplicaSeconds:
    """The replica's wall time since the engine was built, read at the scrape (settling idle
    first, so the idle counter collected after it is up to the same instant)."""

    def __init__(self, owner: EngineChargeback) -> None:
        self._owner = owner

    def _family(self, value: float) -> CounterMetricFamily:
        doc = "Wall time since the engine was built (busy + idle, within the running step)."
        return CounterMetricFamily(cb.ENGINE_REPLICA_SECONDS, doc, value=value)

    def collect(self) -> Iterator[Metric]:
        yield self._family(self._owner.settle()[2])

    def describe(self) -> Iterator[Metric]:
        yield self._family(0.0)  # names only: describing must not settle
