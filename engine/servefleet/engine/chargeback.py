"""The engine's side of chargeback: each step's wall time billed to its sequences' tenants.

The rule lives in `servefleet.api.chargeback` (weighted rows, measured prompt weight, idle =
the loop's time outside steps). This module keeps the running sums and exports them as one
Prometheus collector, so a scrape reads busy, idle and replica seconds at the same instant:
idle is brought up to the scrape's time unless a step is running, and a step is billed when it
ends, so the only gap between busy + idle and replica seconds is the step in progress.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
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
        self.tokens: dict[tuple[str, str, str], int] = {}
        self.idle = 0.0
        if registry is not None:
            registry.register(self)  # type: ignore[arg-type]

    # ---- the engine thread ----------------------------------------------------------------
    def begin_step(self, now: float) -> None:
        """A step starts: the time since the last mark was idle."""
        with self._lock:
            self.idle += max(0.0, now - self._mark)
            self._mark, self._in_step = now, True

    def end_step(self, out: SchedulerOutput, now: float) -> None:
        """A step ended: bill its time (since `begin_step`) to the sequences in it."""
        shares = [self._share(c.seq, 0, 1 + len(c.draft_token_ids)) for c in out.decodes]
        shares += [self._share(c.seq, c.num_new_tokens, 0) for c in out.prefills]
        with self._lock:
            seconds = max(0.0, now - self._mark)
            self._mark, self._in_step = now, False
            if not shares:
                self.idle += seconds
                return
            for key, part in cb.split_step(seconds, shares, self.cost.prompt_weight).items():
                self.busy[key] = self.busy.get(key, 0.0) + part
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
            key = (tenant, model, kind)
            self.tokens[key] = self.tokens.get(key, 0) + n

    # ---- readers --------------------------------------------------------------------------
    def settle(self) -> tuple[float, float, float]:
        """(busy, idle, replica) seconds now: idle brought up to now unless a step runs."""
        with self._lock:
            now = self._clock()
            if not self._in_step:
                self.idle += max(0.0, now - self._mark)
                self._mark = now
            return sum(self.busy.values()), self.idle, now - self._start

    def collect(self) -> Iterator[Metric]:
        _, idle, replica = self.settle()
        with self._lock:
            busy, tokens = dict(self.busy), dict(self.tokens)
        labels = [cb.TENANT_LABEL, cb.MODEL_LABEL]
        family = CounterMetricFamily(
            cb.ENGINE_BUSY_SECONDS, "Step wall time billed to each tenant and model.", labels=labels
        )
        for (tenant, model), seconds in sorted(busy.items()):
            family.add_metric([tenant, model], seconds)
        yield family
        counted = CounterMetricFamily(
            cb.ENGINE_ATTRIBUTED_TOKENS,
            "Prompt tokens computed and decode rows run, per tenant and model.",
            labels=[*labels, cb.KIND_LABEL],
        )
        for key, n in sorted(tokens.items()):
            counted.add_metric(list(key), n)
        yield counted
        yield CounterMetricFamily(
            cb.ENGINE_IDLE_SECONDS, "Engine loop time outside steps.", value=idle
        )
        yield CounterMetricFamily(
            cb.ENGINE_REPLICA_SECONDS, "Wall time since the engine was built.", value=replica
        )

    def describe(self) -> list[Metric]:
        return []  # collected lazily: registration must not run `collect`
