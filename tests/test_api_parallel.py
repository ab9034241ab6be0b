"""Replicas bigger than one pod: `engine.pipelineParallelSize` and the pods-per-replica rule
(`servefleet.api.parallel`), in pydantic and in the CRD's CEL rules alike."""

from __future__ import annotations

import re
from typing import Any

import pytest
from pydantic import ValidationError

from servefleet.api import parallel
from servefleet.api.crd import crd_manifest
from servefleet.api.engine_spec import EngineSpec
from servefleet.api.llmdeployment import GROUP_DISAGGREGATION_MESSAGE, LLMDeploymentSpec


def engine(kind: str, tp: int, pp: int, gpus: int) -> dict[str, Any]:
    resources = {"limits": {"nvidia.com/gpu": gpus}} if gpus else {}
    return {
        "kind": kind,
        "tensorParallelSize": tp,
        "pipelineParallelSize": pp,
        "resources": resources,
    }


@pytest.mark.parametrize(
    ("kind", "tp", "pp", "gpus", "pods"),
    [
        ("vllm", 1, 1, 0, 1),
        ("vllm", 4, 2, 8, 1),  # fits one pod: TP and PP within it
        ("vllm", 8, 2, 8, 2),  # vLLM's LWS recipe: one stage per pod
        ("sglang", 4, 4, 4, 4),
        ("servefleet", 1, 1, 0, 1),
        ("servefleet", 2, 1, 0, 2),  # one rank per pod
        ("servefleet", 1, 4, 1, 4),
        ("servefleet", 2, 2, 0, 4),  # TP x PP ranks, one pod each
        ("servefleet", 4, 2, 1, 8),
    ],
)
def test_pods_per_replica(kind: str, tp: int, pp: int, gpus: int, pods: int) -> None:
    spec = EngineSpec.model_validate(engine(kind, tp, pp, gpus))
    assert spec.pods_per_replica() == pods


@pytest.mark.parametrize(
    ("kind", "tp", "pp", "gpus", "message"),
    [
        ("vllm", 2, 2, 3, parallel.STAGE_PER_POD_MESSAGE),
        ("vllm", 4, 1, 2, parallel.TP_GPUS_MESSAGE),
        ("sglang", 2, 2, 0, parallel.TP_GPUS_MESSAGE),
        ("servefleet", 2, 1, 2, parallel.OURS_ONE_GPU_MESSAGE),
        ("servefleet", 16, 8, 0, parallel.OURS_TOO_MANY_MESSAGE),
        ("servefleet", 65, 1, 0, "less than or equal to 64"),
        ("servefleet", 2, 2, 2, parallel.OURS_ONE_GPU_MESSAGE),
    ],
)
def test_groups_that_do_not_make_whole_pods_are_refused(
    kind: str, tp: int, pp: int, gpus: int, message: str
) -> None:
    with pytest.raises(ValidationError) as err:
        EngineSpec.model_validate(engine(kind, tp, pp, gpus))
    assert message in str(err.value)


def _cel_rules() -> list[tuple[str, str]]:
    schema = crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    rules = schema["properties"]["spec"]["properties"]["engine"]["x-kubernetes-validations"]
    return [(r["rule"], r["message"]) for r in rules]


def _cel_eval(rule: str, kind: str, tp: int, pp: int, gpus: int) -> bool:
    """The engine's parallelism rules are plain arithmetic: evaluated here as Python."""
    gpus_cel = re.search(r"\(has\(self\.resources\.limits\).*?: 0\)", rule)
    text = rule.replace(gpus_cel.group(0), str(gpus)) if gpus_cel else rule
    text = (
        text.replace("self.kind", repr(kind))
        .replace("self.tensorParallelSize", str(tp))
        .replace("self.pipelineParallelSize", str(pp))
        .replace("||", " or ")
        .replace("&&", " and ")
    )
    return bool(eval(text))


@pytest.mark.parametrize("kind", ["servefleet", "vllm", "sglang"])
def test_cel_rules_agree_with_pydantic(kind: str) -> None:
    rules = [
        (rule, message)
        for rule, message in _cel_rules()
        if "ParallelSize" in rule and "speculative" not in rule and "dtype" not in rule
    ]
    assert len(rules) == 4
    for tp in (1, 2, 4, 8, 16):
        for pp in (1, 2, 3, 8):
            for gpus in (0, 1, 2, 3, 4, 8):
                refused = parallel.group_refusal(kind, tp, pp, gpus)
                failed = [m for r, m in rules if not _cel_eval(r, kind, tp, pp, gpus)]
                assert (refused is None) == (not failed), (kind, tp, pp, gpus, failed)
                if refused is not None:
                    assert refused in failed


def test_disaggregation_needs_single_pod_replicas() -> None:
    with pytest.raises(ValidationError) as err:
        LLMDeploymentSpec.model_validate(
            {
                "model": {"name": "m", "source": {"builtin": "smollm2-135m-instruct"}},
                "engine": engine("servefleet", 1, 2, 0),
                "disaggregation": {"prefill": {}},
            }
        )
    assert GROUP_DISAGGREGATION_MESSAGE in str(err.value)
