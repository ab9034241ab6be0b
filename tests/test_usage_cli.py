"""`servefleet usage` against a Prometheus stand-in: the queries it sends, JSON and CSV out."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from servefleet.api import chargeback as cb
from servefleet.api.usage_query import parse_time, usage_inputs
from servefleet.bench import processes
from servefleet.cli.main import main

DEPLOYMENT = """\
apiVersion: servefleet.io/v1alpha1
kind: LLMDeployment
metadata: {name: smollm2}
spec:
  model: {name: smollm2-135m-instruct, source: {builtin: smollm2-135m-instruct}}
  chargeback:
    idle: shared
    replicaHour: 3.6
    hosted: {inputPerMillion: 1.0, outputPerMillion: 4.0}
"""

# metric -> the series an increase over the period returns
SERIES: dict[str, list[tuple[dict[str, str], float]]] = {
    cb.ENGINE_BUSY_SECONDS: [({"tenant": "ns/a"}, 300.0), ({"tenant": "ns/b"}, 100.0)],
    cb.ENGINE_IDLE_SECONDS: [({}, 600.0)],
    cb.ENGINE_REPLICA_SECONDS: [({}, 1000.0)],
    cb.GATEWAY_PROMPT_TOKENS: [({"tenant": "ns/a"}, 6e5), ({"tenant": "ns/b"}, 2e6)],
    cb.GATEWAY_COMPLETION_TOKENS: [({"tenant": "ns/a"}, 2e5), ({"tenant": "ns/b"}, 1e5)],
    cb.GATEWAY_SPILLED_TOKENS: [
        ({"tenant": "ns/b", "kind": "prompt"}, 1e6),
        ({"tenant": "ns/b", "kind": "completion"}, 0.0),
    ],
}


def _fake_prometheus(seen: list[dict[str, str]]) -> Starlette:
    async def query(request: Request) -> JSONResponse:
        params = dict(request.query_params)
        seen.append(params)
        metric = next(m for m in SERIES if m + "_total{" in params["query"])
        result = [{"metric": labels, "value": [0, str(v)]} for labels, v in SERIES[metric]]
        data = {"resultType": "vector", "result": result}
        return JSONResponse({"status": "success", "data": data})

    return Starlette(routes=[Route("/api/v1/query", query)])


def _run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(["usage", *args])
    return code, capsys.readouterr().out


def test_usage_reads_one_increase_per_counter_and_prices_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = tmp_path / "d.yaml"
    spec.write_text(DEPLOYMENT)
    seen: list[dict[str, str]] = []
    with processes.serve_in_thread(_fake_prometheus(seen), lifespan="off") as url:
        common = ["--prometheus", url, "-f", str(spec), "--from", "1000", "--to", "4600"]
        code, out = _run([*common, "--engine-selector", 'namespace="ns"'], capsys)
        assert code == 0
        report: dict[str, Any] = json.loads(out)
        code, text = _run([*common, "--format", "csv"], capsys)
        assert code == 0
    assert all(q["time"] == "4600.000" and "[3600s]" in q["query"] for q in seen)
    assert any('busy_seconds_total{namespace="ns"}' in q["query"] for q in seen)
    rows = {r["tenant"]: r for r in report["tenants"]}
    assert report["idle_policy"] == "shared" and report["conservation_error"] == 0.0
    assert rows["ns/a"]["idle_share_seconds"] == pytest.approx(450.0)
    assert rows["ns/a"]["cost"] == pytest.approx(0.75)
    assert rows["ns/b"]["spilled_cost"] == pytest.approx(1.0)
    assert report["period_from"] == "1970-01-01T00:16:40Z"
    lines = list(csv.DictReader(io.StringIO(text)))
    assert [line["tenant"] for line in lines] == ["ns/a", "ns/b"]


def test_usage_refuses_a_backwards_period_and_a_zoneless_time(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = tmp_path / "d.yaml"
    spec.write_text(DEPLOYMENT)
    args = ["--prometheus", "http://127.0.0.1:9", "-f", str(spec)]
    assert main(["usage", *args, "--from", "20", "--to", "10"]) == 2
    assert "must end after it starts" in capsys.readouterr().err
    assert main(["usage", *args, "--from", "2026-11-01T00:00:00"]) == 2
    assert "no time zone" in capsys.readouterr().err
    assert parse_time("2026-11-01T00:00:00Z") == 1_793_491_200.0


def test_inputs_group_spilled_tokens_by_kind() -> None:
    def query(promql: str, at: float) -> list[tuple[dict[str, str], float]]:
        return next(v for m, v in SERIES.items() if m + "_total{" in promql)

    inputs = usage_inputs(query, 0.0, 60.0)
    assert inputs.spilled["ns/b"].prompt == 1e6 and inputs.spilled["ns/b"].completion == 0.0
    assert inputs.tokens["ns/b"].prompt == 2e6 and inputs.busy_seconds["ns/a"] == 300.0
