"""`GET /internal/usage`: a deployment's chargeback report for a period, for the platform team.

Served on the internal port only, behind the internal key (it names every tenant and what each
costs): the same boundary as `/metrics`. Query parameters, each honoured or a 400 naming it:
`deployment` (required unless the gateway serves one), `from` and `to` (unix seconds or ISO
8601 with a zone; default: the last 24 hours), `format` (`json` or `csv`).

The numbers are counter increases read from the Prometheus the platform configured
(`usage_prometheus_url`; `servefleet.api.usage_query` says why Prometheus), priced with the
deployment's spec.chargeback and spec.prices. The engines' series are selected
by their Service (`namespace`, `service`, as a ServiceMonitor labels them) or, for static
replicas, by `instance` (their host:port); the gateway's by the deployment's model.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from urllib.parse import parse_qsl

from servefleet.api.chargeback import IdlePolicy
from servefleet.api.chargeback_spec import Prices
from servefleet.api.gateway_config import GatewayDeployment
from servefleet.api.openai_errors import OpenAIError
from servefleet.api.usage_query import QueryFn, iso_time, parse_time, usage_inputs
from servefleet.api.usage_report import UsageReport, build_report, to_csv
from servefleet.gateway.asgi import Scope, Send, respond

USAGE_PATH = "/internal/usage"
PARAMS = ("deployment", "from", "to", "format")
DEFAULT_PERIOD_S = 86400.0
CSV = b"text/csv; charset=utf-8"


def _bad(message: str, param: str) -> OpenAIError:
    return OpenAIError(status=400, message=message, param=param)


def parse_params(scope: Scope) -> dict[str, str]:
    """The query string, each parameter once and known (else a 400 naming it)."""
    raw = scope.get("query_string", b"").decode("latin-1")
    params: dict[str, str] = {}
    for name, value in parse_qsl(raw, keep_blank_values=True):
        if name not in PARAMS:
            raise _bad(f"unknown parameter {name!r} (takes {', '.join(PARAMS)})", name)
        if name in params:
            raise _bad(f"{name} is given twice", name)
        params[name] = value
    if params.get("format", "json") not in ("json", "csv"):
        raise _bad("format must be json or csv", "format")
    return params


def pick_deployment(pools: dict[str, GatewayDeployment], name: str | None) -> GatewayDeployment:
    if name is None:
        if len(pools) != 1:
            raise _bad(f"name one of {sorted(pools)}", "deployment")
        return next(iter(pools.values()))
    if name not in pools:
        raise OpenAIError(status=404, message=f"Unknown deployment {name!r}", code="not_found")
    return pools[name]


def _quoted(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


def selectors(config: GatewayDeployment) -> tuple[str, str]:
    """(engine selector, gateway selector) of one deployment's series."""
    if config.service is not None:
        engine = f'namespace="{_quoted(config.service.namespace)}", '
        engine += f'service="{_quoted(config.service.name)}"'
    else:
        hosts = [re.sub(r"^https?://", "", e).rstrip("/") for e in config.endpoints]
        pattern = "|".join(re.escape(h) for h in hosts) or "$^"  # no replicas: no series
        engine = f'instance=~"{_quoted(pattern)}"'
    return engine, f'model="{_quoted(config.model)}"'


def period(params: dict[str, str], now: float) -> tuple[float, float]:
    try:
        end = parse_time(params["to"]) if "to" in params else now
    except ValueError as exc:
        raise _bad(str(exc), "to") from None
    try:
        start = parse_time(params["from"]) if "from" in params else end - DEFAULT_PERIOD_S
    except ValueError as exc:
        raise _bad(str(exc), "from") from None
    if end <= start:
        raise _bad("the period must end after it starts", "to")
    return start, end


async def send_usage(
    deployments: dict[str, GatewayDeployment],
    scope: Scope,
    send: Send,
    query: QueryFn | None,
    clock: Callable[[], float] = time.time,
) -> None:
    params = parse_params(scope)
    config = pick_deployment(deployments, params.get("deployment"))
    if query is None:
        raise OpenAIError(
            status=501,
            message="No usage_prometheus_url is configured; the usage report reads Prometheus.",
            code="not_configured",
        )
    try:
        prices = Prices.resolve(config.prices)
    except ValueError as exc:
        raise OpenAIError(status=409, message=f"{config.name}: {exc}", code="unpriced") from None
    start, end = period(params, clock())
    report = await asyncio.to_thread(_report, config, prices, query, start, end)
    if params.get("format") == "csv":
        await respond(send, 200, to_csv(report).encode(), content_type=CSV)
    else:
        await respond(send, 200, report.model_dump_json().encode())


def _report(
    config: GatewayDeployment, prices: Prices, query: QueryFn, start: float, end: float
) -> UsageReport:
    engine, gateway = selectors(config)
    try:
        inputs = usage_inputs(query, start, end, engine, gateway)
    except RuntimeError as exc:
        raise OpenAIError(status=502, message=str(exc), type="upstream_error") from None
    policy = config.chargeback.idle if config.chargeback else IdlePolicy.PLATFORM
    return build_report(inputs, prices, policy, (iso_time(start), iso_time(end)))
