"""One place maps the spec onto what a replica takes, for every engine kind: the operator's
pod and local mode's capacity read the same `EngineResources`."""

from __future__ import annotations

from typing import Any

import pytest

from servefleet.api.engine_resources import EngineResources, engine_resources, parse_cpu
from servefleet.api.llmdeployment import LLMDeploymentSpec
from servefleet.local.capacity import footprint_from_spec

GIB = 1024**3


def _spec(kind: str, resources: dict[str, Any] | None = None) -> LLMDeploymentSpec:
    source = (
        {"builtin": "smollm2-135m-instruct"}
        if kind == "servefleet"
        else {"pvc": {"claimName": "models"}}
    )
    return LLMDeploymentSpec.model_validate(
        {
            "model": {"name": "m", "source": source},
            "engine": {"kind": kind, "resources": resources or {}},
        }
    )


@pytest.mark.parametrize("kind,shm", [("servefleet", False), ("vllm", True), ("sglang", True)])
def test_every_kind_is_mapped_in_one_place(kind: str, shm: bool) -> None:
    asked = {"requests": {"memory": "8Gi", "cpu": "500m"}, "limits": {"nvidia.com/gpu": 1}}
    resources = engine_resources(_spec(kind, asked))
    assert resources.container() == {
        "requests": {"cpu": "500m", "memory": "8Gi"},  # sorted, quantities as strings
        "limits": {"nvidia.com/gpu": "1"},
    }
    assert resources.gpus == 1 and resources.shared_memory is shm
    assert bool(resources.volumes()) is shm and bool(resources.mounts()) is shm
    assert (resources.cores, resources.memory_bytes) == (0.5, 8 * GIB)


def test_nothing_asked_is_nothing_rendered() -> None:
    resources = engine_resources(_spec("servefleet"))
    assert resources == EngineResources()
    assert resources.container() == {} and resources.volumes() == []
    assert (resources.cores, resources.memory_bytes, resources.gpus) == (None, None, 0)


def test_a_limit_alone_counts_as_the_request() -> None:
    resources = engine_resources(_spec("servefleet", {"limits": {"cpu": 3, "memory": "1Gi"}}))
    assert (resources.cores, resources.memory_bytes) == (3.0, GIB)
    assert resources.container() == {"limits": {"cpu": "3", "memory": "1Gi"}}
    footprint = footprint_from_spec(_spec("servefleet", {"limits": {"cpu": 3}}))
    assert footprint.cores == 3.0  # local mode reads the same mapping


def test_cpu_quantities() -> None:
    assert (parse_cpu("500m"), parse_cpu(2), parse_cpu("1.5")) == (0.5, 2.0, 1.5)
