"""`servefleet usage`: the chargeback report per tenant for a period, as JSON or CSV.

Reads counter increases from Prometheus (`servefleet.api.usage_query`, which says why) and
applies one LLMDeployment's idle policy (`spec.chargeback`) and prices (`spec.prices`).
 The platform team runs it: Prometheus names every tenant.

    servefleet usage --prometheus http://prometheus:9090 -f deployment.yaml \
        --from 2026-11-01T00:00:00Z --to 2026-12-01T00:00:00Z --format csv
"""

from __future__ import annotations

import argparse
import sys
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prometheus", required=True, help="Prometheus base URL")
    parser.add_argument(
        "-f", "--file", required=True, help="LLMDeployment YAML whose spec prices the report"
    )
    parser.add_argument("--deployment", help="which LLMDeployment of the file (default: the only)")
    parser.add_argument("--from", dest="start", help="period start, ISO 8601 or unix seconds")
    parser.add_argument("--to", dest="end", help="period end (default: now)")
    parser.add_argument("--format", choices=("json", "csv"), default="json")
    parser.add_argument(
        "--engine-selector", default="", help='PromQL label matchers for engines: namespace="a"'
    )
    parser.add_argument("--gateway-selector", default="", help="the same for gateway series")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per query")


def run(args: argparse.Namespace) -> int:
    from servefleet.api.chargeback import IdlePolicy
    from servefleet.api.chargeback_spec import Prices
    from servefleet.api.manifests import load_llmdeployments
    from servefleet.api.usage_query import iso_time, parse_time, prometheus_query, usage_inputs
    from servefleet.api.usage_report import build_report, to_csv

    deployments = load_llmdeployments(args.file)
    chosen = [d for d in deployments if args.deployment in (None, d.metadata.name)]
    if len(chosen) != 1:
        names = ", ".join(d.metadata.name for d in deployments)
        print(f"servefleet usage: name one deployment with --deployment ({names})", file=sys.stderr)
        return 2
    spec = chosen[0].spec
    try:
        end = parse_time(args.end) if args.end else time.time()
        start = parse_time(args.start) if args.start else end - 86400
        prices = Prices.resolve(spec.prices)
        query = prometheus_query(args.prometheus, args.timeout)
        inputs = usage_inputs(query, start, end, args.engine_selector, args.gateway_selector)
    except (ValueError, RuntimeError) as exc:
        print(f"servefleet usage: error: {exc}", file=sys.stderr)
        return 2
    policy = spec.chargeback.idle if spec.chargeback else IdlePolicy.PLATFORM
    period = (iso_time(start), iso_time(end))
    report = build_report(inputs, prices, policy, period)
    if args.format == "csv":
        sys.stdout.write(to_csv(report))
    else:
        sys.stdout.write(report.model_dump_json(indent=2) + "\n")
    return 0
