"""Where the usage report's inputs come from: counter increases over the period, in Prometheus.

Prometheus is the source because it already holds every replica's and every gateway's
counters, survives their restarts (`increase` handles counter resets) and answers any period;
neither the gateway nor an engine keeps history. The queries sum over all series the selectors
match (e.g. `namespace="team-a"`), so a period that spans scale-ups and restarts is covered.
`query` is whatever runs an instant PromQL query at a time: the CLI's HTTP client, or a test's.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime

from servefleet.api import chargeback as cb
from servefleet.api.usage_report import TenantTokens, UsageInputs

Sample = tuple[dict[str, str], float]
QueryFn = Callable[[str, float], list[Sample]]


def _increase(metric: str, selector: str, window_s: int, by: str = "") -> str:
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} (increase({metric}_total{{{selector}}}[{window_s}s]))"


def usage_inputs(
    query: QueryFn, start: float, end: float, engine_selector: str = "", gateway_selector: str = ""
) -> UsageInputs:
    """The period [start, end] (unix seconds) read as one increase each, evaluated at `end`."""
    if end <= start:
        raise ValueError("the period must end after it starts (--to after --from)")
    window = max(1, round(end - start))
    e, g = engine_selector, gateway_selector

    def scalar(promql: str) -> float:
        return sum(value for _, value in query(promql, end))

    def by_tenant(promql: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for labels, value in query(promql, end):
            tenant = labels.get(cb.TENANT_LABEL, cb.UNATTRIBUTED)
            out[tenant] = out.get(tenant, 0.0) + value
        return out

    prompt = by_tenant(_increase(cb.GATEWAY_PROMPT_TOKENS, g, window, cb.TENANT_LABEL))
    completion = by_tenant(_increase(cb.GATEWAY_COMPLETION_TOKENS, g, window, cb.TENANT_LABEL))
    spilled: dict[str, TenantTokens] = {}
    by = f"{cb.TENANT_LABEL}, {cb.KIND_LABEL}"
    for labels, value in query(_increase(cb.GATEWAY_SPILLED_TOKENS, g, window, by), end):
        tokens = spilled.setdefault(labels.get(cb.TENANT_LABEL, cb.UNATTRIBUTED), TenantTokens())
        if labels.get(cb.KIND_LABEL) == cb.PROMPT:
            tokens.prompt += value
        else:
            tokens.completion += value
    return UsageInputs(
        busy_seconds=by_tenant(_increase(cb.ENGINE_BUSY_SECONDS, e, window, cb.TENANT_LABEL)),
        idle_seconds=scalar(_increase(cb.ENGINE_IDLE_SECONDS, e, window)),
        replica_seconds=scalar(_increase(cb.ENGINE_REPLICA_SECONDS, e, window)),
        tokens={
            t: TenantTokens(prompt=prompt.get(t, 0.0), completion=completion.get(t, 0.0))
            for t in {*prompt, *completion}
        },
        spilled=spilled,
    )


def parse_time(text: str) -> float:
    """Unix seconds, or ISO 8601 (a trailing Z is UTC; no zone is refused, not guessed)."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        parsed = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"{text!r} is neither unix seconds nor an ISO 8601 time") from None
    if parsed.tzinfo is None:
        raise ValueError(f"{text!r} has no time zone: add Z or an offset")
    return parsed.timestamp()


def iso_time(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")


def prometheus_query(base_url: str, timeout: float) -> QueryFn:
    """An instant-query function on Prometheus' HTTP API; a refusal is a RuntimeError."""
    import httpx

    def query(promql: str, at: float) -> list[Sample]:
        try:
            response = httpx.get(
                f"{base_url.rstrip('/')}/api/v1/query",
                params={"query": promql, "time": f"{at:.3f}"},
                timeout=timeout,
            )
            body = response.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise RuntimeError(f"Prometheus at {base_url} did not answer: {exc}") from None
        if response.status_code != 200 or body.get("status") != "success":
            raise RuntimeError(f"Prometheus refused {promql}: {body.get('error', response.text)}")
        return [(r["metric"], float(r["value"][1])) for r in body["data"]["result"]]

    return query
