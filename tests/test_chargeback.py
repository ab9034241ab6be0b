"""Chargeback's rule and arithmetic without a model: step splitting, idle, caps, the report."""

from __future__ import annotations

import csv
import io

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from servefleet.api import chargeback as cb
from servefleet.api.chargeback_spec import HostedPrices, Prices
from servefleet.api.llmdeployment import LLMDeploymentSpec
from servefleet.api.prices_spec import PricesSpec
from servefleet.api.usage_report import (
    PLATFORM_ROW,
    TenantTokens,
    UsageInputs,
    build_report,
    to_csv,
)
from servefleet.autoscaler.spec import targets_from_spec
from servefleet.engine.chargeback import EngineChargeback
from servefleet.engine.sampling_params import SamplingParams
from servefleet.engine.scheduler import ScheduledChunk, SchedulerOutput
from servefleet.engine.sequence import Sequence


def test_a_step_is_split_by_weighted_rows_and_adds_up() -> None:
    shares = [
        cb.StepShare("a", "m", prompt_tokens=30),
        cb.StepShare("b", "m", decode_rows=1),
        cb.StepShare("b", "m", decode_rows=2),
        cb.StepShare("c", "lora-x", decode_rows=1),
    ]
    parts = cb.split_step(0.4, shares, prompt_weight=0.1)  # weights 3, 1, 2, 1
    assert parts[("a", "m")] == pytest.approx(0.4 * 3 / 7)
    assert parts[("b", "m")] == pytest.approx(0.4 * 3 / 7)
    assert parts[("c", "lora-x")] == pytest.approx(0.4 / 7)
    assert sum(parts.values()) == pytest.approx(0.4)
    assert cb.split_step(1.0, [cb.StepShare("a", "m"), cb.StepShare("b", "m")], 1.0) == {
        ("a", "m"): 0.5,
        ("b", "m"): 0.5,
    }


def test_the_prompt_weight_is_measured_from_steps_of_one_kind() -> None:
    cost = cb.StepCostModel()
    assert cost.prompt_weight == 1.0  # nothing measured yet
    cost.observe(0.2, prompt_tokens=100, decode_rows=0)  # 2 ms a prompt token
    assert cost.prompt_weight == 1.0  # decode not measured yet
    cost.observe(0.04, prompt_tokens=0, decode_rows=2)  # 20 ms a decode row
    cost.observe(9.0, prompt_tokens=5, decode_rows=5)  # mixed: not a measurement
    assert cost.prompt_weight == pytest.approx(0.1)


def test_only_a_trusted_stamp_names_the_tenant() -> None:
    assert cb.tenant_label("team/a", trusted=True) == "team/a"
    assert cb.tenant_label("team/a", trusted=False) == cb.UNATTRIBUTED
    assert cb.tenant_label(None, trusted=True) == cb.UNATTRIBUTED
    assert cb.tenant_label("x" * 500, trusted=True) == cb.UNATTRIBUTED
    assert cb.tenant_label("a\nb", trusted=True) == cb.UNATTRIBUTED


def test_distinct_tenants_are_capped_into_other() -> None:
    cap = cb.LabelCap(2, fixed=(cb.UNATTRIBUTED,))
    assert [cap(t) for t in ("a", "b", "c", "a", cb.UNATTRIBUTED)] == [
        "a",
        "b",
        cb.OTHER_TENANT,
        "a",
        cb.UNATTRIBUTED,
    ]


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _seq(tenant: str, prompt: int = 4) -> Sequence:
    return Sequence(list(range(prompt)), SamplingParams(max_tokens=4), 0.0, tenant=tenant)


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[str, ...]], float]:
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.values()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("servefleet_engine_")
    }


def test_busy_plus_idle_is_the_replica_time_and_steps_go_to_their_tenants() -> None:
    clock, registry = FakeClock(), CollectorRegistry()
    charge = EngineChargeback(registry, "base", clock=clock)
    a, b = _seq("t/a", prompt=8), _seq("t/b")
    clock.now += 3.0  # idle
    charge.begin_step(clock.now)
    clock.now += 1.0
    out = SchedulerOutput(
        decodes=[ScheduledChunk(b, 1, 4)], prefills=[ScheduledChunk(a, 8, 0)]
    )  # weight 1: 8 prompt tokens vs 1 decode row, 8:1
    charge.end_step(out, clock.now)
    clock.now += 0.5  # idle again, up to the scrape
    values = _samples(registry)
    assert values[("servefleet_engine_busy_seconds_total", ("base", "t/a"))] == pytest.approx(8 / 9)
    assert values[("servefleet_engine_busy_seconds_total", ("base", "t/b"))] == pytest.approx(1 / 9)
    assert values[("servefleet_engine_idle_seconds_total", ())] == pytest.approx(3.5)
    assert values[("servefleet_engine_replica_seconds_total", ())] == pytest.approx(4.5)
    assert values[("servefleet_engine_attributed_tokens_total", ("base", "prompt", "t/a"))] == 8
    assert values[("servefleet_engine_attributed_tokens_total", ("base", "completion", "t/b"))] == 1


def test_a_scrape_during_a_step_leaves_only_that_step_out() -> None:
    clock = FakeClock()
    charge = EngineChargeback(None, "base", clock=clock)
    clock.now += 2.0
    charge.begin_step(clock.now)
    clock.now += 0.25
    busy, idle, replica = charge.settle()
    assert (busy, idle, replica) == (0.0, 2.0, 2.25)
    charge.end_step(SchedulerOutput(decodes=[ScheduledChunk(_seq("x"), 1, 4)]), clock.now)
    busy, idle, replica = charge.settle()
    assert busy + idle == pytest.approx(replica)


PRICES = Prices(
    replica_hour=3.6, hosted=HostedPrices(input_per_million=1.0, output_per_million=4.0)
)  # one replica-second costs 0.001


def _inputs() -> UsageInputs:
    return UsageInputs(
        busy_seconds={"a": 300.0, "b": 100.0},
        idle_seconds=600.0,
        replica_seconds=1000.0,
        tokens={
            "a": TenantTokens(prompt=600_000, completion=200_000),
            "b": TenantTokens(prompt=100_000, completion=100_000),
            "c": TenantTokens(prompt=1_000_000, completion=0),
        },
        spilled={"c": TenantTokens(prompt=1_000_000, completion=0)},
    )


def test_report_platform_policy_keeps_idle_on_the_platform_row() -> None:
    report = build_report(_inputs(), PRICES, cb.IdlePolicy.PLATFORM, ("f", "t"))
    rows = {r.tenant: r for r in report.tenants}
    assert rows["a"].self_hosted_cost == pytest.approx(0.3)
    assert rows["a"].idle_share_seconds == 0.0
    assert rows[PLATFORM_ROW].cost == pytest.approx(0.6)
    assert rows["c"].spilled_cost == pytest.approx(1.0) and rows["c"].busy_seconds == 0.0
    assert rows["a"].all_hosted_cost == pytest.approx(0.6 + 0.8)
    # 400 busy seconds served 1,000,000 tokens: c's million spilled tokens, self-hosted, 0.4.
    assert rows["c"].all_self_hosted_cost == pytest.approx(0.4)
    assert report.total_cost == pytest.approx(1.0 + 1.0)  # replicas 1000 s + c's spill
    assert report.total_all_hosted_cost == pytest.approx(1.4 + 0.5 + 1.0)
    assert report.total_all_self_hosted_cost == pytest.approx(1.0 + 0.4)
    assert report.conservation_error == pytest.approx(0.0)


def test_report_shared_policy_spreads_idle_by_busy_share() -> None:
    inputs = _inputs().model_copy(update={"replica_seconds": 1010.0})
    report = build_report(inputs, PRICES, cb.IdlePolicy.SHARED, ("f", "t"))
    rows = {r.tenant: r for r in report.tenants}
    assert PLATFORM_ROW not in rows
    assert rows["a"].idle_share_seconds == pytest.approx(450.0)
    assert rows["b"].idle_share_seconds == pytest.approx(150.0)
    assert rows["a"].self_hosted_cost == pytest.approx(0.75)
    assert report.conservation_error == pytest.approx(10 / 1010)
    lines = list(csv.DictReader(io.StringIO(to_csv(report))))
    assert [line["tenant"] for line in lines] == ["a", "b", "c"]
    assert float(lines[0]["cost"]) == pytest.approx(0.75)


BASE = {"model": {"name": "m", "source": {"builtin": "smollm2-135m-instruct"}}}
TABLE = {"inputPerMillion": 0.15, "outputPerMillion": 0.6}


def test_one_price_each_in_spec_prices_and_the_old_spellings_map_there() -> None:
    """spec.prices is the one definition; the report and the autoscaler read it."""
    spec = LLMDeploymentSpec.model_validate(
        BASE | {"prices": {"replicaHour": 2.0, "hosted": TABLE}}
    )
    prices = Prices.resolve(spec.prices)
    assert prices.replica_hour == 2.0 and prices.hosted.output_per_million == 0.6
    assert targets_from_spec(spec).replica_cost_per_hour is None  # rent-or-buy is off
    on = LLMDeploymentSpec.model_validate(
        BASE | {"prices": {"replicaHour": 2.0, "hosted": TABLE}, "autoscaling": {"prices": {}}}
    )
    assert targets_from_spec(on).replica_cost_per_hour == 2.0
    assert targets_from_spec(on).spill_cost_per_million_tokens == pytest.approx(0.375)
    # The deprecated spellings: the autoscaler's blended price, chargeback's own.
    old = LLMDeploymentSpec.model_validate(
        BASE | {"autoscaling": {"prices": {"replicaHour": 3.0, "spillPerMillionTokens": 5.0}}}
    )
    assert old.prices == PricesSpec(
        replica_hour=3.0, hosted=HostedPrices(input_per_million=5.0, output_per_million=5.0)
    )
    assert targets_from_spec(old).spill_cost_per_million_tokens == 5.0  # as before
    charged = LLMDeploymentSpec.model_validate(
        BASE | {"chargeback": {"replicaHour": 2.5, "hosted": TABLE}}
    )
    assert Prices.resolve(charged.prices).replica_hour == 2.5
    with pytest.raises(ValueError, match=r"spec.prices.replicaHour"):
        Prices.resolve(PricesSpec(hosted=HostedPrices(input_per_million=1, output_per_million=1)))
    with pytest.raises(ValueError, match=r"spec.prices.hosted"):
        Prices.resolve(PricesSpec(replica_hour=1.0))


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        (
            {"prices": {"replicaHour": 2.0}, "chargeback": {"replicaHour": 3.0}},
            "spec.chargeback.replicaHour and spec.prices.replicaHour",
        ),
        (
            {
                "chargeback": {"hosted": TABLE},
                "autoscaling": {"prices": {"replicaHour": 1.0, "spillPerMillionTokens": 2.0}},
            },
            "spec.autoscaling.prices.spillPerMillionTokens and spec.chargeback.hosted",
        ),
        ({"autoscaling": {"prices": {"spillPatience": 2}}}, "set spec.prices.replicaHour"),
    ],
    ids=["two-replica-hours", "two-hosted-prices", "rent-or-buy-unpriced"],
)
def test_one_price_with_two_values_is_refused_naming_spec_prices(
    fields: dict[str, object], named: str
) -> None:
    with pytest.raises(ValueError, match=named):
        LLMDeploymentSpec.model_validate(BASE | fields)


def test_the_spec_takes_a_chargeback_block_and_refuses_unknown_fields() -> None:
    base = {"model": {"name": "m", "source": {"builtin": "smollm2-135m-instruct"}}}
    spec = LLMDeploymentSpec.model_validate(
        base
        | {
            "chargeback": {
                "idle": "shared",
                "replicaHour": 2.5,
                "hosted": {"inputPerMillion": 0.15, "outputPerMillion": 0.6},
            }
        }
    )
    assert spec.chargeback is not None and spec.chargeback.idle is cb.IdlePolicy.SHARED
    with pytest.raises(ValueError, match="idle"):
        LLMDeploymentSpec.model_validate(base | {"chargeback": {"idle": "tenants"}})
    with pytest.raises(ValueError, match=r"replicaHour|replica_hour"):
        LLMDeploymentSpec.model_validate(base | {"chargeback": {"replicaHour": -1}})
