"""The routing-by-contents series, read from the pools at scrape time.

`servefleet_gateway_kv_route_decisions_total{deployment, model, decision}` counts each
dispatch by what the cost model decided (`kv_cost`; `local` when it had nothing to go on;
`pd` when a prefill replica computed the prompt, `pd`), and
`servefleet_gateway_kv_index_blocks{deployment, model}` is the size of each pool's index, and
`servefleet_gateway_kv_events_lag_seconds{deployment, model}` how far behind its engines' event
streams it runs (`EVENTS_LAG_METRIC`). The
tallies live in the pool (and move to a pool that replaces it), so nothing on the request
path touches Prometheus.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from servefleet.api.kv_events import (
    DECISION_LABEL,
    DECISIONS,
    EVENTS_LAG_METRIC,
    INDEX_BLOCKS_METRIC,
)
from servefleet.api.kv_events import ROUTE_DECISIONS_METRIC as DECISIONS_METRIC
from servefleet.gateway.pool import DeploymentPool


class KVRouteCollector(Collector):
    def __init__(self, pools: Callable[[], Iterable[DeploymentPool]]) -> None:
        self._pools = pools

    def collect(self) -> Iterator[Metric]:
        labels = ["deployment", "model"]
        decisions = CounterMetricFamily(
            DECISIONS_METRIC.removesuffix("_total"),
            "Dispatches by the KV cache-contents routing decision.",
            labels=[*labels, DECISION_LABEL],
        )
        blocks = GaugeMetricFamily(
            INDEX_BLOCKS_METRIC, "(block, replica) pairs in the KV index.", labels=labels
        )
        lag = GaugeMetricFamily(
            EVENTS_LAG_METRIC,
            "How late the newest applied KV event batch was, the most of any replica.",
            labels=labels,
        )
        for pool in self._pools():
            if pool.config.kv_pull_min_tokens is None and pool.config.prefill is None:
                continue  # neither routed by contents nor disaggregated
            for decision in DECISIONS:
                count = pool.kv_decisions.get(decision, 0)  # type: ignore[call-overload]
                decisions.add_metric([pool.name, pool.model, decision], count)
            blocks.add_metric([pool.name, pool.model], pool.kv_index.blocks)
            lags = [cache.lag_s for cache in pool.kv_index.per_replica.values()]
            lag.add_metric([pool.name, pool.model], max(lags, default=0.0))
        yield decisions
        yield blocks
        yield lag
