"""spec.disaggregation: which transport runs on which engine kind, in pydantic and in CEL."""

from __future__ import annotations

import re
from typing import Any

import pytest
from pydantic import ValidationError

from servefleet.api.crd import crd_manifest
from servefleet.api.disaggregation import TRANSFER_ENGINES, transfer_message
from servefleet.api.llmdeployment import LLMDeployment

KINDS = ("servefleet", "vllm", "sglang")


def doc(kind: str, transfer: str | None, **prefill: Any) -> dict[str, Any]:
    builtin = {"builtin": "smollm2-135m-instruct"}
    source = builtin if kind == "servefleet" else {"pvc": {"claimName": "w"}}
    block: dict[str, Any] = {"prefill": prefill}
    if transfer is not None:
        block["transfer"] = transfer
    return {
        "apiVersion": "servefleet.io/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {"name": "pd"},
        "spec": {
            "model": {"name": "m", "source": source},
            "engine": {"kind": kind},
            "disaggregation": block,
        },
    }


def _spec_rules() -> list[dict[str, str]]:
    schema = crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    rules: list[dict[str, str]] = schema["properties"]["spec"]["x-kubernetes-validations"]
    # The transport rules (the one on parallelism, `test_api_parallel`, is not about them).
    return [r for r in rules if "disaggregation" in r["rule"] and "ParallelSize" not in r["rule"]]


def _cel(rule: str, kind: str, transfer: str | None) -> bool:
    """The rule evaluated by hand: its only CEL constructs, spelled in Python."""
    python = (
        rule.replace("!has(self.disaggregation)", "False")
        .replace(
            "(has(self.disaggregation.transfer) ? self.disaggregation.transfer : 'http')",
            repr(transfer or "http"),
        )
        .replace("self.engine.kind", repr(kind))
        .replace("||", " or ")
    )
    return bool(eval(python))  # our own generated rule text


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("transfer", [None, "http", "nixl", "mooncake"])
def test_pydantic_and_cel_accept_the_same_transports(kind: str, transfer: str | None) -> None:
    allowed = kind in TRANSFER_ENGINES[transfer or "http"]
    cel_ok = all(_cel(r["rule"], kind, transfer) for r in _spec_rules())
    if allowed:
        dep = LLMDeployment.model_validate(doc(kind, transfer))
        assert dep.spec.disaggregation is not None
        assert dep.spec.disaggregation.transfer == (transfer or "http")
    else:
        with pytest.raises(ValidationError, match=re.escape(transfer_message(transfer or "http"))):
            LLMDeployment.model_validate(doc(kind, transfer))
    assert cel_ok == allowed
    failing = [r["message"] for r in _spec_rules() if not _cel(r["rule"], kind, transfer)]
    assert failing == ([] if allowed else [transfer_message(transfer or "http")])


def test_the_messages_name_the_transport_and_the_kinds() -> None:
    assert transfer_message("mooncake") == (
        "disaggregation.transfer mooncake runs only on engine.kind sglang"
    )
    assert "vllm or sglang" in transfer_message("nixl")
    assert "servefleet" in transfer_message("http")


def test_no_block_is_colocated_and_needs_no_transport() -> None:
    plain = doc("vllm", None)
    del plain["spec"]["disaggregation"]
    assert LLMDeployment.model_validate(plain).spec.disaggregation is None


def test_prefill_bounds_are_checked_and_replicas_clamped() -> None:
    with pytest.raises(ValidationError, match="minReplicas must be <= maxReplicas"):
        LLMDeployment.model_validate(doc("servefleet", None, minReplicas=3, maxReplicas=2))
    dep = LLMDeployment.model_validate(doc("servefleet", None, maxReplicas=2, replicas=9))
    assert dep.spec.disaggregation is not None
    assert dep.spec.disaggregation.prefill.desired_replicas() == 2


def test_kubectl_get_wide_shows_the_prefill_pools_ready_replicas() -> None:
    columns = crd_manifest()["spec"]["versions"][0]["additionalPrinterColumns"]
    (prefill,) = [c for c in columns if c["name"] == "Prefill"]
    assert prefill["jsonPath"] == ".status.prefill.readyReplicas"
    assert prefill["priority"] == 1
