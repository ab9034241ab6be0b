"""The attack suite (`servefleet.bench.attack_suite`) against real processes: one hostile tenant
key against two engines on the real model, a gateway and Redis, then against `servefleet up`.
Each attack must fail *and* leave another tenant's p99 within 2x of its quiet window, measured
on the same stack just before the attack (and, when only that p99 fails, just after it too:
`attack_suite.rejudge_after_quiet`). The table is written to bench/results/attacks.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from servefleet.bench.attack_common import AttackResult
from servefleet.bench.attack_suite import (
    ATTACKS,
    Target,
    local_stack,
    run_attack,
    serving_stack,
    write_report,
)

ROOT = Path(__file__).resolve().parents[1]
RESULTS: list[AttackResult] = []


@pytest.fixture(scope="module")
def report() -> Iterator[None]:
    yield
    if RESULTS:
        write_report(RESULTS, ROOT / "bench" / "results" / "attacks")


@pytest.fixture(scope="module")
def stack_target(tmp_path_factory: pytest.TempPathFactory, report: None) -> Iterator[Target]:
    with serving_stack(tmp_path_factory.mktemp("attacks")) as target:
        yield target


@pytest.fixture(scope="module")
def local_target(tmp_path_factory: pytest.TempPathFactory, report: None) -> Iterator[Target]:
    with local_stack(tmp_path_factory.mktemp("attacks-local")) as target:
        yield target


def _check(name: str, target: Target) -> None:
    result = run_attack(ATTACKS[name], target)
    RESULTS.append(result)
    assert not result.violations, f"{name}: {result.violations}\n{result.figures}\n{result.victim}"


@pytest.mark.parametrize("name", [n for n, a in ATTACKS.items() if a.target == "stack"])
def test_serving_attack_fails_and_victim_keeps_latency(name: str, stack_target: Target) -> None:
    _check(name, stack_target)


@pytest.mark.parametrize("name", [n for n, a in ATTACKS.items() if a.target == "local"])
def test_local_attack_fails_and_victim_keeps_latency(name: str, local_target: Target) -> None:
    _check(name, local_target)
