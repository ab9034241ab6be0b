"""The fault suite's short run (`servefleet.bench.fault_suite`; the long one is `make soak`):
two engines on the real model, two gateways and Redis as real processes, one fault per test
under load. A scenario returns the invariants it broke; its figures are shown only then.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from servefleet.bench.fault_common import Scale
from servefleet.bench.fault_stack import Stack
from servefleet.bench.fault_suite import SCENARIOS, SHAPE


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with Stack(tmp_path_factory.mktemp("faults"), SHAPE) as running:
        yield running


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_fault_loses_nothing(stack: Stack, name: str) -> None:
    result = SCENARIOS[name](stack, Scale.short())
    report = json.dumps(result.figures, indent=1)
    assert not result.violations, f"{name}: {result.violations}\n{report}"
    assert all(part.alive() for part in stack.parts()), "a process of the stack died"
